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

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist

from nbddp.worker.data.batches import BatchError


def is_metric_object(metric: Any) -> bool:
    """An object that accumulates over batches and syncs itself (torchmetrics' ``Metric`` protocol)."""
    return callable(getattr(metric, "update", None)) and callable(getattr(metric, "compute", None))


def targets_of(batch: Any, target_fn: Callable | None) -> Any:
    """The batch's targets: ``target_fn(batch)``, else ``y`` of ``(x, y)``/``(x1, ..., y)``, else a dict's
    ``"labels"`` (or ``"label"``), as ``dist_fit`` reads them."""
    if target_fn is not None:
        return target_fn(batch)
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        return batch[-1]
    if isinstance(batch, Mapping):
        for key in ("labels", "label"):
            if key in batch:
                return batch[key]
        keys = f" (keys: {sorted(batch)})"
    else:
        keys = f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""
    raise BatchError(f"nbddp.evaluate needs the targets of each batch for the metrics: (x, y) or (x1, ..., y) "
                     f"batches, or dicts with 'labels'; got a batch of type {type(batch).__name__}{keys}. Pass "
                     "target_fn=lambda batch: ... to say where they are")


def outputs_of(out: Any) -> tuple[Any, Any]:
    """``(what the metrics see, the model's own loss or None)`` of one forward's result.

    A Hugging Face style output (``.logits``/``.loss``, or a dict with
    ``"logits"``/``"loss"``) gives the metrics its logits; anything else is
    given as it is.
    """
    logits = getattr(out, "logits", None)
    loss = getattr(out, "loss", None)
    if isinstance(out, Mapping):
        logits, loss = out.get("logits", logits), out.get("loss", loss)
    return (out if logits is None else logits), loss


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

    def __init__(self, metrics: dict[str, Any], loss_fn: Callable | None, device: torch.device,
                 target_fn: Callable | None = None, group: Any = None):
        self.target_fn = target_fn
        self.group = group  # the ranks that hold outputs, when not all do (a pipeline's last stages): metrics sync there
        self.model_loss = False  # the loss came from the model's output (.loss): reported as "loss" too
        self.objects = {k: m.to(device) if hasattr(m, "to") else m for k, m in metrics.items() if is_metric_object(m)}
        self.functions = {k: f for k, f in metrics.items() if k not in self.objects}
        self.loss_fn = loss_fn
        self.sums = {k: 0.0 for k in self.functions}
        self.counts = {k: 0 for k in self.functions}
        self.loss_sum, self.n = 0.0, 0

    def add_batch(self, out: Any, batch: Any, rows: int) -> None:
        """One counted batch's forward result ``out``: its targets and outputs found, then ``add``."""
        outputs, own_loss = outputs_of(out)
        self.add(outputs, targets_of(batch, self.target_fn), rows, own_loss)

    def add(self, outputs: Any, targets: Any, rows: int, own_loss: Any = None) -> None:
        for metric in self.objects.values():
            metric.update(outputs, targets)
        for name, fn in self.functions.items():
            self.sums[name] += batch_sum(name, fn(outputs, targets), rows)
            self.counts[name] += rows
        if self.loss_fn is not None:
            self.loss_sum += float(self.loss_fn(outputs, targets)) * rows
        elif own_loss is not None:
            self.model_loss = True
            self.loss_sum += float(own_loss) * rows
        self.n += rows

    def reduced(self, device: torch.device, holds_outputs: bool = True) -> dict[str, Any]:
        """The exact values over every rank's samples (collective: every rank calls it; the metric objects are
        computed where the outputs are, and synced over ``group``)."""
        names = sorted(self.functions)
        summed = torch.tensor([self.loss_sum, float(self.n), float(self.model_loss), *[self.sums[k] for k in names],
                               *[float(self.counts[k]) for k in names]], dtype=torch.float64, device=device)
        dist.all_reduce(summed)
        flat: list[float] = summed.cpu().tolist()
        out: dict[str, Any] = {}
        if self.loss_fn is not None or flat[2] > 0:
            out["loss"] = flat[0] / flat[1]
        k = len(names)
        out.update({name: flat[3 + i] / flat[3 + k + i] for i, name in enumerate(names)})
        if holds_outputs:
            for name, metric in self.objects.items():  # torchmetrics syncs inside compute(): same order everywhere
                if self.group is not None:
                    metric.process_group = self.group
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


def outputs_group(part: Any) -> Any:
    """The ranks that hold a model-parallel copy's outputs (one per copy), where its metric objects sync; None: all.

    With one copy that is this rank alone: a group of one, made once per
    generation (``STATE.mesh_groups``, as the mesh's own groups are).
    """
    if part is None:
        return None
    if part.dp > 1:
        return part.dp_group
    from nbddp.worker.engine.rank_state import STATE

    key = (dist.get_rank(),)
    if key not in STATE.mesh_groups:
        STATE.mesh_groups[key] = dist.new_group(list(key), use_local_synchronization=True)
    return STATE.mesh_groups[key]
