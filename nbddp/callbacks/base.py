"""Callbacks for ``dist_fit(callbacks=[...])``: called in the kernel as the records arrive.

A callback is any object with one or more of the hooks::

    on_fit_start(info)        # training began: a FitInfo (steps, model, world size, hyperparameters, .handle)
    on_record(record)         # every record: step, epoch and validation ones (``record.kind`` says which)
    on_validation_end(record) # every validation check's record ("val"), after its on_record: SYNCHRONOUS
    on_epoch_end(record)      # every epoch's record (after its on_record): SYNCHRONOUS
    on_fit_end(history)       # the final History (also when the fit failed: status "failed")

They run in the kernel, in a thread of their own, in the order the records
were made. ``on_epoch_end`` and ``on_validation_end`` are synchronous, as
in Keras and Lightning: when a callback defines one, every rank waits after
that record until the kernel's hooks have run (one round trip per epoch,
``benchmarks/bench_latency.py``; no wait at all when no callback defines
them). What such a hook asks lands before the next epoch (or step) on
every rank:

* returning ``"stop"`` (or ``nbddp.stop_fit()``, or raising): the fit ends
  right there, ``status="completed"``, ``History.stop_reason`` naming the hook;
* ``self.handle.set_lr(lr)``: every parameter group's learning rate, from
  the next optimizer step on;
* ``self.handle.save_checkpoint(folder)``: every rank writes the fit's
  checkpoint there (``step-<N>.pt``) before training on; ``resume=folder``
  continues from it.

``self.handle`` (a ``Callback`` subclass) and ``info.handle`` (any callback)
are the fit's ``FitHandle``. ``on_record`` stays asynchronous: the ranks
train on while it runs, and a stop asked there takes the Stop button's
path: it lands at the next reduction after the kernel saw the record (a
fraction of a second later: ``dist_fit(log_every=...)`` steps at most, and
more records on a fast fit), with ``status="interrupted"``.

A hook that raises is reported with its traceback, that callback gets no
more records (only ``on_fit_end``) and, unless it sets
``stop_on_error = False``, the fit stops the same clean way: the model
keeps the weights of that step, and ``History.stop_reason`` says why. The
ranks waiting at a synchronous point are answered whatever a hook did.
"""

from __future__ import annotations

import threading
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from nbddp.loggers.fit_info import FitInfo
from nbddp.protocol.errors import NbddpError
from nbddp.protocol.notices import report

HOOKS = ("on_fit_start", "on_record", "on_validation_end", "on_epoch_end", "on_fit_end")
_current = threading.local()  # the hook being called in this thread: who asked nbddp.stop_fit() to stop


class EndedFit(Protocol):
    """The ``History`` ``on_fit_end`` gets (``nbddp.fit.history.History``: ``fit/`` imports this package), as far as
    callbacks read it and the hooks write it."""

    status: str
    steps: list[dict[str, Any]]
    epochs: list[dict[str, Any]]
    validations: list[dict[str, Any]]
    stop_reason: str | None
    best: dict[str, Any] | None
    loggers: list[dict[str, Any]]
    errors: list[dict[str, str]]

    @property
    def last_step(self) -> int: ...


class Callback:
    """An optional base class: override the hooks you need (any object with one of them works too)."""

    #: an exception in a hook stops the fit (True), or the fit goes on without this callback (False)
    stop_on_error = True
    #: the running fit's ``FitHandle`` (set before ``on_fit_start``): ``set_lr``, ``save_checkpoint``, ``stop``
    handle: Any = None

    def on_fit_start(self, info: FitInfo) -> str | None:
        return None

    def on_record(self, record: Record) -> str | None:
        return None

    def on_validation_end(self, record: Record) -> str | None:
        return None

    def on_epoch_end(self, record: Record) -> str | None:
        return None

    def on_fit_end(self, history: EndedFit) -> str | None:
        return None


class Record(dict[str, Any]):
    """A record as a callback gets it: a copy of History's dict, with ``.kind`` (``"step"``, ``"epoch"``, ``"val"``)."""

    def __init__(self, kind: str, values: dict[str, Any]):
        super().__init__(values)
        self.kind = kind


#: the top-level packages whose callbacks take a trainer and a module, not nbddp's records
FOREIGN = {"lightning": "Lightning", "pytorch_lightning": "Lightning", "keras": "Keras", "tf_keras": "Keras",
           "tensorflow": "Keras", "transformers": "Hugging Face"}


