"""``nbddp.evaluate`` on one rank: metrics over this rank's block, made exact over the whole set.

Two kinds of metric:

* an object with ``update(outputs, targets)`` and ``compute()`` (a
  torchmetrics ``Metric``): updated batch by batch; its ``compute()`` syncs
  its state over every rank itself (torchmetrics all-gathers or all-reduces
  over the default process group), so F1, AUROC or precision come out as
  one process computes them on the whole set;
* a function ``(outputs, targets) -> one value per sample`` (or the
  batch's mean, weighted by its samples): summed here, and the sums and
  counts all-reduced once; the value is their quotient.

``loss_fn(outputs, targets)`` (a batch mean) is weighted by the batch's
samples the same way. Before the collectives every rank says whether it
failed or was stopped (``agree``), so no rank waits in a collective that a
peer will never join.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from nbddp.worker.data.batches import BatchError


def is_metric_object(metric: Any) -> bool:
    """An object that accumulates over batches and syncs itself (torchmetrics' ``Metric`` protocol)."""
    return callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))


def split_batch(batch: Any) -> tuple[tuple[Any, ...], Any]:
    """``(inputs, targets)`` of a ``(x, y)`` or ``(x1, ..., y)`` batch."""
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return tuple(batch[:-1]), batch[-1]
    raise BatchError(f"nbddp.evaluate needs (x, y) or (x1, ..., y) batches, so that metrics see outputs and targets; "
                     f"got a batch of type {type(batch).__name__}"
                     + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""))


def batch_sum(name: str, value: Any, rows: int) -> float:
    """A metric function's value for one batch, as the sum over its samples.

    One value per sample is summed; one value for the batch is taken as the
    batch's mean and weighted by its samples. Either way the quotient by all
    samples is the exact mean over the whole set.
    """
    values = torch.as_tensor(value).detach()
    if values.numel() == rows:
        return float(values.double().sum())
    if values.numel() == 1:
        return float(values.double()) * rows
    raise ValueError(f"metrics[{name!r}] returned {values.numel()} values for a batch of {rows} samples; a metric "
                     "function returns one value per sample (e.g. (outputs.argmax(1) == targets).float()) or the "
                     "batch's mean, or pass a torchmetrics Metric")


class Scores:
    """What one rank accumulates: metric objects' states, per-sample sums and counts, the loss."""

    def __init__(self, metrics: dict[str, Any], loss_fn: Callable | None, device: torch.device):
        self.objects = {k: m.to(device) if hasattr(m, "to") else m for k, m in metrics.items() if is_metric_object(m)}
        self.functions = {k: f for k, f in metrics.items() if k not in self.objects}
        self.loss_fn = loss_fn
        self.sums = {k: 0.0 for k in self.functions}
        self.counts = {k: 0 for k in self.functions}
        self.loss_sum, self.n = 0.0, 0

    def add(self, outputs: Any, targets: Any, rows: int) -> None:
        for metric in self.objects.values():
            metric.update(outputs, targets)
        for name, fn in self.functions.items():
            self.sums[name] += batch_sum(name, fn(outputs, targets), rows)
            self.counts[name] += rows
        if self.loss_fn is not None:
            self.loss_sum += float(self.loss_fn(outputs, targets)) * rows
        self.n += rows

    def reduced(self, device: torch.device) -> dict[str, Any]:
        """The exact values over every rank's samples (collective: every rank calls it)."""
        names = sorted(self.functions)
        flat = torch.tensor([self.loss_sum, float(self.n), *[self.sums[k] for k in names],
                             *[float(self.counts[k]) for k in names]], dtype=torch.float64, device=device)
        dist.all_reduce(flat)
        flat = flat.cpu().tolist()
        out: dict[str, Any] = {}
        if self.loss_fn is not None:
            out["loss"] = flat[0] / flat[1]
        k = len(names)
        out.update({name: flat[2 + i] / flat[2 + k + i] for i, name in enumerate(names)})
        for name, metric in self.objects.items():  # torchmetrics syncs inside compute(): same order on every rank
            out[name] = plain(metric.compute())
        return dict(sorted(out.items()))


def plain(value: Any) -> Any:
    """A one-element tensor as a float; other tensors on the CPU; anything else as it is."""
    if isinstance(value, torch.Tensor):
        return float(value) if value.numel() == 1 else value.detach().cpu()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def agree(failed: bool, stopped: bool, device: torch.device) -> tuple[bool, bool]:
    """``(any rank failed, any rank was stopped)``: one all-reduce that every rank reaches."""
    flags = torch.tensor([float(failed), float(stopped)], device=device)
    dist.all_reduce(flags)
    return bool(flags[0] > 0), bool(flags[1] > 0)
