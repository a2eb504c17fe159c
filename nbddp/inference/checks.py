"""Before ``predict``/``evaluate``: every argument the kernel can judge, then the arguments packed for the workers.

A wrong argument is an error here, naming it and the fix, before any worker
does anything.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeAlias

from nbddp.protocol.data_forms import DataLike, DataSpec
from nbddp.protocol.errors import ShippingError
from nbddp.protocol.fit_options import PRECISION_ALIASES, PRECISIONS, check_device_rules
from nbddp.protocol.messages import KeptModel, PredictLaunch
from nbddp.protocol.strategy_settings import KEPT_KINDS
from nbddp.shipping import pickling as shipping

if TYPE_CHECKING:
    from torch import nn

    from nbddp.session.session import Session

# predict(model=...): a module (shipped), a zero-argument factory of one (built on each rank), or the name of a
# module an earlier dist_fit(keep=...) bound on every rank
PredictModel: TypeAlias = "nn.Module | Callable[[], nn.Module] | str"

OUTPUTS = ("tensor", "list")


@dataclass
class PredictPlan:
    """What one ``predict``/``evaluate`` call ships, and what it expects back."""

    what: str  # "nbddp.predict" or "nbddp.evaluate", for messages
    launch: PredictLaunch
    n: int | None  # samples, when the kernel knows
    mp: int = 1  # ranks per model copy: the copies read blocks, every rank of a copy the same
    parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # local? -> parcel
    ship_s: float = 0.0

    def discard(self) -> None:
        for parcel in self.parcels.values():
            parcel.discard()


def check_model(model: PredictModel, what: str) -> None:
    """A module (shipped), a zero-argument factory of one (built on each rank), or the name of a kept one."""
    import torch

    if isinstance(model, str):
        if not model.isidentifier():
            raise ValueError(f"{what}(model={model!r}): a string names the model an earlier dist_fit(keep=...) bound "
                             "on every worker, so it must be a Python identifier like 'model'")
        return
    if isinstance(model, torch.nn.Module) or (callable(model) and not isinstance(model, type)):
        return
    if isinstance(model, type) and issubclass(model, torch.nn.Module):
        return
    kind = f"the class {model.__name__}, which is not an nn.Module" if isinstance(model, type) else \
        f"{type(model).__name__} {model!r}"
    raise TypeError(f"{what}(model=...) must be a torch.nn.Module or a zero-argument function returning one; "
                    f"got {kind}")


@dataclass
class Kept:
    """``model="name"``: what every rank holds under it, as the workers said (``worker/inference/kept.py``)."""

    model: KeptModel
    kind: str  # what the strategy declared it is kept as (``KEPT_KINDS``): "module" (a whole copy per rank), ...
    precision: str  # the fit's, or "" when no fit kept it
    mp: int = 1  # ranks per model copy (a pipeline's stages, a tensor-parallel group)


def kept_model(session: Session, name: str, what: str) -> Kept:
    """``model="name"``: every rank must hold a module under ``name`` that predict can run, asked before anything runs."""
    from nbddp.execution.calls import call_on_ranks
    from nbddp.worker.tasks.predict import kept_kind

    held = call_on_ranks(session, f"{what}(model={name!r}) (looking it up)", kept_kind,
                         lambda p: (name, session.generation)).wait()
    missing = [r for r, h in sorted(held.items()) if not h["kind"]]
    if missing:
        raise ValueError(f"{what}(model={name!r}): rank(s) {', '.join(map(str, missing))} hold nothing named {name!r}. "
                         f"dist_fit(..., keep={name!r}) binds the trained module under that name on every worker; "
                         "or pass the module itself (model=model)")
    odd = {h["kind"] for h in held.values() if h["kind"] not in KEPT_KINDS}
    if odd:
        raise ValueError(f"{what}(model={name!r}) holds {', '.join(sorted(odd))} on the workers: predict runs a module "
                         "bound there by dist_fit(keep=...) (DDP, FSDP, a pipeline, tensor parallel) or by a %%ddp "
                         "cell; pass the notebook's model otherwise")
    first = held[min(held)]
    return Kept(KeptModel(name), first["kind"], first["precision"], first["mp"])


def check_batch_size(batch_size: int, what: str) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"{what}(batch_size=...) is the number of samples per forward on each rank, a positive "
                         f"integer; got {batch_size!r}")
    return batch_size


def check_output(output: str) -> str:
    if output not in OUTPUTS:
        raise ValueError(f"nbddp.predict(output=...) must be 'tensor' (tensors and dicts of tensors concatenated "
                         f"over the batches) or 'list' (one entry per batch, as the step returned it); got {output!r}")
    return output


def check_to(to: str | os.PathLike[str] | None) -> str | None:
    """``to=``: a ``.pt`` file (the index; the parts go next to it) or a directory, that this process can write.

    Checked here, on the kernel's machine: on one host the workers write
    where the kernel can; across hosts, each writes on its own file system.
    """
    if to is None:
        return None
    if not isinstance(to, (str, os.PathLike)):
        raise TypeError(f"nbddp.predict(to=...) must be a path (a directory, or a file name ending in .pt); "
                        f"got {type(to).__name__} {to!r}")
    path = os.path.abspath(os.fspath(to))
    folder = os.path.dirname(path) if path.endswith(".pt") else path
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(f"nbddp.predict(to={os.fspath(to)!r}): {folder} is a file, not a directory; give a "
                         "directory for the parts, or a name ending in .pt")
    existing = folder
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"nbddp.predict(to={os.fspath(to)!r}) cannot be written: {existing} is not writable by "
                         "this user. Choose a directory you can write to")
    _try_writing(existing, os.fspath(to))
    return path


def _try_writing(folder: str, given: str) -> None:
    """A file made and removed in ``folder``: ``os.access`` says yes to root everywhere, even in ``/proc`` or on a
    read-only file system, where the workers' first write would fail."""
    import tempfile

    try:
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".nbddp-write-check-")
    except OSError as exc:
        raise ValueError(f"nbddp.predict(to={given!r}) cannot be written: making a file in {folder} failed "
                         f"({exc.strerror}). Choose a directory you can write to") from None
    os.close(fd)
    os.unlink(probe)


