"""A table of a module's layers and parameter counts, as Lightning's ModelSummary prints.

::

      | Name | Type       | Params | Mode
    -------------------------------------------
    0 | net  | Sequential | 49     | train
    -------------------------------------------
    49        Trainable params
    0         Non-trainable params
    49        Total params
    0.000     Total estimated model params size (MB)
    3         Modules in train mode
    0         Modules in eval mode

Counting reads only shapes and flags on the host: nothing waits on the device.
Lightning's FLOPs column (which runs the model on ``example_input_array``) is
left out.
"""

from __future__ import annotations

import math

import torch
from torch.nn.parameter import UninitializedParameter

_UNITS = ("", "K", "M", "B", "T")


def human_count(number: int | None) -> str:
    """``49``, ``1.2 K``, ``123 K``, ``4.5 M``...: Lightning's short form; ``?`` if unknown."""
    if number is None:
        return "?"
    if number < 1000:
        return str(number)
    group = min(int(math.log10(number)) // 3, len(_UNITS) - 1)
    scaled = number / 10 ** (3 * group)
    shown = f"{int(scaled):,d}" if scaled >= 100 else f"{scaled:,.1f}"
    return f"{shown} {_UNITS[group]}"


def _count(params: list[torch.nn.Parameter]) -> int | None:
    # A lazy module's parameters have no size until its first forward.
    if any(isinstance(p, UninitializedParameter) for p in params):
        return None
    return sum(p.numel() for p in params)


def _rows(module: torch.nn.Module, max_depth: int) -> list[tuple[str, str, str, str]]:
    rows = []
    for name, layer in module.named_modules():
        if not name or (max_depth >= 0 and name.count(".") + 1 > max_depth):
            continue
        count = _count(list(layer.parameters()))
        mode = "train" if layer.training else "eval"
        rows.append((name, type(layer).__name__, human_count(count), mode))
    return rows


def model_summary(module: torch.nn.Module, max_depth: int = 1) -> str:
    """The table Lightning's ``ModelSummary(max_depth)`` prints: one row per
    layer down to ``max_depth`` levels (-1: all; 0: totals only), then the
    trainable, non-trainable and total parameter counts and their size."""
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < -1:
        from gpulayer.train.errors import TrainerError

        raise TrainerError(f"model_summary(max_depth={max_depth!r}) must be an int >= -1")
    params = list(module.parameters())  # each shared parameter once
    trainable = _count([p for p in params if p.requires_grad])
    frozen = _count([p for p in params if not p.requires_grad])
    total = _count(params)
    size_mb = sum(p.numel() * p.element_size() for p in params) / 1e6 if total is not None else None
    layers = [m for name, m in module.named_modules() if name]
    lines = []
    rows = _rows(module, max_depth)
    if rows:
        header = ("", "Name", "Type", "Params", "Mode")
        table = [(str(i), *row) for i, row in enumerate(rows)]
        widths = [max(len(r[c]) for r in (header, *table)) for c in range(len(header))]
        lines.append(_join(header, widths))
        rule = "-" * len(lines[0])
        lines.append(rule)
        lines.extend(_join(r, widths) for r in table)
        lines.append(rule)
    lines += [
        f"{human_count(trainable):<10}Trainable params",
        f"{human_count(frozen):<10}Non-trainable params",
        f"{human_count(total):<10}Total params",
        f"{'?' if size_mb is None else f'{size_mb:,.3f}':<10}"
        "Total estimated model params size (MB)",
        f"{sum(m.training for m in layers):<10}Modules in train mode",
        f"{sum(not m.training for m in layers):<10}Modules in eval mode",
    ]
    return "\n".join(lines)


def _join(cells: tuple[str, ...], widths: list[int]) -> str:
    return " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
