"""``dist_fit``'s options in the kernel, grouped by concern: the one list of their names.

The public calls keep their flat keywords (``dist_fit(model, data, epochs=3, lr=1e-3, ...)``, and the
``**fit_options`` of ``sweep``, ``find_batch_size`` and ``scaling_report``). Each builds these records once,
``FitArguments.of``, which refuses a name no group has, and hands them on: every part of the kernel then reads
the group it needs by attribute (the checks and the shipping, ``preflight.py``; the trial step of
``batch_size="auto"``; the loggers and callbacks), and a new option is one field here.

A field's default is ``dist_fit``'s default (``tests/test_argument_checks.py`` holds the signature to these
records). The records hold the values as the person gave them; ``option_checks.py`` judges them and builds the
``FitConfig`` the workers read (``protocol/fit_options.py``) from the fields of the same names.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, TypeAlias, Union

from nbddp.elastic.policy import RetryOn, SnapshotEvery
from nbddp.live.choice import LiveChoice
from nbddp.loggers import LoggerChoice
from nbddp.protocol.data_forms import DataLike
from nbddp.protocol.strategy_settings import StrategySettings

if TYPE_CHECKING:
    from _typeshed import DataclassInstance
    from torch.nn import Module
    from torch.optim import Optimizer

#: ``model=``: a module (its weights travel, the trained ones come back into it), or a zero-argument factory of one
#: (a Module class is one), built on each worker
ModelLike: TypeAlias = Union["Module", Callable[[], "Module"]]
#: ``optimizer=``: an Optimizer class (built with ``lr``) or a factory ``params -> Optimizer``
OptimizerLike: TypeAlias = Callable[..., "Optimizer"]
#: ``scheduler=``: a factory ``optimizer -> LR scheduler``, or Lightning's dict ``{"scheduler": factory, ...}``
SchedulerLike: TypeAlias = Union[Callable[["Optimizer"], Any], dict[str, Any]]
#: ``activation_checkpointing=``: True (every unit), or module classes or their names
ModuleClasses: TypeAlias = Union[bool, type["Module"], str, Iterable[Union[type["Module"], str]]]
#: ``compile=``: True, or a dict of ``protocol.compile_settings.COMPILE_KEYS`` (mode, backend, fullgraph, ...)
CompileChoice: TypeAlias = Union[bool, Mapping[str, Union[str, bool, None]], None]
#: ``profile=``: True, or a dict of ``protocol.profile_spec.ProfileSpec``'s fields (counts, flags, ``dir``)
ProfileChoice: TypeAlias = Union[bool, Mapping[str, Union[int, str, None]], None]
#: ``metrics=``: name -> fn(output, target), or torchmetrics ``Metric`` objects
Metrics: TypeAlias = Mapping[str, Callable[..., Any]]
#: ``loggers=``: logger names or ``nbddp.loggers.Logger`` objects (one, or a list)
Loggers: TypeAlias = Union[LoggerChoice, Sequence[LoggerChoice], None]
#: ``callbacks=``: any objects with one or more of the hooks (``callbacks/base.py``)
Callbacks: TypeAlias = Union[Sequence[object], None]
FilePath: TypeAlias = Union[str, "os.PathLike[str]"]

SWEEP = {"sweepable": True}  # a field's metadata: a sweep's trial may vary it (it changes that trial's FitConfig only)


@dataclass(frozen=True)
class DataOptions:
    """How the training data is read: the batch, its order, the loaders."""

    batch_size: int | str | None = field(default=None, metadata=SWEEP)  # per rank; "auto": the largest that fits
    shuffle: bool | None = field(default=None, metadata=SWEEP)  # None: True, or a DataLoader's own setting
    drop_last: bool = field(default=False, metadata=SWEEP)
    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch: int = 1


@dataclass(frozen=True)
class ValidationOptions:
    """What the fit is checked on, with what, and how often."""

    val_data: DataLike | None = None
    metrics: Metrics | None = None
    val_every: int | str | None = field(default=None, metadata=SWEEP)


@dataclass(frozen=True)
class StepOptions:
    """How one optimizer step is computed: the loss, the optimizer and its schedule, the numbers."""

    loss_fn: Callable[..., Any] | None = None
    step_fn: Callable[..., Any] | None = None
    optimizer: OptimizerLike | None = None
    lr: float | None = field(default=None, metadata=SWEEP)
    scheduler: SchedulerLike | None = None
    scheduler_interval: str | None = None
    seed: int = field(default=0, metadata=SWEEP)
    precision: str = field(default="32-true", metadata=SWEEP)
    grad_accum: int = field(default=1, metadata=SWEEP)
    clip_grad_norm: float | None = field(default=None, metadata=SWEEP)
    sync_batchnorm: bool = False
    on_nan: str = "raise"


@dataclass(frozen=True)
class LoopOptions:
    """How long the fit trains, and how often it records."""

    epochs: int = field(default=1, metadata=SWEEP)
    max_steps: int | None = field(default=None, metadata=SWEEP)
    log_every: int = field(default=20, metadata=SWEEP)
    record_interval_s: float = 1.0
    publish_interval_s: float = 0.25
    profile: ProfileChoice = False


@dataclass(frozen=True)
class LayoutOptions:
    """How the model is laid over the ranks, and compiled there."""

    strategy: str | StrategySettings = "ddp"
    mesh: dict[str, int] | None = None
    activation_checkpointing: ModuleClasses = False
    compile: CompileChoice = False


@dataclass(frozen=True)
class CheckpointOptions:
    """Where the fit's checkpoints go, how often, and which one it resumes from."""

    checkpoint_dir: FilePath | None = None
    checkpoint_every: int | None = None
    resume: bool | FilePath = False
    trust_checkpoint: bool = False


