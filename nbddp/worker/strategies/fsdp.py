"""Sharded training: FSDP2 (``fully_shard``) over a device mesh of every rank.

Each rank holds 1/N of every parameter (a ``DTensor`` shard), its gradient
and its optimizer state; a unit's full parameters exist only while it runs
(all-gathered before its forward and backward, freed after). Measured on 2
CPU ranks with gloo (torch 2.13): SGD and AdamW steps equal DDP's exactly,
and with accumulation and clipping to 6e-8.

* The mesh is passed explicitly (``init_device_mesh(device.type, (N,))``):
  the default picks the accelerator, which breaks gloo on GPU hosts.
* A shipped module arrives as views of the shipped file (no private copy);
  ``fully_shard`` copies out this rank's shard and the full weights are
  dropped, so a rank never holds a private copy of the whole model. A
  factory is built on the ``meta`` device when it can be re-initialised there.
* Buffers (BatchNorm statistics) are not sharded and, unlike DDP, not
  synchronised: each rank keeps its own, and rank 0's come back.
* Checkpoints are ``torch.distributed.checkpoint`` directories: each rank
  writes its own shards (``worker/checkpoints/sharded.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Protocol, runtime_checkable

import torch
import torch.distributed as dist
import torch.nn as nn

from nbddp.partitioning import blocks
from nbddp.worker.checkpoints import sharded as dcp
from nbddp.worker.strategies.base import Strategy
from nbddp.worker.strategies.shards import local_param_bytes, restore_own, snapshot_own


@runtime_checkable
class Resettable(Protocol):
    """A module that can create its own tensors again (``nn.Linear``, ``nn.LayerNorm``...): meta-init needs it."""

    def reset_parameters(self) -> None: ...


class FSDPStrategy(Strategy):
    name = "fsdp"
    lockstep_validation = True
    heap_steady_state = False  # gathered units and reduce-scatter buffers fragment a heap that keeps them (worker/memory/allocator.py)

    def __init__(self, device: torch.device, spec: Any, precision: str = "32-true"):
        super().__init__(device)
        self.spec = spec
        self.precision = precision
        self.meta_built = False

    @classmethod
    def create(cls, settings: Any, device: torch.device, precision: str, mesh: dict[str, int] | None) -> Strategy:
        return cls(device, settings, precision)

    # ---- building ----------------------------------------------------------
    def build(self, factory: Any) -> nn.Module:
        """The module, not moved: ``fully_shard`` moves each unit to the device as it shards it."""
        if isinstance(factory, nn.Module):
            return factory  # views of the shipped file: fully_shard copies each rank's shard out
        if self.spec.init_on_meta:
            with torch.device("meta"):
                model = factory()
            if isinstance(model, nn.Module) and _can_reset(model):
                self.meta_built = True
                return model
        model = factory()
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def wrap(self, model: nn.Module, identical: bool) -> nn.Module:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if self.group is not None:
            mesh = DeviceMesh.from_group(self.group, self.device.type)
        else:
            mesh = init_device_mesh(self.device.type, (dist.get_world_size(),))
        shard(model, self.spec, self.precision, mesh)
        if self.meta_built:
            self._materialise(model)
        self.wrapped = self.module = model
        return model

    def compile_targets(self, spec: Any) -> list[nn.Module]:
        """Each sharded unit after ``fully_shard``, as torchtitan does (``regional``), else the whole root.

        A unit's graph then sits between FSDP's all-gather and reduce-scatter
        hooks (which Dynamo leaves to run eagerly), and the blocks of one
        class share one compiled graph: compiled once, reused by the others.
        """
        from nbddp.worker.strategies.compiling import regions

        return regions(self.module, blocks.shard_units(self.module, self.spec.shard_modules), spec)

    def _materialise(self, model: nn.Module) -> None:
        """Allocate this rank's shards of a model built on meta, and initialise them."""
        model.to_empty(device="cpu" if self.spec.cpu_offload else self.device)
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, Resettable) and _holds_tensors(module):
                    module.reset_parameters()

    # ---- the step ------------------------------------------------------------
    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        if enabled:
            yield
            return
        from torch.distributed.fsdp import FSDPModule

        root = self.wrapped_as(FSDPModule)
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def clip_grad_norm(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(list(self.parameters()), max_norm)  # a collective: every rank calls it
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    def end_evaluation(self) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.wrapped_as(FSDPModule).reshard()  # the root keeps its gathered parameters after a forward without backward

    def param_bytes(self) -> int:
        return local_param_bytes(self.module)

    # ---- weights and checkpoints -----------------------------------------------
    def full_state_dict(self, rank: int) -> dict[str, Any] | None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if rank == 0 else None

    def snapshot_weights(self, rank: int) -> dict[str, torch.Tensor]:
        """Every rank copies its own shards to host memory: 1/N of the model each, no collective, no disk.

        A gathered copy would be a collective at every improvement and the
        whole model in rank 0's memory; a DCP snapshot would write every
        shard to disk each time. This is what a DCP snapshot holds, kept in
        memory.
        """
        return snapshot_own(self.module)

    def restore_weights(self, saved: dict[str, torch.Tensor] | None, rank: int) -> None:
        restore_own(self.module, saved)

    def save_checkpoint(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        dcp.save(directory, step, self.module, optimizer, extra, rank)

    def save_snapshot(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int,
                      writer: Any) -> Callable[[], Any] | None:
        if writer.inline:
            dcp.save(directory, step, self.module, optimizer, extra, rank)
            return None
        return dcp.save_async(directory, step, self.module, optimizer, extra, rank, writer)

    def snapshot_reads(self, path: str, optimizer: Any) -> set[str] | None:
        return dcp.reads(path, self.module, optimizer)

    def load_checkpoint(self, path: str, optimizer: Any) -> dict[str, Any]:
        return dcp.load(path, self.module, optimizer)


def shard(model: nn.Module, spec: Any, precision: str, mesh: Any) -> nn.Module:
    """``fully_shard`` each unit (``spec.shard_modules``, or the repeated blocks), then the root, over ``mesh``."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh}
    if spec.reshard_after_forward is not None:
        kwargs["reshard_after_forward"] = spec.reshard_after_forward
    if precision == "bf16-mixed":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if spec.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for unit in blocks.shard_units(model, spec.shard_modules):
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def _can_reset(model: nn.Module) -> bool:
    """Meta-init is safe when every module with its own tensors can re-create them, and no buffer is non-persistent."""
    for module in model.modules():
        if _holds_tensors(module) and not isinstance(module, Resettable):
            return False
        saved = module.state_dict(keep_vars=True)
        if any(name not in saved for name, _ in module.named_buffers(recurse=False)):
            return False  # a non-persistent buffer is computed in __init__ only: to_empty would leave garbage
    return True