def check_precision(precision: str, what: str, device_types: set[str]) -> str:
    name = PRECISION_ALIASES.get(precision, precision) if isinstance(precision, str) else precision
    if name not in PRECISIONS:
        raise ValueError(f"{what}(precision=...) must be one of {PRECISIONS} (or '32', 'bf16'); got {precision!r}")
    check_device_rules(name, False, device_types)
    return name


def check_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """``name -> Metric object or per-sample function``; a value that is neither is refused, naming what it needs."""
    if not isinstance(metrics, Mapping) or not metrics or not all(isinstance(k, str) for k in metrics):
        raise TypeError("nbddp.evaluate(metrics=...) must be a non-empty dict of name -> metric, e.g. "
                        "{'f1': torchmetrics.F1Score(task='multiclass', num_classes=10)}; "
                        f"got {type(metrics).__name__} {metrics!r}")
    for name, metric in metrics.items():
        has = callable(getattr(metric, "update", None)), callable(getattr(metric, "compute", None))
        if all(has) or (callable(metric) and not any(has)):
            continue
        lacks = [m for m, ok in zip(("update", "compute"), has) if not ok]
        raise TypeError(f"nbddp.evaluate(metrics={{{name!r}: ...}}) got {type(metric).__name__} {metric!r}, which has "
                        f"no {' or '.join(lacks)}(): a metric needs update(outputs, targets) and compute() (a "
                        "torchmetrics Metric, pip install 'nbddp[metrics]'), or is a function (outputs, targets) -> "
                        "one value per sample")
    return dict(metrics)


def data_of(data: DataLike, what: str) -> tuple[DataSpec, int | None, int | None]:
    """``(DataSpec, length if known here, a DataLoader's batch size)``."""
    from nbddp.protocol.data_forms import data_spec

    spec, n, loader_batch_size = data_spec(data, f"{what}(data=...)")
    if spec.prebatched:
        raise ValueError(f"{what}(data=...) is a DataLoader(batch_size=None) over a stream that yields whole "
                         "batches; predict needs samples, to know each output's place in the stream. Pass the stream "
                         "of samples itself with batch_size=...")
    if n == 0:
        raise ValueError(f"{what}(data=...) is empty (len 0): there is nothing to run the model on")
    return spec, n, loader_batch_size


def ship(session: Session, plan: PredictPlan, parts: dict[str, Any]) -> PredictPlan:
    """Pack ``parts`` once per kind of host (shared memory on the kernel's, inline elsewhere)."""
    t0 = time.perf_counter()
    try:
        for local in sorted({p.local for p in session.placements}, reverse=True):
            plan.parcels[local] = shipping.pack(parts, what=f"the {plan.what} arguments", local=local,
                                                pool=session.send_pool if local else None, prefix=session.file_prefix)
    except ShippingError:
        plan.discard()
        for name, value in parts.items():  # name the argument that fails
            shipping.dumps(value if name != "data" else (value.dataset or value.factory), what=f"{plan.what}({name}=...)",
                           label=name)
        raise
    plan.ship_s = time.perf_counter() - t0
    return plan


def prepare(session: Session, what: str, model: PredictModel, data: DataLike, batch_size: int | None,
            precision: str | None,
            output: str = "tensor", to: str | None = None, kept: Kept | None = None,
            **callables: Callable | None) -> PredictPlan:
    """Check everything, then pack ``model``, ``data`` and ``callables`` (``step_fn``, ``metrics``, ``loss_fn``,
    ``target_fn``).

    ``precision=None``: a kept model's fit precision (a bf16 fit predicts in
    bf16), else full precision.
    """
    check_model(model, what)
    if precision is None:
        precision = (kept.precision if kept is not None else "") or "32-true"
    spec, n, loader_batch_size = data_of(data, what)
    batch_size = check_batch_size(batch_size if batch_size is not None else (loader_batch_size or 32), what)
    precision = check_precision(precision, what, {p.device.split(":")[0] for p in session.placements})
    for name, fn in callables.items():
        if name != "metrics" and fn is not None and not callable(fn):
            raise TypeError(f"{what}({name}=...) must be callable, got {type(fn).__name__} {fn!r}")
    task = "evaluate" if what.endswith("evaluate") else "predict"
    launch = PredictLaunch(session.generation, task, batch_size, precision, output, to)
    parts = {"model": KeptModel(model) if isinstance(model, str) else model, "data": spec, **callables}
    return ship(session, PredictPlan(what, launch, n, kept.mp if kept is not None else 1), parts)
