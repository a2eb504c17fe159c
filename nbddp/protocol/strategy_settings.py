"""What a strategy declares it supports: the base of every ``strategy=`` settings class.

``nbddp.DDP``, ``nbddp.FSDP``, ``nbddp.Pipeline`` and ``nbddp.TensorParallel``
are settings objects: plain, picklable data the kernel checks and the
workers read. Each class answers, as class attributes, the questions the
kernel's checks ask before a fit, instead of the checks testing its type
(as Lightning Fabric's strategies declare theirs in its registry):

* ``sharded``: each rank holds only a part of the weights (the model travels
  alone, the kernel builds the module the weights come back into);
* ``mp_dim``: model-parallel over that mesh dimension (``"pp"``, ``"tp"``),
  ``None`` for data parallelism (``protocol/mesh_layout.py``);
* ``fewer_ranks``: an elastic fit may go on with fewer ranks (``min_workers``);
* ``streams``: it trains on a stream (an ``IterableDataset``);
* ``kept_as``: what ``predict(model="name")`` runs after ``dist_fit(keep=...)``:
  ``"module"`` (a whole copy per rank), ``"fsdp"``, ``"pipeline"``,
  ``"tensor"``, or ``None`` (it cannot be kept);
* ``worker``: the class that trains it on each rank, a subclass of
  ``nbddp.worker.strategies.Strategy``: the class itself, or its dotted name
  (``"package.module:Class"``) so that the kernel need not import the worker
  side; nbddp's own name theirs by a short name the workers' registry knows
  (``worker/strategies/registry.py``).

A strategy defined outside nbddp declares the same and runs through
``dist_fit(strategy=...)``; what it leaves undeclared it does not support,
and asking for it is refused before anything ships (``require``).

Settings classes defined in a notebook (``__main__``) or in a module the
workers cannot import travel by value, as models do (``__reduce_ex__``).
"""

from __future__ import annotations

from typing import Any, ClassVar, SupportsIndex, TypeAlias

KEPT_KINDS = ("module", "fsdp", "pipeline", "tensor")  # how predict runs a kept model
MP_DIMS = (None, "pp", "tp")

# what each support question means, and what declaring it looks like: for the error of a strategy that does not
MEANINGS = {"fewer_ranks": ("go on with fewer ranks", "fewer_ranks = True"),
            "streams": ("train on a stream (an IterableDataset)", "streams = True"),
            "kept_as": ("be kept for nbddp.predict", "kept_as = 'module' (or 'fsdp', 'pipeline', 'tensor')")}


class StrategySettings:
    """The base of a ``dist_fit(strategy=...)`` settings class: its declarations, and how it travels.

    Subclass it (usually as a frozen dataclass whose fields are the
    strategy's settings), or subclass one of nbddp's own (``nbddp.DDP``) to
    keep what it declares. A class attribute left at this base's value is
    not supported.
    """

    worker: ClassVar[type | str | None] = None
    sharded: ClassVar[bool] = False
    mp_dim: ClassVar[str | None] = None
    fewer_ranks: ClassVar[bool] = False
    streams: ClassVar[bool] = False
    kept_as: ClassVar[str | None] = None
    #: nbddp's own wording of a refusal, by question (``{cls}``: the class name); others get ``require``'s
    refusals: ClassVar[dict[str, str]] = {}

    @property
    def name(self) -> str:
        """How the History, the live view and the loggers name the strategy (nbddp's own: ``"ddp"`` ...)."""
        return type(self).__name__

    def require(self, question: str, option: str, fix: str) -> None:
        """Refuse ``dist_fit(option)`` unless this strategy declares ``question`` (one of ``MEANINGS``).

        Raises:
            ValueError: naming the strategy class, the option and the fix.
        """
        if getattr(self, question):
            return
        cls = type(self).__name__
        own = self.refusals.get(question)
        if own:
            raise ValueError(own.format(cls=cls))
        meaning, declared = MEANINGS[question]
        raise ValueError(f"dist_fit({option}) needs a strategy that can {meaning}, and strategy={cls}(...) does not "
                         f"declare it ({cls}.{question} is {getattr(self, question)!r}). {fix}; or, if its worker "
                         f"class can, declare {declared} on {cls}")

    def check_declarations(self) -> StrategySettings:
        """This object, once its class's declarations are ones nbddp can act on (a class from outside nbddp).

        Raises:
            TypeError: no worker class declared.
            ValueError: ``mp_dim`` or ``kept_as`` not one nbddp knows.
        """
        cls = type(self).__name__
        if not (isinstance(self.worker, type) or (isinstance(self.worker, str) and self.worker)):
            raise TypeError(f"dist_fit(strategy={cls}(...)): {cls} declares no worker class, so no rank could train "
                            f"it. Declare worker = YourStrategy (a subclass of nbddp.worker.strategies.Strategy) on "
                            f"{cls}, or its dotted name worker = 'package.module:YourStrategy'; got {self.worker!r}")
        for question, known in (("mp_dim", MP_DIMS), ("kept_as", (None, *KEPT_KINDS))):
            if getattr(self, question) not in known:
                raise ValueError(f"dist_fit(strategy={cls}(...)): {cls}.{question} = {getattr(self, question)!r} is "
                                 f"not one nbddp knows; declare one of {known}")
        return self

    def __reduce_ex__(self, protocol: SupportsIndex) -> str | tuple[Any, ...]:
        """nbddp's own settings pickle by name; anyone else's through cloudpickle, which takes the class by value
        where the workers cannot import it.

        The ``FitConfig`` that holds these settings travels through
        ipyparallel's own pickling, which takes a notebook's class by name:
        ``Can't get attribute 'LoudDDP'`` on the workers. cloudpickle takes
        ``__main__``'s classes by value, and a module that nbddp ships by value
        (``nbddp/shipping/by_value.py``) was registered with it when the fit's
        arguments were packed, before this ``FitConfig`` is sent.
        """
        if type(self).__module__.split(".")[0] == "nbddp":
            return super().__reduce_ex__(protocol)
        import cloudpickle

        return rebuild, (cloudpickle.dumps((type(self), dict(self.__dict__))),)


# ``dist_fit(strategy=...)`` as given ("ddp", "fsdp" or a settings object), and once resolved ("ddp" or a settings
# object: ``parallel_settings.resolve_strategy``)
StrategyChoice: TypeAlias = "str | StrategySettings"


def rebuild(payload: bytes) -> StrategySettings:
    """A settings object that travelled by value (``StrategySettings.__reduce_ex__``), on the other side."""
    import cloudpickle

    cls, fields = cloudpickle.loads(payload)
    settings = cls.__new__(cls)
    settings.__dict__.update(fields)  # as pickle restores a frozen dataclass: no __init__, no __setattr__
    return settings
