"""nbddp's own strategies' settings: ``nbddp.DDP``, ``nbddp.FSDP``, ``nbddp.Pipeline``, ``nbddp.TensorParallel``.

Plain data, checked in the kernel, read on the workers. Each class declares
what it supports (``protocol/strategy_settings.py``: sharded, model-parallel,
fewer ranks, streams, kept for predict, its worker class); the kernel's checks
ask those questions. ``resolve_strategy`` turns ``strategy=`` into one of
these (``"ddp"`` stays the string, ``"fsdp"`` is ``FSDP()``), and
``settings_of`` answers for the string too. The mesh a model-parallel
strategy trains on is ``protocol/mesh_layout.py``'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, TypeGuard

from nbddp.protocol.mesh_layout import count
from nbddp.protocol.mesh_layout import layout
from nbddp.protocol.strategy_settings import StrategyChoice, StrategySettings

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

    from nbddp.protocol.fit_options import FitConfig


SCHEDULES = ("1f1b", "gpipe", "interleaved")
TP_STYLES = ("colwise", "rowwise")

# nbddp's own wording of what a model-parallel strategy does not support (``StrategySettings.require``)
MODEL_PARALLEL_FEWER_RANKS = (
    "dist_fit(min_workers=..., strategy={cls}(...)): going on with fewer ranks is built for strategy='ddp' (a "
    "snapshot any rank reads whole) and 'fsdp' (DCP reshards its snapshot for fewer ranks); a pipeline's stages and "
    "tensor-parallel slices need every rank they began with. Leave min_workers out (a lost rank is then replaced), or "
    "train with strategy='ddp' or 'fsdp'")
PIPELINE_STREAMS = (
    "dist_fit(data=...) is a stream (an IterableDataset), and nbddp.Pipeline needs a map-style Dataset: its stages "
    "must know a micro-batch's shapes before the first step, and every step's batch must be whole. Give a map-style "
    "Dataset, or train the stream with nbddp.TensorParallel(), 'fsdp' or 'ddp'")


def _dp(value: StrategyChoice, where: str) -> str | FSDP:
    """What runs over the ``dp`` dimension: ``"ddp"`` or an ``FSDP`` (``"fsdp"`` is ``FSDP()``)."""
    if value == "ddp" or isinstance(value, FSDP):
        return value
    if isinstance(value, DDP):
        if value == DDP():
            return "ddp"
        raise ValueError(f"{where}(dp={value!r}): a model-parallel group averages its replicas' gradients itself, "
                         "without torch's DistributedDataParallel, so DDP's settings would be ignored there; use "
                         "dp='ddp'")
    if value == "fsdp":
        return FSDP()
    raise ValueError(f"{where}(dp=...) says what runs over the data-parallel dimension: 'ddp', 'fsdp' or an "
                     f"nbddp.FSDP(...); got {value!r}")


@dataclass(frozen=True)
class Pipeline(StrategySettings):
    """Pipeline parallelism: the model cut into ``stages``, each on its own rank, fed ``microbatches`` per batch.

    Args:
        stages: how many pieces. With ``"gpipe"`` and ``"1f1b"`` each rank of a
            pipeline holds one; with ``"interleaved"`` each holds
            ``stages / pp`` pieces that are not neighbours (less idle time).
        microbatches: each batch is cut into this many equal micro-batches
            that flow through the stages one after another; ``batch_size``
            must be divisible by it. More microbatches: less idle time,
            ``(stages - 1) / (microbatches + stages - 1)`` for one pipeline.
        schedule: ``"1f1b"`` (one forward, one backward: at most ``stages``
            micro-batches' activations alive; needs ``microbatches >= stages``),
            ``"gpipe"`` (all forwards, then all backwards), ``"interleaved"``
            (interleaved 1F1B over several pieces per rank).
        split: where the cuts go, as the names of the modules that begin a new
            stage: child names of an ``nn.Sequential`` (``[2]`` or ``["2"]``),
            or module paths of any model (``["blocks.2"]``, traced with
            ``torch.distributed.pipelining.pipeline``). Default: cut an
            ``nn.Sequential``'s children, or a model's repeated blocks (the
            layers of a transformer), into stages of about equal parameter count.
        dp: what runs over the data-parallel dimension of ``mesh=``: ``"ddp"``
            (replicas; gradients averaged after each step) or ``"fsdp"`` /
            ``nbddp.FSDP(...)`` (each stage sharded over its replicas).

    The loss is computed on the last stage; batches are ``(x, y)`` or
    ``(x1, ..., y)`` (the inputs go to the first stage, the target to the last).
    A partial last batch of an epoch is dropped: stages exchange tensors of a
    fixed shape.
    """

    stages: int = 2
    microbatches: int = 4
    schedule: str = "1f1b"
    split: Any = None  # normalised to a tuple of module names, or None
    dp: Any = "ddp"

    def __post_init__(self) -> None:
        count("nbddp.Pipeline", "stages", self.stages, 2)
        count("nbddp.Pipeline", "microbatches", self.microbatches, 1)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"nbddp.Pipeline(schedule={self.schedule!r}) is not a schedule nbddp knows; use one of "
                             f"{SCHEDULES}")
        if self.schedule == "1f1b" and self.microbatches < self.stages:
            raise ValueError(f"nbddp.Pipeline(schedule='1f1b') needs at least one micro-batch per stage, got "
                             f"microbatches={self.microbatches} for stages={self.stages}; use microbatches>="
                             f"{self.stages}, or schedule='gpipe'")
        object.__setattr__(self, "split", _split(self.split, self.stages))
        object.__setattr__(self, "dp", _dp(self.dp, "nbddp.Pipeline"))

    name = "pipeline"
    worker = "pipeline"
    sharded = True
    mp_dim = "pp"
    kept_as = "pipeline"
    refusals = {"fewer_ranks": MODEL_PARALLEL_FEWER_RANKS, "streams": PIPELINE_STREAMS}


def _split(value: str | int | Iterable[str | int] | None, stages: int) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, (str, int)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"nbddp.Pipeline(split=...) takes the names of the modules that begin a stage, e.g. "
                        f"['blocks.2']; got {type(value).__name__} {value!r}") from None
    if not all(isinstance(i, str) or (isinstance(i, int) and not isinstance(i, bool)) for i in items):
        raise TypeError(f"nbddp.Pipeline(split=...) takes module names (or an nn.Sequential's child indices); got {value!r}")
    names = tuple(str(i) for i in items)
    if len(names) != stages - 1:
        raise ValueError(f"nbddp.Pipeline(stages={stages}, split={list(names)}) names {len(names)} cut point(s); "
                         f"{stages} stages need {stages - 1} (the first module of each stage after the first)")
    if len(set(names)) != len(names):
        raise ValueError(f"nbddp.Pipeline(split={list(names)}) names a cut point twice, which leaves a stage empty")
    return names


@dataclass(frozen=True)
class TensorParallel(StrategySettings):
    """Tensor parallelism: each large ``nn.Linear`` split across the ``tp`` ranks of a group.

    Args:
        plan: ``None`` finds the usual pairs: an MLP's up and down projections
            (``fc1``/``fc2``, ``gate_proj``/``up_proj``/``down_proj``, or an
            ``nn.Sequential`` of Linear-activation-Linear): the first split by
            output features (``"colwise"``), the second by input features
            (``"rowwise"``); attention's ``q_proj``/``k_proj``/``v_proj``
            colwise and ``o_proj`` rowwise. Attention must reshape into heads
            with ``-1`` (``view(b, t, -1, head_dim)``): each rank holds
            ``heads / tp`` of them. Or a dict ``{"module.path": "colwise" |
            "rowwise" | ParallelStyle}``.
        dp: what runs over the data-parallel dimension of ``mesh=``: ``"ddp"``
            or ``"fsdp"`` / ``nbddp.FSDP(...)`` (FSDP2 over ``dp`` on top of
            TP, as torchtitan composes them).
    """

    plan: Any = None
    dp: Any = "ddp"

    def __post_init__(self) -> None:
        object.__setattr__(self, "plan", _plan(self.plan))
        object.__setattr__(self, "dp", _dp(self.dp, "nbddp.TensorParallel"))

    name = "tensor"
    worker = "tensor"
    sharded = True
    mp_dim = "tp"
    streams = True
    kept_as = "tensor"
    refusals = {"fewer_ranks": MODEL_PARALLEL_FEWER_RANKS}


def _plan(plan: dict[str, str | ParallelStyle] | None) -> dict[str, str | ParallelStyle] | None:
    if plan is None:
        return None
    if not isinstance(plan, dict) or not plan:
        raise TypeError(f"nbddp.TensorParallel(plan=...) must be None or a non-empty dict of module path -> 'colwise', "
                        f"'rowwise' or a ParallelStyle; got {plan!r}")
    from torch.distributed.tensor.parallel import ParallelStyle

    for name, style in plan.items():
        if not isinstance(name, str) or not (style in TP_STYLES or isinstance(style, ParallelStyle)):
            raise ValueError(f"nbddp.TensorParallel(plan=...): {name!r}: {style!r} is not 'colwise', 'rowwise' or a "
                             "torch.distributed.tensor.parallel.ParallelStyle")
    return dict(plan)


def is_model_parallel(strategy: StrategyChoice) -> TypeGuard[Pipeline | TensorParallel]:
    """Whether ``strategy`` declares a model-parallel mesh dimension (``"ddp"``, the string, does not): once resolved
    (``resolve_strategy``), only a ``Pipeline`` or a ``TensorParallel`` does."""
    return getattr(strategy, "mp_dim", None) is not None


def data_parallel_size(strategy: StrategyChoice, mesh: dict[str, int] | None, world: int) -> int:
    """How many ranks read different data (the model-parallel ranks of a group read the same batches)."""
    return layout(mesh, world).dp if is_model_parallel(strategy) else world


def describe(strategy: StrategyChoice, mesh: dict[str, int] | None, world: int) -> str:
    """``"dp=2 x pp=2 (1f1b, ddp)"``, ``"tp=2"``, ``"ddp"``: a fit's topology in a few words."""
    if not is_model_parallel(strategy):
        return getattr(strategy, "name", str(strategy))
    lay = layout(mesh, world)
    dims = " x ".join(f"{n}={lay.dp if n == 'dp' else lay.mp}" for n in lay.names if n != "dp" or lay.dp > 1)
    dp = f", {getattr(strategy.dp, 'name', strategy.dp)} over dp" if lay.dp > 1 else ""
    extra = strategy.schedule if isinstance(strategy, Pipeline) else ""
    return f"{dims} ({extra}{', ' if extra and dp else ''}{dp[2:]})" if extra or dp else dims


STRATEGIES = ("ddp", "fsdp")


@dataclass(frozen=True)
class DDP(StrategySettings):
    """Replicated training with torch's ``DistributedDataParallel``, and its own settings.

    ``strategy="ddp"`` is ``nbddp.DDP()``. The settings are torch's, passed on
    unchanged (see ``torch.nn.parallel.DistributedDataParallel``), because
    models need them: many Hugging Face models leave some parameters unused
    in a step and need ``find_unused_parameters=True``.

    Args:
        find_unused_parameters: find, after each forward, the parameters that
            got no gradient (costs a graph walk per step).
        static_graph: the set of used parameters never changes between steps
            (lets DDP skip that walk, and allows reentrant activation checkpointing).
        gradient_as_bucket_view: gradients are views into DDP's buckets (one
            copy of the gradients less).
        broadcast_buffers: send rank 0's buffers (BatchNorm statistics) to
            every rank before each forward; ``False`` lets each rank keep its own.
        bucket_cap_mb: size of a gradient bucket in MiB (``None``: torch's 25).
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    bucket_cap_mb: float | None = None

    def __post_init__(self) -> None:
        for setting in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view", "broadcast_buffers"):
            value = getattr(self, setting)
            if not isinstance(value, bool):
                raise TypeError(f"nbddp.DDP({setting}=...) must be True or False, got {type(value).__name__} {value!r}")
        cap = self.bucket_cap_mb
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not cap > 0):
            raise ValueError(f"nbddp.DDP(bucket_cap_mb=...) is the size of a gradient bucket in MiB: a number > 0, or "
                             f"None for torch's default (25); got {cap!r}")

    name = "ddp"
    worker = "ddp"
    fewer_ranks = True
    streams = True
    kept_as = "module"

    def torch_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for ``DistributedDataParallel`` (only those that differ from torch's defaults)."""
        kwargs: dict[str, Any] = {"find_unused_parameters": self.find_unused_parameters,
                                  "static_graph": self.static_graph,
                                  "gradient_as_bucket_view": self.gradient_as_bucket_view}
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        if not self.broadcast_buffers:  # torch 2.13 names it forward_sync_buffers (broadcast_buffers is deprecated)
            kwargs["forward_sync_buffers"] = False
        return kwargs


def is_replicated(strategy: StrategyChoice) -> bool:
    """Whether every rank holds the whole model: ``"ddp"``, or settings that are not sharded (``nbddp.DDP(...)``)."""
    return strategy == "ddp" or (isinstance(strategy, StrategySettings) and not strategy.sharded)


def settings_of(strategy: StrategyChoice) -> StrategySettings:
    """The settings object behind ``strategy``, to ask what it supports: ``"ddp"`` is ``DDP()``, ``"fsdp"`` ``FSDP()``.

    Raises:
        ValueError: anything else (checked in the kernel already: only a worker can see it).
    """
    if isinstance(strategy, StrategySettings):
        return strategy
    if strategy == "ddp":
        return DDP()
    if strategy == "fsdp":
        return FSDP()
    raise ValueError(f"unknown strategy {strategy!r}")


def class_name(cls: type | str) -> str:
    """How a module class is named across the kernel and the workers (notebook classes travel by value)."""
    if isinstance(cls, str):
        return cls
    return cls.__qualname__


@dataclass(frozen=True)
class FSDP(StrategySettings):
    """Sharded training: each rank holds 1/N of every parameter, gradient and optimizer state.

    Args:
        shard_modules: the module classes to shard as units (classes, or
            their names), e.g. ``{Block}`` or ``{"LlamaDecoderLayer"}``. Default:
            each repeated child block (every layer of an ``nn.ModuleList`` or
            ``nn.Sequential`` whose children share one class, like the layers
            of a transformer), then the root.
        reshard_after_forward: free each unit's gathered parameters after its
            forward (less memory, one more all-gather in backward). ``None``:
            torch's default (True for the units, False for the root).
        cpu_offload: keep the sharded parameters, gradients and optimizer
            state in CPU memory, moved to the GPU per unit (CUDA workers only).
        init_on_meta: build a model *factory* on the ``meta`` device and
            materialise only each rank's shards (when every module that holds
            parameters or buffers can ``reset_parameters()``; otherwise the
            factory's model is built whole, then sharded). A given
            ``nn.Module`` is never built again: its shipped weights are sharded
            in place.

    ``precision="bf16-mixed"`` becomes FSDP's mixed-precision policy: bf16
    parameters and compute, float32 gradient reduction.
    """

    shard_modules: Any = None  # normalised to a frozenset of class names
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    init_on_meta: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_modules", module_classes(self.shard_modules, "nbddp.FSDP(shard_modules=...)"))
        for setting, allowed in (("reshard_after_forward", (bool, type(None))), ("cpu_offload", (bool,)),
                                 ("init_on_meta", (bool,))):
            value = getattr(self, setting)
            if not isinstance(value, allowed):
                want = "True, False or None" if type(None) in allowed else "True or False"
                raise TypeError(f"nbddp.FSDP({setting}=...) must be {want}, got {type(value).__name__} {value!r}")

    name = "fsdp"
    worker = "fsdp"
    sharded = True
    fewer_ranks = True
    streams = True
    kept_as = "fsdp"


def module_classes(value: str | type | Iterable[str | type] | None, where: str,
                   alternative: str = "") -> frozenset[str] | None:
    """nn.Module classes or class names -> a frozenset of names (``None`` stays ``None``); ``alternative`` ends errors."""
    import torch.nn as nn

    if value is None:
        return None
    items = [value] if isinstance(value, (str, type)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"{where} takes module classes or their names, e.g. {{Block}}{alternative}; got "
                        f"{type(value).__name__} {value!r}") from None
    if not items:
        raise ValueError(f"{where} is empty; leave it None for the repeated blocks{alternative}")
    for item in items:
        if not (isinstance(item, str) or (isinstance(item, type) and issubclass(item, nn.Module))):
            raise TypeError(f"{where} takes nn.Module classes or their names{alternative}; got {item!r}")
    return frozenset(class_name(i) for i in items)


def resolve_strategy(value: StrategyChoice) -> StrategyChoice:
    """``"ddp"``, a ``DDP``, an ``FSDP`` (``"fsdp"`` is ``FSDP()``), a model-parallel setting, or any other
    ``StrategySettings`` whose declarations nbddp can act on.

    Raises:
        TypeError / ValueError: naming what is wrong with ``strategy=`` and the fix.
    """
    if isinstance(value, StrategySettings):
        if value.mp_dim is not None and not isinstance(value, (Pipeline, TensorParallel)):
            raise ValueError(f"dist_fit(strategy={type(value).__name__}(...)) declares mp_dim={value.mp_dim!r}: a "
                             "model-parallel strategy trains on nbddp's mesh machinery, so its settings class must "
                             "subclass nbddp.Pipeline or nbddp.TensorParallel. Subclass one of them, or declare "
                             "mp_dim = None for a data-parallel strategy")
        return value.check_declarations()
    if value == "fsdp":
        return FSDP()
    if value == "ddp":
        return "ddp"
    raise ValueError(f"dist_fit(strategy=...) must be one of {STRATEGIES} or an nbddp.FSDP(...), nbddp.DDP(...), "
                     f"nbddp.Pipeline(...) or nbddp.TensorParallel(...), got {value!r}")


def within(cfg: FitConfig, k: int) -> FitConfig:
    """``cfg`` for a subgroup of ``k`` ranks (the scaling report): one rank trains the model whole."""
    if not is_model_parallel(cfg.strategy):
        return cfg
    mesh = cfg.mesh or {}  # a model-parallel fit's mesh, completed for its world size by preflight
    mp = mesh[cfg.strategy.mp_dim]
    if k < mp:
        return dataclasses.replace(cfg, strategy=cfg.strategy.dp, mesh=None)
    return dataclasses.replace(cfg, mesh={"dp": k // mp, cfg.strategy.mp_dim: mp})
