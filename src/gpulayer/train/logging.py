"""Sync-free metric accumulation behind ``Module.log``.

A logged tensor is detached and kept where it is: on the GPU for a GPU run.
Per-step values are held by reference (the latest one wins); per-epoch values
are folded into an on-device accumulator with one small kernel per call. The
host sees them only when :func:`to_host` is called, which the loop does every
``log_every_n_steps`` optimizer steps and at the end of an epoch, and which
reads every metric of a device in one transfer.

A ``torchmetrics.Metric`` may be logged too, as in Lightning: the user updates
it on the device (``self.acc(preds, y)``); per step the store keeps a
reference to the value of its last forward call, and at the end of the epoch
it calls ``compute()`` (which also syncs the metric across ranks) and then
``reset()``. torchmetrics is never imported here: a Metric can only exist if
its package is already loaded.

Names are reported as Lightning reports them. A value logged with both
``on_step`` and ``on_epoch`` is ``name_step`` and ``name_epoch`` for the
loggers, and also plain ``name`` for the callbacks (the step value during the
epoch, the epoch value after it), so that ``EarlyStopping(monitor="name")``
works; :meth:`MetricStore.keys_where` leaves the plain name out. With several
evaluation dataloaders, a value logged from dataloader ``i`` gets the suffix
``/dataloader_idx_{i}`` unless ``add_dataloader_idx=False``.

Values reach the loggers (:func:`log_to_loggers`) at Lightning's steps: the
number of training batches that ended with an optimizer step *before* the
current one (Lightning's ``_batches_that_stepped``), so the first batch's
values are at step 0; a validation inside ``fit`` at that same count, the
epoch's training values at the count of the epoch's last stepping batch, and
an evaluation batch's per-step values at the number of batches of its
dataloader that came before it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from gpulayer.train.errors import TrainerError, invalid_choice

if TYPE_CHECKING:
    from gpulayer.train.loggers import Logger

REDUCE_FX = ("mean", "sum", "max", "min")
#: Lightning's suffix for a value logged from one of several dataloaders.
DATALOADER_SUFFIX = "/dataloader_idx_{}"

Value = torch.Tensor | float
#: Reduces a packed float32 tensor across ranks with op "sum", "max" or "min".
Reducer = Callable[[torch.Tensor, str], torch.Tensor]


@dataclass(slots=True)
class _Metric:
    prog_bar: bool
    logger: bool
    on_step: bool
    on_epoch: bool
    reduce_fx: str
    sync_dist: bool
    #: The dataloader it was logged from (None: one dataloader, or an epoch-end hook).
    dataloader_idx: int | None = None
    add_dataloader_idx: bool = True
    last: Value | None = None
    total: Value | None = None
    weight: float = 0.0
    source: Any = None  # the torchmetrics Metric logged under this name, if one was
    computed: torch.Tensor | None = None  # its compute() at the epoch end
    done: bool = False  # computed (when on_epoch) and reset for this epoch


def is_metric_object(value: Any) -> bool:
    """Whether ``value`` is a ``torchmetrics.Metric`` (without importing torchmetrics)."""
    torchmetrics = sys.modules.get("torchmetrics")
    return torchmetrics is not None and isinstance(value, torchmetrics.Metric)


def infer_batch_size(batch: Any) -> int:
    """The leading dimension of the first tensor in ``batch`` (1 if none)."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() > 0 else 1
    if isinstance(batch, Mapping):
        batch = list(batch.values())
    if isinstance(batch, list | tuple):
        for item in batch:
            size = infer_batch_size(item)
            if size != 1 or isinstance(item, torch.Tensor):
                return size
    return 1


def _fold(total: Value, value: Value, reduce_fx: str, weight: float) -> Value:
    if reduce_fx == "max" or reduce_fx == "min":
        if isinstance(total, torch.Tensor) or isinstance(value, torch.Tensor):
            pick = torch.maximum if reduce_fx == "max" else torch.minimum
            return pick(torch.as_tensor(total), torch.as_tensor(value).to(torch.float32))
        return max(total, value) if reduce_fx == "max" else min(total, value)
    if isinstance(total, torch.Tensor):
        return total.add_(value, alpha=weight) if weight != 1 else total.add_(value)
    if isinstance(value, torch.Tensor):
        return value.to(torch.float32) * weight + total
    return total + value * weight


