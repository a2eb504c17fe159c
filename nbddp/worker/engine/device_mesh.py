"""A fit's 2-D device mesh ``(dp, pp|tp)`` on a worker, and the lifetime of its process groups.

The groups are made with ``new_group(use_local_synchronization=True)``: only
the ranks of a group take part, so the same code builds a mesh over all the
workers or over a subgroup of them (the scaling report's ranks ``0..k-1``)
while the others wait elsewhere. ``DeviceMesh.from_group`` then names the
dimensions (``mesh["dp"]``, ``mesh["tp"]``), as ``init_device_mesh`` would.

Lifetime: a group lives as long as its generation's process group, and the
next fit over the same ranks reuses it (``STATE.mesh_groups``, by ranks).
Groups made this way are named after their ranks, so making a second one over
the same ranks would meet the first one's rendezvous keys in the store. A
module kept with ``keep=`` holds DTensors on its mesh, so it stays usable.
When the generation ends, every group goes with the world group
(``worker/tasks/process_group.py``). Before every new mesh DTensor's caches are
forgotten (``group_lifetime.forget_meshes``): a cached sharding plan that names
a group of another generation hangs or fails the next fit (measured:
``docs/ipyparallel-notes.md``, "Process groups").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nbddp.protocol.mesh_layout import Layout
from nbddp.worker.engine.group_lifetime import forget_meshes
from nbddp.worker.engine.rank_state import STATE


@dataclass
class RankMesh:
    """This rank's view of the mesh: its coordinates, its groups, the ``DeviceMesh`` (named dimensions)."""

    layout: Layout
    dp_rank: int
    mp_rank: int
    dp_group: Any  # None when dp == 1
    mp_group: Any
    device_mesh: Any  # 2-D ("dp", kind) when dp > 1, else 1-D (kind,)

    def sub(self, name: str) -> Any:
        """The 1-D mesh of dimension ``name`` (``"dp"``, ``"pp"``, ``"tp"``)."""
        if self.device_mesh.ndim == 1:  # (kind,): dp is 1, and nothing asks for it
            return self.device_mesh
        return self.device_mesh[name]


def _group(ranks: list[int], within: Any) -> Any:
    """A process group of ``ranks`` (global ranks); the enclosing group itself when it is exactly those ranks."""
    enclosing = dist.get_process_group_ranks(within) if within is not None else list(range(dist.get_world_size()))
    if sorted(ranks) == sorted(enclosing):
        return within if within is not None else dist.group.WORLD
    key = tuple(ranks)
    if key not in STATE.mesh_groups:
        STATE.mesh_groups[key] = dist.new_group(ranks, use_local_synchronization=True)
    return STATE.mesh_groups[key]


def build_mesh(layout: Layout, device_type: str, within: Any = None) -> RankMesh:
    """This rank's part of the ``(dp, mp)`` mesh over the ranks of ``within`` (None: every worker)."""
    forget_meshes()
    ranks = dist.get_process_group_ranks(within) if within is not None else list(range(dist.get_world_size()))
    me = ranks.index(dist.get_rank())
    dp_rank, mp_rank = layout.coords(me)
    mp_ranks = [ranks[i] for i in layout.mp_ranks(dp_rank)]
    mp_group = _group(mp_ranks, within)
    if layout.dp == 1:
        mesh = _from_groups([mp_group], device_type, torch.tensor(mp_ranks), (layout.kind,))
        return RankMesh(layout, 0, mp_rank, None, mp_group, mesh)
    dp_ranks = [ranks[i] for i in layout.dp_ranks(mp_rank)]
    dp_group = _group(dp_ranks, within)
    grid = torch.tensor(ranks).view(layout.dp, layout.mp)
    mesh = _from_groups([dp_group, mp_group], device_type, grid, ("dp", layout.kind))
    return RankMesh(layout, dp_rank, mp_rank, dp_group, mp_group, mesh)


def _from_groups(groups: list[Any], device_type: str, grid: torch.Tensor, names: tuple[str, ...]) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    if len(groups) == 1:
        return DeviceMesh.from_group(groups[0], device_type, mesh=grid, mesh_dim_names=names)
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)
