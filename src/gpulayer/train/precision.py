"""Numeric precision of the training step: one class per way of doing it.

====================  ==========================================================
``"32"``              plain float32, no autocast
``"bf16-mixed"``      ``torch.autocast`` to bfloat16 on every device; no scaler
``"16-mixed"``        ``torch.autocast`` to float16; on CUDA (and ROCm) the loss
                      goes through a ``GradScaler``. Elsewhere no scaler runs, so
                      small gradients can underflow: a warning says so and
                      ``"bf16-mixed"`` is the better choice there.
====================  ==========================================================
"""

from __future__ import annotations

import contextlib
import warnings
from abc import ABC, abstractmethod
from typing import Any

import torch

from gpulayer.train.errors import invalid_choice

PRECISIONS = ("32", "bf16-mixed", "16-mixed")
# Spellings Lightning users already have in their scripts.
_ALIASES: dict[object, str] = {
    "32": "32",
    32: "32",
    "32-true": "32",
    "bf16-mixed": "bf16-mixed",
    "16-mixed": "16-mixed",
}


def parse_precision(value: object) -> str:
    """The canonical name of ``value``, or a TrainerError listing the valid ones."""
    try:
        return _ALIASES[value]
    except (KeyError, TypeError):
        raise invalid_choice("precision", value, PRECISIONS) from None


class Precision(ABC):
    """How a step's forward runs, and how its loss reaches the optimizer."""

    name: str

    @abstractmethod
    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()  # type: ignore[no-untyped-call]

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 - optional
        """Bring gradients to their true scale (before clipping)."""

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional
        """Restore what :meth:`state_dict` returned."""


class FullPrecision(Precision):
    name = "32"
    # One reusable no-op context: entering it costs next to nothing each step.
    _NULL = contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return self._NULL


class MixedPrecision(Precision):
    """Autocast to ``dtype``; with a ``GradScaler`` when one is given."""

    def __init__(
        self,
        name: str,
        device_type: str,
        dtype: torch.dtype,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.name = name
        self.device_type = device_type
        self.dtype = dtype
        self.scaler = scaler

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is None:
            loss.backward()  # type: ignore[no-untyped-call]
        else:
            self.scaler.scale(loss).backward()  # type: ignore[no-untyped-call]

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        # GradScaler.step reads its inf check on the host unless the optimizer
        # takes the scale itself (Adam/AdamW/SGD with fused=True): see docs.
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])


def make_precision(value: object, device: torch.device) -> Precision:
    """The Precision that ``value`` names, set up for ``device``."""
    name = parse_precision(value)
    if name == "32":
        return FullPrecision()
    if name == "bf16-mixed":
        return MixedPrecision(name, device.type, torch.bfloat16)
    if device.type == "cuda":
        return MixedPrecision(name, "cuda", torch.float16, torch.amp.GradScaler("cuda"))
    warnings.warn(
        f"precision='16-mixed' on {device.type} runs autocast to float16 without a "
        f"gradient scaler (GPUlayer scales the loss on CUDA/ROCm only), so small "
        f"gradients can underflow to zero; precision='bf16-mixed' avoids that",
        UserWarning,
        stacklevel=3,
    )
    return MixedPrecision(name, device.type, torch.float16)
