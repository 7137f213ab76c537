"""``gpulayer usage``: what each project has used of the machines lately."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from . import output
from .output import Column
from .root import _client, main

if TYPE_CHECKING:
    from ..projects import ProjectUsage

USAGE_COLUMNS = (
    Column("PROJECT"),
    Column("GPU-H 24H"),
    Column("GPU-H 7D"),
    Column("RUNNING"),
    Column("WAITING"),
    Column("GPUS HELD"),
    Column("QUOTA"),
)


def quota_text(row: ProjectUsage) -> str:
    """The QUOTA cell: ``8 GPUs``, ``16 slots``, both, or ``none`` (no limit)."""
    parts = []
    if row.gpu_quota is not None:
        parts.append(f"{row.gpu_quota} GPU{'s' if row.gpu_quota != 1 else ''}")
    if row.slot_quota is not None:
        parts.append(f"{row.slot_quota} slot{'s' if row.slot_quota != 1 else ''}")
    return ", ".join(parts) or "none"


def usage_object(row: ProjectUsage) -> dict[str, Any]:
    """A project's usage as ``usage --json`` gives it (docs/json-output.md)."""
    return {
        "schema": output.JSON_SCHEMA,
        "project": row.project,
        "gpu_hours_day": row.gpu_hours_day,
        "gpu_hours_week": row.gpu_hours_week,
        "running": row.running,
        "waiting": row.waiting,
        "gpus_held": row.gpus_held,
        "slots_held": row.slots_held,
        "gpu_quota": row.gpu_quota,
        "slot_quota": row.slot_quota,
        "fair_share_usage": row.fair_share_usage,
        "only_yours": row.only_yours,
    }


@main.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for scripts (see docs/json-output.md)."
)
@click.pass_context
def usage(ctx: click.Context, as_json: bool) -> None:
    """Usage by project: GPU-hours over the last 24 hours and 7 days, jobs
    running and waiting, GPUs held, quota. A user sees the projects they
    belong to, and their own jobs in the default project; an admin, every
    project; embedded, the one project, default."""
    rows = _client(ctx).usage()
    if as_json:
        output.print_json([usage_object(r) for r in rows])
        return
    output.table(
        USAGE_COLUMNS,
        [
            (
                r.project,
                f"{r.gpu_hours_day:.1f}",
                f"{r.gpu_hours_week:.1f}",
                str(r.running),
                str(r.waiting),
                str(r.gpus_held),
                quota_text(r),
            )
            for r in rows
        ],
    )
