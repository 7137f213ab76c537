"""docs/trainer.md's table of Lightning names stays true.

Each row's first cell is code. A row marked *supported* or *differs* must run
with ``L`` being ``gpulayer.train``; a row marked *refused* must raise
TrainerError naming what it refuses (the keyword argument, or the name).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import gpulayer.train as L
from gpulayer.train import TrainerError

pytestmark = pytest.mark.torch

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainer.md"
STATUSES = ("supported", "differs", "refused")


def table_rows() -> list[tuple[str, str]]:
    text = DOC.read_text()
    start, end = "<!-- lightning-names-table -->", "<!-- /lightning-names-table -->"
    assert text.count(start) == 1 and text.count(end) == 1, "the table's markers are missing"
    body = text.split(start, 1)[1].split(end, 1)[0]
    rows = []
    for line in body.strip().splitlines()[2:]:  # past the header and its rule
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        code = re.fullmatch(r"`([^`]+)`", cells[0])
        assert code, f"the first cell must be one piece of code: {line}"
        assert cells[1] in STATUSES, f"status {cells[1]!r} not one of {STATUSES}: {line}"
        rows.append((code[1], cells[1]))
    return rows


ROWS = table_rows()


@pytest.fixture(autouse=True)
def _seed_vars(monkeypatch: pytest.MonkeyPatch) -> None:
    # A seed_everything row sets these, as Lightning does; none may leak out.
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


def refused_name(code: str) -> str:
    """The keyword argument a call refuses, or the last name of an attribute."""
    node = ast.parse(code, mode="eval").body
    if isinstance(node, ast.Call):
        keywords = [k.arg for k in node.keywords if k.arg]
        assert keywords, f"a refused call names its argument as a keyword: {code}"
        return keywords[-1]
    assert isinstance(node, ast.Attribute), code
    return node.attr


def test_the_table_covers_each_status() -> None:
    assert {status for _, status in ROWS} == set(STATUSES)
    assert len(ROWS) == len({code for code, _ in ROWS}), "a row is repeated"


@pytest.mark.parametrize(("code", "status"), ROWS, ids=[code for code, _ in ROWS])
def test_row_is_true(code: str, status: str, tmp_path: Path) -> None:
    before = sorted(tmp_path.iterdir())
    if status == "refused":
        with pytest.raises(TrainerError) as caught:
            eval(code, {"L": L})
        assert refused_name(code) in str(caught.value)
    else:
        eval(code, {"L": L})
    assert sorted(tmp_path.iterdir()) == before  # building things writes nothing