def _start(value: Value, reduce_fx: str, weight: float) -> Value:
    if isinstance(value, torch.Tensor):
        # A fresh float32 copy: the accumulator is updated in place afterwards.
        total = value.to(torch.float32, copy=True).reshape(())
        return total.mul_(weight) if reduce_fx == "mean" and weight != 1 else total
    return value * weight if reduce_fx == "mean" else value


class MetricStore:
    """What one stage (training or validation) logged during the current epoch."""

    def __init__(self, *, on_step: bool, on_epoch: bool) -> None:
        self.default_on_step = on_step
        self.default_on_epoch = on_epoch
        self.batch: Any = None  # the batch being processed, for batch-size inference
        #: Set by the evaluation loop while one of several dataloaders runs.
        self.dataloader_idx: int | None = None
        # Keyed by (name, dataloader index) as Lightning keys them: the index
        # only when it goes into the reported name.
        self._metrics: dict[tuple[str, int | None], _Metric] = {}
        #: Calls of :meth:`log` so far: a host integer that says whether values
        #: read earlier are still the latest, without reading anything.
        self.calls = 0

    def log(
        self,
        name: str,
        value: Any,
        *,
        prog_bar: bool = False,
        logger: bool = True,
        on_step: bool | None = None,
        on_epoch: bool | None = None,
        reduce_fx: str = "mean",
        batch_size: int | None = None,
        sync_dist: bool = False,
        add_dataloader_idx: bool = True,
    ) -> None:
        self.calls += 1
        index = self.dataloader_idx
        key = (name, index if add_dataloader_idx else None)
        metric = self._metrics.get(key)
        if metric is None:
            metric = self._define(name, prog_bar, logger, on_step, on_epoch, reduce_fx, sync_dist)
            metric.dataloader_idx, metric.add_dataloader_idx = index, add_dataloader_idx
            self._metrics[key] = metric
        elif metric.dataloader_idx != index:
            # As Lightning: one name from two dataloaders would mix their values.
            raise TrainerError(
                f"self.log({name!r}, ..., add_dataloader_idx=False) was called from "
                f"{_origin(metric.dataloader_idx)} and from {_origin(index)}; give each "
                f"dataloader its own name, or leave add_dataloader_idx=True to add "
                f"/dataloader_idx_N"
            )
        if is_metric_object(value):
            self._log_metric_object(name, metric, value)
            return
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise TrainerError(
                    f"self.log({name!r}, ...) got a tensor of shape {tuple(value.shape)}; "
                    f"log one value (a 0-d or 1-element tensor, or a number)"
                )
            value = value.detach()
        elif isinstance(value, int | float) and not isinstance(value, bool):
            value = float(value)
        else:
            raise TrainerError(
                f"self.log({name!r}, ...) got {type(value).__name__}; valid values: a "
                f"1-element tensor, an int, a float or a torchmetrics Metric"
            )
        if metric.on_step:
            metric.last = value
        if metric.on_epoch:
            weight = 1.0
            if metric.reduce_fx == "mean":
                weight = float(
                    batch_size if batch_size is not None else infer_batch_size(self.batch)
                )
            if metric.total is None:
                metric.total = _start(value, metric.reduce_fx, weight)
            else:
                metric.total = _fold(metric.total, value, metric.reduce_fx, weight)
            metric.weight += weight

    def _log_metric_object(self, name: str, metric: _Metric, value: Any) -> None:
        if metric.source is not None and metric.source is not value:
            raise TrainerError(
                f"self.log({name!r}, ...) got a different {type(value).__name__} object than "
                f"before under the same name; log one Metric object per name"
            )
        metric.source = value
        if metric.on_step:
            # The value of the batch the user just passed to the metric: a
            # reference to a device tensor, nothing is read.
            cache = getattr(value, "_forward_cache", None)
            if isinstance(cache, torch.Tensor):
                metric.last = cache.detach()

    def _define(
        self,
        name: str,
        prog_bar: bool,
        logger: bool,
        on_step: bool | None,
        on_epoch: bool | None,
        reduce_fx: str,
        sync_dist: bool,
    ) -> _Metric:
        if not isinstance(name, str) or not name:
            raise TrainerError(f"self.log(name={name!r}) needs a non-empty string name")
        if reduce_fx not in REDUCE_FX:
            raise invalid_choice(f"self.log({name!r}, reduce_fx)", reduce_fx, REDUCE_FX)
        step = self.default_on_step if on_step is None else on_step
        epoch = self.default_on_epoch if on_epoch is None else on_epoch
        if not (step or epoch):
            raise TrainerError(
                f"self.log({name!r}, on_step=False, on_epoch=False) would record nothing; "
                f"set on_step=True or on_epoch=True"
            )
        return _Metric(prog_bar, logger, step, epoch, reduce_fx, sync_dist)

    @staticmethod
    def _key(name: str, metric: _Metric, suffix: str | None) -> str:
        """The name reported: ``name_{suffix}`` when forked (None: the plain name),
        then the dataloader suffix."""
        if suffix is not None and metric.on_step and metric.on_epoch:
            name = f"{name}_{suffix}"
        if metric.add_dataloader_idx and metric.dataloader_idx is not None:
            name += DATALOADER_SUFFIX.format(metric.dataloader_idx)
        return name

    def _with_plain_names(self, values: dict[str, Value], suffix: str) -> dict[str, Value]:
        # Lightning's callback_metrics also hold a forked value under its plain
        # name; the same tensor, so nothing more is read.
        for (name, _), m in self._metrics.items():
            key = self._key(name, m, suffix)
            if m.on_step and m.on_epoch and key in values:
                values[self._key(name, m, None)] = values[key]
        return values

    def step_values(self) -> dict[str, Value]:
        """The latest value of each per-step metric, still on its device (a forked
        one as ``name_step`` and as ``name``)."""
        values = {
            self._key(name, m, "step"): m.last
            for (name, _), m in self._metrics.items()
            if m.on_step and m.last is not None
        }
        return self._with_plain_names(values, "step")

    def logged_step_values(self, dataloader_idx: int | None) -> dict[str, Value]:
        """The latest per-step values with ``logger=True`` logged from
        ``dataloader_idx`` (as reported, never plain): what an evaluation batch
        hands to the loggers, as Lightning's per-dataloader results do."""
        return {
            self._key(name, m, "step"): m.last
            for (name, _), m in self._metrics.items()
            if m.on_step and m.logger and m.last is not None and m.dataloader_idx == dataloader_idx
        }

    def epoch_values(
        self, reducer: Reducer | None = None, *, reset_metric_objects: bool = True
    ) -> dict[str, Value]:
        """Each per-epoch metric reduced over the epoch (and ranks, if sync_dist);
        a forked one as ``name_epoch`` and as ``name``. ``reset_metric_objects=False``
        leaves the torchmetrics Metrics to be reset by a later call (a read before
        the epoch-end hooks, which may still use them)."""
        out: dict[str, Value] = {}
        shared: dict[str, list[tuple[str, _Metric]]] = {}
        self._compute_metric_objects(reset_metric_objects)
        for (name, _), m in self._metrics.items():
            if m.source is not None:
                if m.on_epoch and m.computed is not None:
                    out[self._key(name, m, "epoch")] = m.computed
                continue
            if not m.on_epoch or m.total is None:
                continue
            key = self._key(name, m, "epoch")
            if reducer is not None and m.sync_dist:
                shared.setdefault(m.reduce_fx, []).append((key, m))
            else:
                out[key] = m.total / m.weight if m.reduce_fx == "mean" else m.total
        for reduce_fx, items in shared.items():
            out.update(_reduce_across_ranks(reduce_fx, items, reducer))  # type: ignore[arg-type]
        return self._with_plain_names(out, "epoch")

    def _compute_metric_objects(self, reset: bool) -> None:
        # Once per epoch, as Lightning does: compute the on_epoch ones, then
        # reset every Metric logged this epoch. A second call reuses the result.
        for (name, _), m in self._metrics.items():
            if m.source is None or m.done:
                continue
            if m.on_epoch and m.computed is None:
                value = m.source.compute()
                if not isinstance(value, torch.Tensor) or value.numel() != 1:
                    shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
                    raise TrainerError(
                        f"self.log({name!r}, {type(m.source).__name__}): its compute() "
                        f"returned {type(value).__name__}"
                        f"{f' of shape {shape}' if shape is not None else ''}; log a Metric "
                        f"that computes one value, or log its entries one by one"
                    )
                m.computed = value.detach().reshape(())
            if reset:
                m.source.reset()
                m.done = True

    def keys_where(self, flag: str) -> set[str]:
        """Names (as reported) of the metrics with ``prog_bar`` or ``logger`` set;
        a forked one as ``name_step`` and ``name_epoch``, never plain."""
        keys: set[str] = set()
        for (name, _), m in self._metrics.items():
            if getattr(m, flag):
                keys.update({self._key(name, m, "step"), self._key(name, m, "epoch")})
        return keys

    def logged_epoch_keys(self) -> set[str]:
        """Names (as reported, never plain) of the per-epoch values with
        ``logger=True``: what the end of a loop hands to the loggers."""
        return {
            self._key(name, m, "epoch")
            for (name, _), m in self._metrics.items()
            if m.on_epoch and m.logger
        }

    def epoch_keys(self, dataloader_idx: int | None, *, logged: bool) -> set[str]:
        """Names (as reported) of the per-epoch values logged from ``dataloader_idx``
        (None: with one dataloader, or in an epoch-end hook). ``logged``: only
        those with ``logger=True``, without the plain names, as Lightning's
        ``test()`` results; else also the plain names, as its callback metrics."""
        keys: set[str] = set()
        for (name, _), m in self._metrics.items():
            if m.on_epoch and m.dataloader_idx == dataloader_idx and (m.logger or not logged):
                keys.add(self._key(name, m, "epoch"))
                if not logged:
                    keys.add(self._key(name, m, None))
        return keys

    def reset(self) -> None:
        self._metrics.clear()
        self.batch = None
        self.dataloader_idx = None


