from __future__ import annotations

import pytest

from gpulayer.errors import SpecError
from gpulayer.spec import JobSpec, parse_spec

DIGEST = "a" * 64


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        ({"command": ["x"], "gpus": -1}, "gpus", "must be a whole number, 0 or more; got -1"),
        ({"command": ["x"], "gpu": 1}, "gpu", "unknown field; did you mean 'gpus'?"),
        ({"command": "python x.py"}, "command", "must be a list (the program and its arguments"),
        ({"command": []}, "command", "must name a program"),
        ({"command": ["x"], "timeout": 0}, "timeout", "must be a number, more than 0; got 0"),
        ({"command": ["x"], "max_retries": -2}, "max_retries", "0 or more; got -2"),
        (
            {"command": ["x"], "priority": "high"},
            "priority",
            "must be a whole number; got 'high' (a string)",
        ),
        ({"command": ["x"], "env": {"1BAD": "v"}}, "env.1BAD", "environment variable"),
        ({"command": ["x"], "outputs": ["/etc/passwd"]}, "outputs[0]", "absolute"),
        ({"command": ["x"], "outputs": ["a/../../b"]}, "outputs[0]", "inside"),
        (
            {"command": ["x"], "inputs": {"../x": {"kind": "file", "digest": DIGEST}}},
            "inputs.../x",
            "input name",
        ),
        (
            {"command": ["x"], "inputs": {"d": {"kind": "file", "digest": "nothex"}}},
            "inputs.d.digest",
            "must be a sha256 digest: 64 lowercase hex digits; got 'nothex'",
        ),
        ({"script": "../up.py", "bundle": DIGEST}, "script", "inside"),
        ({"script": "train.py"}, "bundle", "needs the bundle"),
        ({}, "command", "exactly one"),
        ({"command": ["x"], "script": "a.py", "bundle": DIGEST}, "command", "exactly one"),
        ({"command": ["x"], "name": "  "}, "name", "blank"),
        (
            {"command": ["x"], "launcher": "mpirun"},
            "launcher",
            "'mpirun' is not allowed; allowed: direct, torchrun",
        ),
        (
            {"command": ["x"], "env": {"A": "ok", "B": 5}},
            "env.B",
            "must be a string; got 5 (an int)",
        ),
        ({"command": ["x"], "labels": {"team": 1}}, "labels.team", "must be a string; got 1"),
        ({"command": ["x", 3]}, "command[1]", "must be a string; got 3"),
        (
            {"command": ["x"], "inputs": {"d": {"kind": "blob", "digest": DIGEST}}},
            "inputs.d.kind",
            "'blob' is not allowed; allowed: file, dir",
        ),
        (
            {"command": ["x"], "inputs": {"d": {"kind": "file", "digest": DIGEST, "sise": 1}}},
            "sise",
            "unknown field in inputs.d; did you mean 'size'?",
        ),
        ({"command": ["x"], "prority": 1}, "prority", "did you mean 'priority'?"),
    ],
)
def test_bad_specs_name_the_field(data: dict[str, object], field: str, words: str) -> None:
    with pytest.raises(SpecError) as info:
        parse_spec(data)
    assert info.value.field == field
    assert words in str(info.value)


def test_a_good_spec_round_trips() -> None:
    spec = parse_spec(
        {
            "script": "train.py",
            "args": ["--lr", "3e-4"],
            "bundle": DIGEST,
            "inputs": {"data": {"kind": "dir", "digest": DIGEST, "size": 10}},
            "outputs": ["model.pt", "ckpt/*.pt"],
            "env": {"SEED": "1"},
            "gpus": 2,
            "priority": 5,
            "max_retries": 1,
            "timeout": 3.5,
            "name": "train",
            "labels": {"team": "nlp"},
        }
    )
    assert isinstance(spec, JobSpec)
    assert spec.gpus == 2 and spec.inputs["data"].kind == "dir"
    assert parse_spec(spec) is spec


def test_distributed_shapes_are_accepted_and_their_limits_named() -> None:
    spec = parse_spec({"command": ["x"], "nodes": 2, "procs_per_node": 2, "gpus": 2})
    assert spec.world_size == 4 and spec.distributed
    assert parse_spec({"command": ["x"], "launcher": "torchrun"}).distributed
    assert not parse_spec({"command": ["x"]}).distributed
    with pytest.raises(SpecError, match="gpus is per node") as info:
        parse_spec({"command": ["x"], "procs_per_node": 4, "gpus": 2})
    assert info.value.field == "procs_per_node"
    with pytest.raises(SpecError, match="at most 1024 nodes") as info:
        parse_spec({"command": ["x"], "nodes": 5000})
    assert info.value.field == "nodes"
    with pytest.raises(SpecError, match="allowed: direct, torchrun") as info:
        parse_spec({"command": ["x"], "nodes": 2, "launcher": "mpirun"})
    assert info.value.field == "launcher"


@pytest.mark.parametrize("value", [918273645501, ["sk-live-abcdef"], {"k": "sk-live-abcdef"}, 1.5])
def test_a_secrets_value_is_never_echoed_in_a_spec_error(value: object) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec({"command": ["true"], "secrets": {"AWS_PIN": value}})
    assert caught.value.field == "secrets.AWS_PIN"
    assert "must be a string" in str(caught.value) and "not shown" in str(caught.value)
    for shown in ("918273645501", "sk-live", "1.5"):
        assert shown not in str(caught.value)


@pytest.mark.parametrize(("field", "key"), [("env", 5), ("labels", True), ("secrets", 1.5)])
def test_a_key_that_is_not_a_string_is_said_in_plain_words(field: str, key: object) -> None:
    with pytest.raises(SpecError) as caught:
        parse_spec({"command": ["x"], field: {key: "v"}})
    assert caught.value.field == field
    assert "its keys must be strings" in str(caught.value) and "Expected" not in str(caught.value)


@pytest.mark.parametrize("field", ["gpus", "command", "launcher", "timeout", "env"])
def test_text_that_is_not_unicode_is_a_spec_error_naming_its_field(field: str) -> None:
    """YAML reads "\\ud800" as a lone surrogate; msgspec then fails with a
    UnicodeEncodeError, not a validation error."""
    import yaml

    value = '{A: "\\ud800"}' if field == "env" else '"\\ud800"'
    data = yaml.safe_load(f"command: [python, x.py]\n{field}: {value}\n")
    with pytest.raises(SpecError) as caught:
        parse_spec(data)
    assert caught.value.field == ("env.A" if field == "env" else field)
    assert "lone surrogate" in str(caught.value)
