"""How the process groups beyond the world group end, and the DTensor caches made for them.

A subgroup (``dist.new_group``: a sweep's trial group, a stream's flag group,
a mesh dimension) is destroyed with ``destroy_subgroup``; every new mesh, and
every end of a generation, forgets DTensor's caches first (``forget_meshes``),
because a cached plan that names a destroyed group breaks the next fit. The
groups themselves are made in ``device_mesh.py`` (meshes) and by the tasks
that need one; the world group's own lifetime is ``worker/tasks/process_group.py``'s.

Light on purpose: torch is imported only when a group is destroyed, so the
kernel can import the entry points that use this without importing torch.
"""

from __future__ import annotations

import sys
from typing import Any


def destroy_subgroup(group: Any) -> None:
    """Destroy a group made with ``dist.new_group`` and forget the meshes built on it."""
    import torch.distributed as dist

    dist.destroy_process_group(group)
    forget_meshes()


def forget_meshes() -> None:
    """Drop DTensor's caches, which hold the ``DeviceMesh`` they were filled for.

    torch caches sharding propagation and redistribution plans by mesh
    *equality* (the ranks and the layout, not the process group). After a group
    is destroyed, a new mesh over the same ranks finds an entry that names the
    dead group, and gathering a sharded state dict fails with "Could not
    resolve the process group registered under the name N". Measured on torch
    2.13 with an FSDP scaling report followed by an FSDP fit on the same
    workers. The caches are per thread; tasks run on the engine's main thread,
    and so does this. See ``docs/ipyparallel-notes.md``, "Process groups".
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing was cached, and importing DTensor to clear it costs seconds
    try:
        from torch.distributed.tensor import _redistribute, debug
    except ImportError:  # torch without DTensor: nothing is cached
        return
    clear_sharding = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_sharding is not None:
        clear_sharding()
    clear_plans = getattr(getattr(_redistribute, "_gen_transform_infos", None), "cache_clear", None)
    if clear_plans is not None:
        clear_plans()
    clear_planners = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if clear_planners is not None:
        clear_planners()