def _refuse_foreign(cb: object) -> None:
    """A Lightning, Keras or HF callback has hooks of the same names but other arguments: refused at once."""
    for cls in type(cb).__mro__:
        framework = FOREIGN.get(cls.__module__.split(".")[0])
        if framework is not None:
            raise TypeError(
                f"dist_fit(callbacks=[...]) got a {framework} callback, {type(cb).__name__} ({cls.__module__}."
                f"{cls.__qualname__}); nbddp does not run {framework}'s trainer, so it would call it with the wrong "
                "arguments. nbddp calls on_fit_start(info), on_record(record), on_validation_end(record), "
                "on_epoch_end(record) and on_fit_end(history) in the kernel, with records of reduced values: write a class with those "
                "hooks (subclass nbddp.callbacks.Callback) that does what it did; nbddp.EarlyStopping(...) takes "
                "the place of early stopping; in on_epoch_end, self.handle.save_checkpoint(folder) and "
                "self.handle.set_lr(lr) act on every rank before the next epoch")


def check_callbacks(callbacks: object) -> list[object]:
    """``dist_fit(callbacks=...)`` as a list; an object without any hook raises here, before training."""
    if callbacks is None:
        return []
    items = list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]
    for cb in items:
        if isinstance(cb, type):
            raise TypeError(f"dist_fit(callbacks=[...]) got the class {cb.__name__}; pass an instance: {cb.__name__}()")
        _refuse_foreign(cb)
        if not any(callable(getattr(cb, hook, None)) for hook in HOOKS):
            raise TypeError(f"dist_fit(callbacks=[...]): {type(cb).__name__} {cb!r} has none of the hook methods "
                            f"{', '.join(HOOKS)}; a callback defines at least one of them (or subclasses "
                            "nbddp.callbacks.base.Callback)")
    return items


def hook_stop() -> Callable[[str], None] | None:
    """The stop of the hook running in this thread (None outside a hook): ``FitHandle.stop`` from a callback."""
    current = getattr(_current, "hook", None)
    return current[0] if current is not None else None


def stop_fit(reason: str | None = None) -> None:
    """Stop the running ``dist_fit`` cleanly at the next sync, as the Stop button does.

    From a callback's hook it stops that callback's fit (and ``History.stop_reason``
    names the callback); from a notebook cell, the fit running now
    (``block=False``).

    Raises:
        NbddpError: no fit is running.
    """
    current = getattr(_current, "hook", None)
    if current is not None:
        stop, label = current
        stop(reason or f"{label} called nbddp.stop_fit()")
        return
    from nbddp.session.session import get_session

    run = get_session().running
    if run is None or getattr(run, "hooks", None) is None:
        raise NbddpError("nbddp.stop_fit(): no dist_fit is running. It stops a fit from one of its callbacks, or "
                         "from a cell while a dist_fit(..., block=False) trains")
    run.request_stop(reason or "nbddp.stop_fit()")


class CallbackSet:
    """The callbacks of one fit, called by ``FitHooks`` in the watcher thread."""

    def __init__(self, callbacks: list[object]):
        self.callbacks = callbacks
        self.dropped: set[int] = set()
        self.errors: list[dict[str, str]] = []

    def __bool__(self) -> bool:
        return bool(self.callbacks)

    def call(self, hook: str, arg: FitInfo | Record | EndedFit, stop: Callable[[str], None]) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if fn is None or (id(cb) in self.dropped and hook != "on_fit_end"):
                continue
            label = f"{type(cb).__name__}.{hook}"
            _current.hook = (stop, label)
            try:
                out = fn(arg)
            except Exception as exc:  # noqa: BLE001 - reported; the fit stops cleanly (or goes on)
                self._failed(cb, label, exc, stop)
                continue
            finally:
                _current.hook = None
            if isinstance(out, str) and out == "stop":
                stop(f"{label} returned 'stop'")

    def _failed(self, cb: object, label: str, exc: Exception, stop: Callable[[str], None]) -> None:
        text = "".join(traceback.format_exception(exc))
        stops = getattr(cb, "stop_on_error", True)
        then = "the fit stops at the next sync (the model keeps that step's weights)" if stops else "the fit goes on"
        report(f"nbddp: callback {label} raised; it gets no more records, and {then}", text)
        self.errors.append({"source": f"callback {label}", "error": f"{type(exc).__name__}: {exc}", "traceback": text})
        self.dropped.add(id(cb))  # in an unknown state now: only on_fit_end still comes, to let it clean up
        if stops:
            stop(f"{label} raised {type(exc).__name__}: {exc}")
