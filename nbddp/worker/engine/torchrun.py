"""Making a worker look like a process that ``torchrun`` started, around nbddp's own group.

Code written for torchrun (HF ``Trainer``, accelerate, Lightning Fabric, a
plain script) finds its rank in the environment and calls
``init_process_group`` itself. On nbddp's workers:

* every rank carries torchrun's variables (``torchrun_environment``), set
  again whenever the group is formed, so they follow replaced workers and
  new ports;
* ``init_process_group`` while nbddp's group exists returns that group
  (after checking that backend, rank and world size agree), and
  ``destroy_process_group`` of the default group is ignored while user code
  runs, so a script's own set-up and tear-down leave the workers usable;
* frameworks' per-process singletons are reset when the group changed
  (accelerate keeps the rank it first saw), and Lightning's "interactive
  environment" check is told the truth: an engine is not a console.

Measured with transformers 5.24, accelerate 1.15 and lightning 2.6.6 (see
``docs/frameworks.md``). On one host no store is listened on: the group
uses a file store, and ``MASTER_PORT`` is a port that was free, which no
one dials while the group exists.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any, Iterator

from nbddp.protocol.placement import Placement

RUN_ID = "nbddp"
_ORIGINAL: dict[str, Any] = {}
_USER_CODE = {"depth": 0}
_RESET_FOR: dict[str, int | None] = {"generation": None}
_LIGHTNING_CONNECTORS = ("lightning.fabric.connector", "lightning_fabric.connector",
                         "lightning.pytorch.trainer.connectors.accelerator_connector",
                         "pytorch_lightning.trainer.connectors.accelerator_connector")


def torchrun_environment(placement: Placement, master: tuple[str, int]) -> dict[str, str]:
    """The variables ``torchrun --nnodes H --nproc-per-node L`` would set for this rank."""
    world, local_world = placement.world_size, placement.local_world_size
    node = placement.rank // local_world if local_world else 0
    env = {
        "RANK": placement.rank, "WORLD_SIZE": world, "LOCAL_RANK": placement.local_rank,
        "LOCAL_WORLD_SIZE": local_world, "GROUP_RANK": node, "NODE_RANK": node,
        "GROUP_WORLD_SIZE": max(1, world // max(local_world, 1)), "ROLE_RANK": placement.rank,
        "ROLE_WORLD_SIZE": world, "ROLE_NAME": "default", "MASTER_ADDR": master[0], "MASTER_PORT": master[1],
        "TORCHELASTIC_RUN_ID": RUN_ID, "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
    }
    return {k: str(v) for k, v in env.items()}


def apply_environment(placement: Placement, master: tuple[str, int]) -> None:
    """Set torchrun's variables for this rank; tell accelerate a CPU rank is one (it would train alone)."""
    os.environ.update(torchrun_environment(placement, master))
    if placement.device.startswith("cuda"):
        os.environ.pop("ACCELERATE_USE_CPU", None)
    else:
        os.environ["ACCELERATE_USE_CPU"] = "1"
    # an engine is an IPython kernel, so it has sys.ps1; Lightning reads that as "interactive" and refuses
    # strategy="ddp". No one types at an engine: drop the prompts.
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)


def install_group_guard() -> None:
    """Patch ``init_process_group`` and ``destroy_process_group`` (once per process)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if _ORIGINAL:
        return
    _ORIGINAL["init"], _ORIGINAL["destroy"] = c10d.init_process_group, c10d.destroy_process_group
    dist.init_process_group = c10d.init_process_group = guarded_init_process_group
    dist.destroy_process_group = c10d.destroy_process_group = guarded_destroy_process_group
    mesh = sys.modules.get("torch.distributed.device_mesh")  # (found by name: patched only where it is imported)
    if mesh is not None and hasattr(mesh, "init_process_group"):
        setattr(mesh, "init_process_group", guarded_init_process_group)


def original(name: str) -> Any:
    """torch's own ``init_process_group`` / ``destroy_process_group``, for nbddp's joining and leaving."""
    import torch.distributed.distributed_c10d as c10d

    return _ORIGINAL.get(name) or {"init": c10d.init_process_group, "destroy": c10d.destroy_process_group}[name]


def _backend_matches(asked: Any, ours: str) -> bool:
    if asked is None:
        return True
    text = str(asked).lower()
    return text == ours or ours in [part.split(":")[-1] for part in text.split(",")]


def guarded_init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None, world_size: int = -1,
                               rank: int = -1, *args: Any, **kwargs: Any) -> None:
    """``init_process_group``, except that while nbddp's group exists the call joins it."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return original("init")(backend, init_method, timeout, world_size, rank, *args, **kwargs)
    ours = dist.get_backend()
    if not _backend_matches(backend, ours):
        raise ValueError(
            f"init_process_group(backend={backend!r}): the workers' process group uses {ours!r}, and this process "
            f"already belongs to it. Start the workers with that backend (nbddp.start(backend={backend!r}) or "
            f"%ddp start --backend {backend}), or let the code use the backend it finds (init_process_group())"
        )
    for name, asked, have in (("world_size", world_size, dist.get_world_size()), ("rank", rank, dist.get_rank())):
        if asked not in (-1, None) and int(asked) != have:
            raise ValueError(f"init_process_group({name}={asked}): this worker is {name} {have} of nbddp's group; "
                             f"read it from the environment (os.environ['{name.upper()}']) instead of fixing it")
    return None


def guarded_destroy_process_group(group: Any = None) -> None:
    """Ignore tearing down nbddp's default group from user code; anything else as torch does it."""
    import torch.distributed as dist

    if _USER_CODE["depth"] and (group is None or group is dist.group.WORLD):
        return None
    return original("destroy")(group)


@contextlib.contextmanager
def user_code(generation: int | None) -> Iterator[None]:
    """Around a cell, a call, a script or a fit: frameworks see this generation's ranks."""
    _reset_frameworks(generation)
    _USER_CODE["depth"] += 1
    try:
        yield
    finally:
        _USER_CODE["depth"] -= 1


def _reset_frameworks(generation: int | None) -> None:
    """Bring framework singletons up to date once per process-group generation, and Lightning's check always."""
    for name in _LIGHTNING_CONNECTORS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "_IS_INTERACTIVE", False):
            setattr(module, "_IS_INTERACTIVE", False)  # the flag was read while the engine still had sys.ps1
    if _RESET_FOR["generation"] == generation:
        return
    _RESET_FOR["generation"] = generation
    state = sys.modules.get("accelerate.state")
    if state is not None:  # accelerate keeps the rank and world size it saw first, in class-level dicts
        state.AcceleratorState._reset_state(reset_partial_state=True)
        state.GradientState._reset_state()
    rank_zero = sys.modules.get("lightning_utilities.core.rank_zero")
    if rank_zero is not None and hasattr(rank_zero, "rank_zero_only"):
        rank_zero.rank_zero_only.rank = int(os.environ.get("RANK", "0"))
