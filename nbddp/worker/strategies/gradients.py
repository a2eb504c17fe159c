"""Gradients across a mesh: averaging over the data-parallel replicas, and the global norm for clipping.

*Averaging.* Replicas over ``dp`` average their gradients once per optimizer
step, in one flat ``all_reduce`` per dtype (DDP's arithmetic without its
reducer: torch's reducer asserts under a GPipe schedule, and with
``static_graph=True`` it gave wrong weights; ``docs/ipyparallel-notes.md``,
"Model-parallel training on CPU"). A DTensor's
gradient is averaged through its local shard.

*Global norm.* ``clip_grad_norm_`` cannot take a mix of plain tensors and
DTensors, and it would see only this rank's stage or shard. Here every rank
sums the squares of its local gradients, each divided by the number of ranks
that hold an identical copy of it (DTensor ``Replicate`` dimensions, and the
replicas outside its mesh), and one ``all_reduce`` over the fit's ranks adds
them: the norm of the whole model's gradient, counted once. Clipping then
scales every local gradient by ``max_norm / (norm + 1e-6)`` when that is
below 1, as ``clip_grad_norm_`` does.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from nbddp.worker.strategies.shards import local


def average_gradients(params: Iterable[torch.nn.Parameter], group: Any, size: int) -> None:
    """Average the gradients of ``params`` over ``group`` (``size`` ranks): one all-reduce per dtype."""
    grads = [local(p.grad) for p in params if p.grad is not None]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def replicated_dims(t: torch.Tensor) -> int:
    """How many ranks of a DTensor's own mesh hold the same values (1 for a plain tensor)."""
    placements, mesh = getattr(t, "placements", None), getattr(t, "device_mesh", None)  # a DTensor's
    if placements is None or mesh is None:
        return 1
    copies = 1
    for dim, placement in enumerate(placements):
        if placement.is_replicate():
            copies *= mesh.size(dim)
    return copies


def global_norm(params: list[torch.nn.Parameter], copies: Callable[[torch.Tensor], int], group: Any,
                device: torch.device) -> torch.Tensor:
    """The 2-norm of the gradient of the whole model (float64, the same on every rank); a collective over ``group``."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None:
            continue
        g = local(p.grad)
        total += g.detach().double().pow(2).sum() / copies(p.grad)
    dist.all_reduce(total, group=group)
    return total.sqrt()


def clip_global(params: list[torch.nn.Parameter], max_norm: float, copies: Callable[[torch.Tensor], int], group: Any,
                device: torch.device) -> float:
    """Clip to ``max_norm`` by the global norm; return the norm before clipping."""
    norm = global_norm(params, copies, group, device)
    coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in params:
        if p.grad is not None:
            g = local(p.grad)
            g.mul_(coef.to(g.dtype))
    return float(norm)
