"""Pipeline parallelism: each rank of a ``pp`` group holds a stage and runs torch's schedule for every batch.

Built on ``torch.distributed.pipelining`` (torch 2.13: ``PipelineStage``,
``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``). What nbddp
adds:

* *The step.* One loop micro-batch is one schedule ``step``: the first stage
  gives the inputs, the last the target, the rest nothing
  (``train_micro_batch``). The loss is computed on the last stage, each
  micro-batch's divided by ``microbatches x grad_accum`` (with the schedule's
  own ``scale_grads`` off: it would divide gradients already accumulated in
  an accumulation window once more). With equal micro-batches that is the
  batch's mean loss, as one process computes it.
* *Static shapes.* What each stage receives and sends is worked out before
  training on fake tensors (``stages.stage_shapes``), so torch never runs a
  stage on uninitialised buffers to find out (it would, and BatchNorm would
  learn from them). Stage outputs are made contiguous: gloo's send refuses
  anything else.
* *Validation* runs forward-only stages of its own; a partial batch is padded
  to the batch size and its outputs cut back (rows are independent in eval).
* *Weights back*: each stage's owner (``dp`` rank 0) sends its part to rank 0.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from nbddp.partitioning import pipeline_stages as cut
from nbddp.worker.data.batches import BatchError, default_loss
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.strategies.model_parallel import MeshStrategy, full_tensors, recv_state, send_state


class PipelineStrategy(MeshStrategy):
    name = "pipeline"
    whole_batches = True

    def __init__(self, device: torch.device, spec: Any, precision: str, mesh: dict[str, int]):
        super().__init__(device, spec, precision, mesh)
        self.stage_ids: list[int] = []
        self.stages: list[Any] = []
        self.schedule: Any = None
        self._eval: Any = None
        self._losses: list[torch.Tensor] = []
        self._scale = 1.0
        self._base_loss: Any = default_loss
        self._scaler: Any = None

    # ---- where this rank sits -------------------------------------------------
    @property
    def pp(self) -> int:
        return self.layout.mp

    def _mine(self, mp_rank: int) -> list[int]:
        return [s for s in range(self.spec.stages) if s % self.pp == mp_rank]  # torch's "loop" placement

    @property
    def holds_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def holds_last(self) -> bool:
        return self.spec.stages - 1 in self.stage_ids

    @property
    def reports_metrics(self) -> bool:
        return (self.spec.stages - 1) % self.pp == self.layout.coords(self.rank)[1]

    @property
    def same_params(self) -> int:
        return self.layout.dp

    def roles(self, world: int) -> list[dict[str, Any]]:
        out = []
        for r in range(world):
            dp_rank, mp_rank = self.layout.coords(r)
            mine = self._mine(mp_rank)
            out.append({"dp_rank": dp_rank, "stage": mine[0] if len(mine) == 1 else mine})
        return out

    # ---- building ----------------------------------------------------------
    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        from torch.distributed.pipelining import PipelineStage

        mesh = self.build_mesh()
        cuts = cut.plan_stages(model, self.spec.stages, self.spec.split)
        example = _inputs(self._example())
        modules = cut.stage_modules(model, cuts, example)
        shapes = cut.stage_shapes(modules, example, self._autocast(), self.device)
        self.stage_ids = self._mine(mesh.mp_rank)
        mine = [modules[i].to(self.device) for i in self.stage_ids]
        del modules, model  # the other stages' weights are not this rank's to keep
        for m in mine:
            _contiguous_outputs(m)
            if self.sharded:
                from nbddp.worker.strategies.fsdp import shard

                shard(m, self.spec.dp, self.precision, mesh.sub("dp"))
        self.stages = [PipelineStage(m, i, self.spec.stages, self.device, input_args=shapes[i][0],
                                     output_args=shapes[i][1], group=mesh.mp_group)
                       for i, m in zip(self.stage_ids, mine)]
        self.schedule = self._schedule(self.stages, self.spec.microbatches, self._loss)
        self.wrapped = self.module = cut.holder(mine)
        return self.wrapped

    def compile_targets(self, spec: Any) -> list[nn.Module]:
        """Each stage this rank holds: the schedule calls a stage's module for every micro-batch, and the
        forward-only stages of validation wrap the same modules."""
        return [s.submod for s in self.stages]

    def _example(self) -> Any:
        """A micro-batch of the training data, for its shapes (RNG left as it was)."""
        from nbddp.worker.checkpoints.files import rng_state, set_rng_state

        ds, collate, batch_size = self.sample_data  # set by setup.build
        rows = min(len(ds), max(1, batch_size // self.spec.microbatches))
        saved = rng_state()
        try:
            from torch.utils.data import default_collate

            return (collate or default_collate)([ds[i] for i in range(rows)])
        finally:
            set_rng_state(saved)

    def _autocast(self) -> Any:
        from nbddp.worker.strategies.precision import precision_tools

        return precision_tools(self.precision, self.device)[0]

    def _schedule(self, stages: list[Any], microbatches: int, loss: Any) -> Any:
        from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if self.spec.schedule == "interleaved":
            return ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss, scale_grads=False)
        kind = Schedule1F1B if self.spec.schedule == "1f1b" else ScheduleGPipe
        return kind(stages[0], microbatches, loss_fn=loss, scale_grads=False)

    # ---- the step ------------------------------------------------------------
    def _loss(self, output: Any, target: Any) -> torch.Tensor:
        """Called by the schedule on the last stage, once per micro-batch."""
        loss = self._base_loss(output, target)
        self._losses.append(loss.detach())
        scaled = loss.float() * self._scale
        return self._scaler.scale(scaled) if self._scaler is not None else scaled

    def train_micro_batch(self, ts: Any, batch: Any, window: int) -> tuple[torch.Tensor, int, dict[str, Any]]:
        inputs, target = _split(batch)
        self._base_loss = ts.loss_fn or default_loss
        self._scale, self._scaler = 1.0 / (self.spec.microbatches * window), ts.scaler
        self._losses = []
        BEAT.watch_waits = True  # a stage waiting on another shows "collective" (worker/engine/heartbeat.py)
        try:
            with ts.autocast():
                self.schedule.step(*(inputs if self.holds_first else ()),
                                   **({"target": target, "losses": []} if self.holds_last else {}))
        finally:
            BEAT.watch_waits = False
        n = int(target.shape[0])
        if not self._losses:
            return torch.zeros((), device=self.device), n, {}
        return torch.stack(self._losses).float().mean(), n, {}

    def parameters(self) -> Any:
        return self.module.parameters()

    # ---- validation ----------------------------------------------------------
    def eval_batch(self, ts: Any, batch: Any) -> tuple[Any, ...] | None:
        inputs, target = _split(batch)
        rows, full = int(target.shape[0]), self.sample_data[2]
        if rows < full:  # pad with copies of the last row; the outputs are cut back below
            inputs = tuple(torch.cat([x, x[-1:].expand(full - rows, *x.shape[1:])]) for x in inputs)
        if self._eval is None:
            from torch.distributed.pipelining import PipelineStage

            stages = [PipelineStage(s.submod, s.stage_index, self.spec.stages, self.device, group=self.mesh.mp_group)
                      for s in self.stages]
            self._eval = self._eval_schedule(stages)
        with ts.autocast():
            out = self._eval.step(*(inputs if self.holds_first else ())) if len(self.stages) == 1 \
                else self._eval.eval(*(inputs if self.holds_first else ()))
        if not self.holds_last:
            return None
        out = out[:rows]
        return (ts.loss_fn or default_loss)(out, target), rows, {}, out, target

    def _eval_schedule(self, stages: list[Any]) -> Any:
        from torch.distributed.pipelining import ScheduleInterleaved1F1B, _ScheduleForwardOnly

        if len(stages) == 1:
            return _ScheduleForwardOnly(stages[0], self.spec.microbatches)
        return ScheduleInterleaved1F1B(stages, self.spec.microbatches)

    def end_evaluation(self) -> None:
        for s in self.stages:
            if hasattr(s.submod, "reshard"):
                s.submod.reshard()

    # ---- weights ------------------------------------------------------------------
    def full_state_dict(self, rank: int) -> dict[str, torch.Tensor] | None:
        """The first pipeline's stage owners send their parts to rank 0 (under FSDP, gathered over ``dp`` first)."""
        state = full_tensors(self.module.state_dict()) if self.sharded else \
            {k: v.detach().cpu() for k, v in self.module.state_dict().items()}
        if self.mesh.dp_rank != 0:
            return None
        owners = [_global(self.group, r) for r in self.layout.mp_ranks(0)]  # fit ranks 0..pp-1
        if rank != 0:
            send_state(state, owners[0], self.mesh.mp_group, self.device)
            return None
        for src in owners[1:]:
            state.update(recv_state(src, self.mesh.mp_group, self.device))
        return state


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


def _split(batch: Any) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``(x, y)`` / ``(x1, ..., y)`` -> (inputs for the first stage, target for the last)."""
    if isinstance(batch, (list, tuple)) and len(batch) >= 2 and all(isinstance(t, torch.Tensor) for t in batch):
        return tuple(batch[:-1]), batch[-1]
    raise BatchError(f"nbddp.Pipeline trains on (x, y) or (x1, ..., y) batches of tensors (the inputs go to the "
                     f"first stage, the target to the last); got a batch of type {type(batch).__name__}")


def _inputs(batch: Any) -> tuple[torch.Tensor, ...]:
    return _split(batch)[0]


def _contiguous(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.contiguous()
    if isinstance(out, tuple):
        return tuple(_contiguous(o) for o in out)
    return out


def _contiguous_outputs(module: nn.Module) -> None:
    """gloo sends only contiguous tensors: make every stage output one."""
    module.register_forward_hook(lambda _m, _args, out: _contiguous(out))
