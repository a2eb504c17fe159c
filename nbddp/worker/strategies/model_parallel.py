"""What pipeline and tensor parallelism share: a ``(dp, mp)`` mesh, data parallelism over ``dp``, clipping, weights.

* The ``mp`` ranks of a group hold one copy of the model between them and
  read the same batches (``data_shard``: the shard of their ``dp`` rank); one
  of them counts the loss (``reports_metrics``), so the reduced metrics are
  over the ``dp`` replicas.
* Over ``dp``: replicas average their gradients once per optimizer step
  (``gradients.average_gradients``), or FSDP2 shards each copy over its
  replicas (``fsdp.shard`` on the mesh's ``dp`` dimension).
* Clipping uses the global norm over every stage and shard (``gradients``).
* Weights and checkpoints: DCP directories (``worker/checkpoints/sharded.py``: every rank
  writes what it holds, the full state dict's names); the full weights are
  gathered for rank 0 by the subclass.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from nbddp.protocol.mesh_layout import layout
from nbddp.worker.checkpoints import sharded as dcp
from nbddp.worker.strategies.base import Strategy
from nbddp.worker.strategies.gradients import average_gradients, clip_global, replicated_dims
from nbddp.worker.strategies.shards import local_param_bytes, restore_own, snapshot_own


class MeshStrategy(Strategy):
    lockstep_validation = True  # the ranks of a model copy evaluate together

    def __init__(self, device: torch.device, spec: Any, precision: str, mesh: dict[str, int]):
        super().__init__(device)
        self.spec, self.precision = spec, precision
        self.layout = layout(mesh, mesh["dp"] * mesh[spec.mp_dim])
        self.mesh: Any = None  # nbddp.worker.engine.device_mesh.RankMesh, built in wrap
        self.rank = 0  # this rank's index among the fit's ranks

    @classmethod
    def create(cls, settings: Any, device: torch.device, precision: str, mesh: dict[str, int] | None) -> Strategy:
        if mesh is None:
            raise ValueError(f"{cls.__name__} splits the model over the fit's mesh ({{'dp': ..., "
                             f"'{settings.mp_dim}': ...}}, which the kernel resolves), but was given mesh=None")
        return cls(device, settings, precision, mesh)

    @property
    def replicated(self) -> bool:
        """Replicas over ``dp`` that average gradients (``dp="ddp"`` with more than one of them)."""
        return self.spec.dp == "ddp" and self.layout.dp > 1

    @property
    def sharded(self) -> bool:
        return self.spec.dp != "ddp" and self.layout.dp > 1

    # ---- data and reports ----------------------------------------------------
    def data_shard(self, rank: int, world: int) -> tuple[int, int]:
        self.rank = rank
        return self.layout.coords(rank)[0], self.layout.dp

    def build(self, factory: Any) -> nn.Module:
        """The module where it was built (shipped views stay shared): each rank moves only what it keeps."""
        model = factory() if not isinstance(factory, nn.Module) and callable(factory) else factory
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}, not a torch.nn.Module")
        return model

    def build_mesh(self) -> Any:
        from nbddp.worker.engine.device_mesh import build_mesh

        self.mesh = build_mesh(self.layout, self.device.type, self.group)
        return self.mesh

    # ---- the step ------------------------------------------------------------
    @contextlib.contextmanager
    def gradient_sync(self, enabled: bool) -> Iterator[None]:
        yield
        if enabled and self.replicated:
            average_gradients(self.parameters(), self.mesh.dp_group, self.layout.dp)

    def copies(self, grad: torch.Tensor) -> int:
        """How many of the fit's ranks hold this same gradient (see ``gradients``)."""
        mesh = getattr(grad, "device_mesh", None)
        return replicated_dims(grad) * (self.same_params // (mesh.size() if mesh is not None else 1))

    @property
    def same_params(self) -> int:
        """How many ranks hold the same set of parameters (in some layout)."""
        raise NotImplementedError

    def clip_grad_norm(self, max_norm: float) -> float:
        return clip_global(list(self.parameters()), max_norm, self.copies, self.group, self.device)

    def param_bytes(self) -> int:
        return local_param_bytes(self.module)

    def snapshot_weights(self, rank: int) -> dict[str, torch.Tensor]:
        """Every rank copies what it holds (its stages, its tensor-parallel shards) to host memory; no collective."""
        return snapshot_own(self.module)

    def restore_weights(self, saved: dict[str, torch.Tensor] | None, rank: int) -> None:
        restore_own(self.module, saved)

    # ---- checkpoints -------------------------------------------------------------
    def save_checkpoint(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int) -> None:
        dcp.save(directory, step, self.module, optimizer, extra, rank, flat=True)

    def save_snapshot(self, directory: str, step: int, optimizer: Any, extra: dict[str, Any], rank: int,
                      writer: Any) -> Callable[[], Any] | None:
        if writer.inline:
            dcp.save(directory, step, self.module, optimizer, extra, rank, flat=True)
            return None
        return dcp.save_async(directory, step, self.module, optimizer, extra, rank, writer, flat=True)

    def snapshot_reads(self, path: str, optimizer: Any) -> set[str] | None:
        return dcp.reads(path, self.module, optimizer, flat=True)

    def load_checkpoint(self, path: str, optimizer: Any) -> dict[str, Any]:
        return dcp.load(path, self.module, optimizer, flat=True)


def full_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """A state dict on the CPU, every DTensor gathered (a collective over its mesh)."""
    out = {}
    for k, v in state.items():
        if hasattr(v, "full_tensor"):
            v = v.full_tensor()
        out[k] = v.detach().cpu()
    return out


def send_state(state: dict[str, torch.Tensor], dst: int, group: Any, device: torch.device) -> None:
    """Send a state dict to global rank ``dst``: its names, dtypes and shapes, then one flat tensor per dtype.

    Point to point and flat: ``gather_object`` would pickle every tensor and, on
    gloo, took tens of seconds for a 67 MB stage (measured here).
    """
    meta = [(k, str(v.dtype).removeprefix("torch."), tuple(v.shape)) for k, v in state.items()]
    dist.send_object_list([meta], dst=dst, group=group, device=device if device.type == "cuda" else None)
    for dtype in sorted({m[1] for m in meta}):
        flat = torch.cat([state[k].reshape(-1) for k, d, _ in meta if d == dtype]) if meta else torch.empty(0)
        dist.send(flat.to(device), dst=dst, group=group)


def recv_state(src: int, group: Any, device: torch.device) -> dict[str, torch.Tensor]:
    """Receive what ``send_state`` sent from global rank ``src``, on the CPU."""
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group, device=device if device.type == "cuda" else None)
    meta, out = box[0], {}
    for dtype in sorted({m[1] for m in meta}):
        parts = [(k, shape) for k, d, shape in meta if d == dtype]
        flat = torch.empty(sum(_numel(shape) for _, shape in parts), dtype=getattr(torch, dtype), device=device)
        dist.recv(flat, src=src, group=group)
        flat, offset = flat.cpu(), 0
        for k, shape in parts:
            out[k] = flat[offset:offset + _numel(shape)].view(shape).clone()
            offset += _numel(shape)
    return {k: out[k] for k, _, _ in meta}


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
