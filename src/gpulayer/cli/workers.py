"""``gpulayer workers``: the workers a control plane has."""

from __future__ import annotations

import click

from . import output
from .output import Column
from .root import _client, main

WORKER_COLUMNS = (
    Column("ID"),
    Column("NAME"),
    Column("HOST"),
    Column("SLOTS"),
    Column("GPUS"),
    Column("CONTAINMENT"),
    Column("RUNNING"),
)


@main.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for scripts (see docs/json-output.md)."
)
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """List the workers connected to the control plane."""
    found = _client(ctx).workers()
    if as_json:
        output.print_json([output.worker_object(w) for w in found])
        return
    output.table(
        WORKER_COLUMNS,
        [
            (
                w.id,
                w.name,
                w.host,
                str(len(w.slot_gpus)),
                ", ".join(w.gpu_names),
                w.containment,
                ", ".join(w.running),
            )
            for w in found
        ],
    )
