"""``gpulayer workers``: the workers a control plane has."""

from __future__ import annotations

from typing import Any

import click

from ..jobs import GpuStats
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
    Column("GPU USE"),  # last: scripts that read the columns before it by place still do
)
_GIB = 1024**3


@main.command()
@click.option(
    "--json", "as_json", is_flag=True, help="Print JSON for scripts (see docs/json-output.md)."
)
@click.pass_context
def workers(ctx: click.Context, as_json: bool) -> None:
    """List the workers connected to the control plane, with each GPU's
    latest utilisation, memory in use and temperature."""
    found = _client(ctx).workers()
    if as_json:
        output.print_json(
            [
                {**output.worker_object(w), "gpu_stats": [gpu_object(s) for s in w.gpu_stats]}
                for w in found
            ]
        )
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
                ", ".join(gpu_use(s) for s in w.gpu_stats),
            )
            for w in found
        ],
    )


def gpu_use(stats: GpuStats) -> str:
    """``0: 87% 41.2/80.0 GiB 65°C``; a figure the GPU does not report is ``-``."""
    use = "-" if stats.utilization is None else f"{stats.utilization:.0f}%"
    if stats.memory_used is None or stats.memory_total is None:
        memory = "-"
    else:
        memory = f"{stats.memory_used / _GIB:.1f}/{stats.memory_total / _GIB:.1f} GiB"
    temperature = "-" if stats.temperature is None else f"{stats.temperature:.0f}°C"
    return f"{stats.index}: {use} {memory} {temperature}"


def gpu_object(stats: GpuStats) -> dict[str, Any]:
    """A GPU's figures as ``workers --json`` gives them (every key, null where unknown)."""
    return {
        "index": stats.index,
        "uuid": stats.uuid,
        "name": stats.name,
        "utilization": stats.utilization,
        "memory_used": stats.memory_used,
        "memory_total": stats.memory_total,
        "temperature": stats.temperature,
        "power": stats.power,
        "time": stats.time,
    }
