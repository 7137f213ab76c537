"""``gpulayer workers``: the workers a control plane has."""

from __future__ import annotations

import click

from .root import _client, main


@main.command()
@click.pass_context
def workers(ctx: click.Context) -> None:
    """List the workers connected to the control plane."""
    from rich.console import Console
    from rich.table import Table

    table = Table("ID", "NAME", "HOST", "SLOTS", "GPUS", "CONTAINMENT", "RUNNING", box=None)
    for w in _client(ctx).workers():
        gpus = ", ".join(w.gpu_names) if w.gpu_names else "-"
        table.add_row(
            w.id,
            w.name,
            w.host,
            str(len(w.slot_gpus)),
            gpus,
            w.containment or "-",
            ", ".join(w.running) or "-",
        )
    Console().print(table)
