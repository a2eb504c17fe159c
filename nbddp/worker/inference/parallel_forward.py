"""One forward of a kept pipeline or tensor-parallel model, on every rank of a model copy together.

* **Pipeline.** Each rank runs its stages with torch's forward-only schedule
  (``torch.distributed.pipelining``: ``_ScheduleForwardOnly`` for one stage
  per rank, ``ScheduleInterleaved1F1B.eval`` for several), the batch split
  into the fit's micro-batches: the first stage takes the inputs, the last
  one returns the outputs, the others return nothing. Stages exchange tensors
  of one shape, so every batch is padded to one size (a multiple of the
  micro-batches, copies of its last row) and the outputs cut back; rows are
  independent in eval mode. The stages are built once per call; their
  shapes are found at the first batch.
* **Tensor parallel.** Every rank of a copy runs the whole forward on the
  same batch; its split layers all-reduce inside. ``tp`` rank 0 keeps the
  outputs, made whole where they are DTensors.

Every rank of a copy reads the same batches (its ``dp`` block), so the
pipeline's last stage knows each batch's real rows and its targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

from nbddp.worker.inference.kept import KeptParallel, full

if TYPE_CHECKING:
    from torch.distributed.pipelining.stage import _PipelineStageBase


@runtime_checkable
class Resharding(Protocol):
    """A module FSDP2 shards (``FSDPModule``): ``reshard()`` frees the parameters its root kept gathered."""

    def reshard(self) -> None: ...


class PipelineBatchError(TypeError):
    """A pipeline's stages take positional tensors: the batch was something else."""


def inputs_of(batch: Any) -> tuple[torch.Tensor, ...]:
    """What the first stage takes: ``x`` of ``(x,)``/``(x, y)``, ``(x1, ..., xk)`` of ``(x1, ..., xk, y)``, a tensor."""
    if isinstance(batch, torch.Tensor):
        return (batch,)
    if isinstance(batch, (list, tuple)) and batch and all(isinstance(t, torch.Tensor) for t in batch):
        return tuple(batch) if len(batch) == 1 else tuple(batch[:-1])
    kind = "a dict" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
    raise PipelineBatchError(f"a kept nbddp.Pipeline predicts (x,), (x, y) or (x1, ..., y) batches of tensors (the "
                             f"inputs go to the first stage); got {kind} batch. Give the data as tensors, or fit "
                             "with return_weights=True and predict with the notebook's model")


class PipelineForward:
    def __init__(self, part: KeptParallel, device: torch.device, batch_size: int):
        self.part, self.device = part, device
        m = part.microbatches
        self.rows = -(-batch_size // m) * m  # every batch padded to this: a multiple of the micro-batches
        self.schedule = self._schedule()

    def _schedule(self) -> Any:
        from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B, _ScheduleForwardOnly

        p = self.part
        stages: list[_PipelineStageBase] = [PipelineStage(m, i, p.stages, self.device, group=p.mp_group)
                                            for i, m in zip(p.stage_ids, p.stage_modules)]
        if len(stages) == 1:
            return _ScheduleForwardOnly(stages[0], p.microbatches)
        return ScheduleInterleaved1F1B(stages, p.microbatches)

    def __call__(self, batch: Any) -> Any:
        """The model's outputs for ``batch`` on the last stage; None on the others."""
        inputs = inputs_of(batch)
        rows = int(inputs[0].shape[0])
        if rows < self.rows:
            inputs = tuple(torch.cat([x, x[-1:].expand(self.rows - rows, *x.shape[1:])]) for x in inputs)
        first = 0 in self.part.stage_ids
        args = inputs if first else ()
        out = self.schedule.step(*args) if len(self.part.stage_ids) == 1 else self.schedule.eval(*args)
        if not self.part.holds_outputs:
            return None
        return _rows(out, rows)

    def end(self) -> None:
        """Stages sharded over ``dp`` (FSDP) drop the parameters their roots kept gathered."""
        for m in self.part.stage_modules:
            if isinstance(m, Resharding):
                m.reshard()


def _rows(out: Any, rows: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:rows]
    if isinstance(out, (list, tuple)):
        return type(out)(_rows(o, rows) for o in out)
    return out


def tensor_forward(part: KeptParallel, run: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``run(batch)`` on every rank of the copy; the outputs (whole) on ``tp`` rank 0, None on the others."""
    def forward(batch: Any) -> Any:
        out = full(run(batch))  # a sharded DTensor output gathers over the copy: every rank of it takes part
        return out if part.holds_outputs else None

    return forward
