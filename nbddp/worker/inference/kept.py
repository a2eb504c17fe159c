"""What ``dist_fit(keep="name")`` leaves on a rank for ``predict``/``evaluate``: the module, and how it was trained.

The module itself goes into the ``%%ddp`` namespace (``worker/tasks/entry.py``);
this record, in ``STATE.kept_by``, says which strategy trained it and at
which precision (``predict`` runs at the fit's precision unless told
otherwise), and, for pipeline and tensor parallelism, the part this rank holds:
its mesh coordinates and groups, and a pipeline's stage modules with their
indices. A pipeline's kept module is only a holder of this rank's stages, so
without this record nothing could run it again.

The record keeps no data and no optimizer. What refers to modules (a
pipeline's stage modules: a rank with several stages holds their layers in
one holder module, not the stage modules themselves) rides on the kept
module (``PART``), so that ``del name`` in a cell lets all of it go; the
entry in ``STATE.kept_by`` holds no module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn


@dataclass
class KeptParallel:
    """A model-parallel fit's part on this rank: where it sits in the ``(dp, mp)`` mesh, and its stages."""

    kind: str  # "pipeline" or "tensor"
    dp_rank: int  # which model copy this rank belongs to (its block of the data)
    dp: int  # model copies
    mp_rank: int  # its place within the copy: the stage's ``pp`` rank, or the ``tp`` rank
    mp: int
    mp_group: Any  # the copy's ranks (a pipeline's stages send activations over it)
    dp_group: Any  # this ``mp_rank``'s ranks over the copies (None with one copy)
    sharded: bool  # FSDP over ``dp``: forwards all-gather over the copies too
    stage_ids: list[int] = field(default_factory=list)  # a pipeline's stages on this rank, in order
    stage_modules: list[nn.Module] = field(default_factory=list)
    stages: int = 0  # a pipeline's stages in all
    microbatches: int = 1

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """A copy of the kept module (pulled to the notebook, deep-copied) is no rank's part: the copy gets None
        (process groups cannot be pickled, and would mean nothing elsewhere)."""
        return type(None), ()

    @property
    def holds_outputs(self) -> bool:
        """Whether this rank's forward gives the model's outputs: the last stage; ``tp`` rank 0 (one per copy)."""
        if self.kind == "pipeline":
            return self.stages - 1 in self.stage_ids
        return self.mp_rank == 0


PART = "nbddp_kept_part"  # the attribute of a kept module that holds its KeptParallel


@dataclass
class KeptFit:
    module_id: int  # id() of the module bound to the name: a later rebinding of the name is not this fit's
    kind: str  # what the strategy declared it is kept as: "module" (whole on every rank), "fsdp", "pipeline", "tensor"
    precision: str  # the fit's (``"bf16-mixed"`` ...): predict's default
    mp: int = 1  # ranks per model copy


def part_of(module: nn.Module) -> KeptParallel | None:
    """The model-parallel part a fit recorded on ``module`` (None: a whole or FSDP model)."""
    return module.__dict__.get(PART)


def record(strategy: Any, precision: str) -> KeptFit:
    """What this rank keeps of a finished fit's ``strategy`` for a later ``predict`` (the part goes on the module).

    How predict runs it is what the strategy's settings declare (``kept_as``;
    the kernel refused ``keep=`` for one that declares nothing).
    """
    kind, parallel = strategy.settings.kept_as, None
    if kind in ("pipeline", "tensor"):
        mesh = strategy.mesh
        parallel = KeptParallel(kind, mesh.dp_rank, strategy.layout.dp, mesh.mp_rank, strategy.layout.mp,
                                mesh.mp_group, mesh.dp_group, bool(strategy.sharded))
        if kind == "pipeline":
            parallel.stage_ids = list(strategy.stage_ids)
            parallel.stage_modules = [s.submod for s in strategy.stages]
            parallel.stages, parallel.microbatches = strategy.spec.stages, strategy.spec.microbatches
        strategy.module.__dict__[PART] = parallel  # a plain attribute: not a submodule, not in the state dict
    return KeptFit(id(strategy.module), kind, precision, parallel.mp if parallel is not None else 1)


def describe(name: str, namespace: dict[str, Any], kept_by: dict[str, KeptFit]) -> dict[str, Any]:
    """What ``name`` holds on this rank, for the kernel's check before a call.

    ``kind``: ``"module"`` (a whole model), ``"fsdp"``, ``"pipeline"``,
    ``"tensor"``; or why predict cannot run it; ``""``: nothing.
    ``precision``: the fit's, when a fit kept it. ``mp``: ranks per model copy.
    """
    if name not in namespace:
        return {"kind": "", "precision": "", "mp": 1}
    module = namespace[name]
    if not isinstance(module, nn.Module):
        return {"kind": f"not a module ({type(module).__name__})", "precision": "", "mp": 1}
    fitted = kept_by.get(name)
    if fitted is not None and fitted.module_id == id(module):
        return {"kind": fitted.kind, "precision": fitted.precision, "mp": fitted.mp}
    if any(hasattr(p, "device_mesh") for p in module.parameters()):
        return {"kind": "a sharded module (DTensor parameters) that no dist_fit(keep=...) bound", "precision": "",
                "mp": 1}
    return {"kind": "module", "precision": "", "mp": 1}


def full(value: Any) -> Any:
    """``value`` with every DTensor made a whole tensor (a tensor-parallel output left sharded or replicated)."""
    if hasattr(value, "full_tensor"):
        return value.full_tensor()
    if isinstance(value, dict):
        return {k: full(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return type(value)(full(v) for v in value)
    return value
