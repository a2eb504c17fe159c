"""Tensor parallelism: the planned ``nn.Linear`` layers split over the ``tp`` ranks of a group (DTensor).

``parallelize_module(model, mesh["tp"], plan)`` with torch's
``ColwiseParallel``/``RowwiseParallel`` (``partitioning/tensor_plan.py`` finds or
checks the plan). Every rank of a group runs the whole forward on the same
batch; a colwise layer computes a slice of the features, the rowwise layer
after it sums the slices with one all-reduce. Over ``dp``, replicas average
gradients, or FSDP2 shards each block over its replicas after TP
(``parallelize_module`` first, then ``fully_shard`` on ``mesh["dp"]``, as
measured: ``docs/ipyparallel-notes.md``, "Model-parallel training on CPU").

Measured on 2 CPU ranks against one process (float32, SGD): an MLP 1.5e-8, a
transformer block 6e-8. With AdamW a parameter whose true gradient is zero
(the keys' bias: a constant added to every key changes no softmax) turns
rounding noise into full steps: compare in float64 or with SGD.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Iterator

import torch.nn as nn

from nbddp.worker.strategies.gradients import average_gradients
from nbddp.worker.strategies.model_parallel import MeshStrategy
from nbddp.partitioning.tensor_plan import parallel_styles, resolve_plan

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule


class TensorParallelStrategy(MeshStrategy):
    name = "tensor"

    @property
    def reports_metrics(self) -> bool:
        return self.layout.coords(self.rank)[1] == 0  # every rank of a group computes the same loss

    @property
    def same_params(self) -> int:
        return self.layout.dp * self.layout.mp

    def roles(self, world: int) -> list[dict[str, Any]]:
        return [dict(zip(("dp_rank", "tp_rank"), self.layout.coords(r))) for r in range(world)]

    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = self.build_mesh()
        plan = resolve_plan(model, self.spec.plan, self.layout.mp)
        model = model.to(self.device)
        parallelize_module(model, mesh.sub("tp"), parallel_styles(plan))
        if self.sharded:
            from nbddp.worker.strategies.fsdp import shard

            shard(model, self.spec.dp, self.precision, mesh.sub("dp"))
        self.wrapped = self.module = model
        return model

    def compile_targets(self, spec: Any) -> list[nn.Module]:
        """Each repeated block after ``parallelize_module`` (``regional``), else the whole module."""
        from nbddp.partitioning.blocks import repeated_blocks
        from nbddp.worker.strategies.compiling import regions

        return regions(self.module, repeated_blocks(self.module), spec)

    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        root = self._sharded_root()
        if root is not None:
            root.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            if root is not None:
                root.set_requires_gradient_sync(True)
        if enabled and self.replicated:
            average_gradients(self.parameters(), self.mesh.dp_group, self.layout.dp)

    def end_evaluation(self) -> None:
        root = self._sharded_root()
        if root is not None:
            root.reshard()

    def _sharded_root(self) -> FSDPModule | None:
        """The FSDP2 root when ``dp`` shards the tensor-parallel model (``dp="fsdp"``), else None."""
        if not self.sharded:
            return None
        from torch.distributed.fsdp import FSDPModule

        return self.wrapped_as(FSDPModule)

    def full_state_dict(self, rank: int) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if rank == 0 else None