def _origin(dataloader_idx: int | None) -> str:
    return "an epoch-end hook" if dataloader_idx is None else f"dataloader {dataloader_idx}"


def _device_of(items: list[tuple[str, _Metric]]) -> torch.device:
    for _, m in items:
        if isinstance(m.total, torch.Tensor):
            return m.total.device
    return torch.device("cpu")


def _reduce_across_ranks(
    reduce_fx: str, items: list[tuple[str, _Metric]], reducer: Reducer
) -> dict[str, Value]:
    # One collective per reduce_fx for all metrics: pack, reduce, unpack.
    device = _device_of(items)
    parts = [torch.as_tensor(m.total, dtype=torch.float32, device=device) for _, m in items]
    if reduce_fx in ("mean", "sum"):
        weights = torch.tensor([m.weight for _, m in items], dtype=torch.float32, device=device)
        packed = reducer(torch.cat([torch.stack(parts), weights]), "sum")
        n = len(items)
        values = packed[:n] / packed[n:] if reduce_fx == "mean" else packed[:n]
    else:
        values = reducer(torch.stack(parts), reduce_fx)
    return {key: values[i] for i, (key, _) in enumerate(items)}


def log_to_loggers(
    loggers: Sequence[Logger],
    metrics: Mapping[str, float],
    step: int,
    epoch: int | None = None,
) -> None:
    """Hand ``metrics`` to each logger, as Lightning's trainer does.

    With ``epoch`` (what the loops log, at the fit loop's count ``step``), an
    ``"epoch"`` value is added unless one was logged, and a value logged as
    ``"step"`` is taken out and used as the step instead; without it (an
    evaluation batch's values, at that batch's own step) they go as they are.
    Nothing is sent when there is nothing to send.
    """
    if not metrics or not loggers:
        return
    values = dict(metrics)
    if epoch is not None:
        logged_step = values.pop("step", None)
        if logged_step is not None:
            step = int(logged_step)
        else:
            values.setdefault("epoch", float(epoch))
    for logger in loggers:
        logger.log_metrics(values, step)


def to_host(values: Mapping[str, Value]) -> dict[str, float]:
    """Read ``values`` to Python floats: one device-to-host transfer per device."""
    out: dict[str, float] = {}
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor):
            by_device.setdefault(value.device, []).append((key, value))
        else:
            out[key] = value
    for items in by_device.values():
        stacked = torch.stack([t.reshape(()).to(torch.float32) for _, t in items])
        for (key, _), number in zip(items, stacked.tolist(), strict=True):
            out[key] = number
    return {key: out[key] for key in values}