@dataclass(frozen=True)
class FaultOptions:
    """An elastic fit: how often a lost rank is replaced, what is snapshotted for it, what else is retried."""

    max_restarts: int = 0
    snapshot_every: SnapshotEvery = None
    retry_on: RetryOn = None
    min_workers: int | None = None


@dataclass(frozen=True)
class ResultOptions:
    """What the fit leaves: the weights in the notebook's model, and a module bound on every rank."""

    keep: str | None = None
    return_weights: bool = True


@dataclass(frozen=True)
class WatchOptions:
    """How the call watches its fit: whether the cell waits, the live view, loggers and callbacks, stalls.

    Only a call that runs one watched fit takes these (``dist_fit``): to ``sweep``, ``find_batch_size`` and
    ``scaling_report`` they are unknown options (``FitArguments.of(..., watched=False)``).
    """

    block: bool = True
    live: LiveChoice = None
    stall_timeout: float | None = None
    loggers: Loggers = None
    callbacks: Callbacks = None


@dataclass(frozen=True)
class FitArguments:
    """Every option of one fit, by concern (each group a record of its own)."""

    data: DataOptions = field(default_factory=DataOptions)
    validation: ValidationOptions = field(default_factory=ValidationOptions)
    step: StepOptions = field(default_factory=StepOptions)
    loop: LoopOptions = field(default_factory=LoopOptions)
    layout: LayoutOptions = field(default_factory=LayoutOptions)
    checkpoints: CheckpointOptions = field(default_factory=CheckpointOptions)
    faults: FaultOptions = field(default_factory=FaultOptions)
    result: ResultOptions = field(default_factory=ResultOptions)
    watch: WatchOptions = field(default_factory=WatchOptions)

    @classmethod
    def of(cls, options: Mapping[str, Any], *, watched: bool = True) -> FitArguments:
        """The records of ``options`` (``dist_fit``'s keywords, as given); the options not given keep their defaults.

        ``watched=False``: for a call that watches no fit of its own, ``WatchOptions``' names are unknown.

        Raises:
            TypeError: a name that is no option (a typo), before anything else is looked at.
        """
        group_of = {name: group for group, names in _names(watched).items() for name in names}
        unknown = set(options) - set(group_of)
        if unknown:
            raise TypeError(f"dist_fit() got unknown option(s) {sorted(unknown)}; see help(nbddp.dist_fit) for the "
                            "options")
        given: dict[str, dict[str, Any]] = {group: {} for group in _GROUPS}
        for name, value in options.items():
            given[group_of[name]][name] = value
        return cls(**{group: kind(**given[group]) for group, kind in _GROUPS.items()})

    def groups(self) -> Iterator[DataclassInstance]:
        """Each group's record, in field order (``DataOptions``, ``ValidationOptions``, ...)."""
        return (getattr(self, group) for group in _GROUPS)

    def by_name(self) -> dict[str, Any]:
        """Every option by its name, from whichever group holds it (what ``FitConfig``'s fields are read from)."""
        return {f.name: getattr(group, f.name) for group in self.groups() for f in fields(group)}


_GROUPS: dict[str, type[Any]] = {f.name: type(getattr(FitArguments(), f.name)) for f in fields(FitArguments)}


def _names(watched: bool) -> dict[str, list[str]]:
    """Each group's option names (``watch``'s only when ``watched``)."""
    return {group: [f.name for f in fields(kind)] for group, kind in _GROUPS.items() if watched or group != "watch"}


def sweepable() -> tuple[str, ...]:
    """The options a sweep's trial may vary: each changes that trial's ``FitConfig`` and nothing else (no topology,
    no files), so one shipped plan serves every trial."""
    return tuple(f.name for kind in _GROUPS.values() for f in fields(kind) if f.metadata.get("sweepable"))
