"""Giving back what a task used, for the next one: workers stay as light as they were before it.

An engine outlives every fit, so whatever a task leaves allocated stays with
the worker: measured with a 100M-parameter AdamW model, a worker went from
248 MiB to 3.4 GiB after one fit and stayed there while idle. Most of it was
free already, but kept by glibc's heap; ``gc.collect()`` then
``malloc_trim(0)`` brought it back to 0.3-0.7 GiB. So every task that runs
the person's code (``run_task``: fits, planner trials, ``%%ddp`` cells,
``nbddp.run`` calls, pushes, scripts) ends, once its frames are gone, with:

1. a collection of what the task allocated (the fit's module, optimizer,
   loaders and gathered state dict are garbage by then, some of them in
   reference cycles that only the collector finds);
2. ``malloc_trim(0)`` on glibc: the free pages of every heap go back to the
   system (other C libraries, or another allocator in ``LD_PRELOAD``: no
   such call, nothing to do);
3. ``torch.cuda.empty_cache()`` where CUDA is in use: the caching allocator
   gives its free blocks back, so the next fit's peak starts from what is
   really held.

What the person kept stays: ``%%ddp`` names (``keep=`` binds one), resident
datasets, a failed task's traceback (``sys.last_*``, for post-mortem use).

**Milliseconds, not a quarter of a second.** A full collection on an
engine walks its ~320k long-lived objects (IPython, zmq, torch): 0.25-0.3 s
here. So they are frozen out of the collector (``gc.freeze``) when the
first task begins, and again when a task begins after modules were imported
(``begin_task``); the collection at a task's end walks what is not frozen:
what the task allocated and what the person keeps (microseconds for a call,
milliseconds for a fit). The training loop profits too: its collections
skip the engine's objects.
Something frozen that becomes garbage later is found by a full collection,
which runs only when a kept value was let go and is still alive (a
``%%ddp`` name rebound to a new model whose old one sits in a reference
cycle, a replaced ``keep=`` module, a dropped traceback), when a process
group was torn down (``worker/tasks/process_group.py``: the old group's gloo threads and
sockets went only at some later collection otherwise), or when the frozen
set doubled since the last one (counted every ``CHECK_EVERY`` tasks).
``LAST`` holds what the last release cost.

So inside a task, a ``gc.collect()`` of the person's finds the cycles of
what was created since the engine was last frozen, not of what an earlier
cell made before modules were imported; those go when the task that let
them go ends (with ``empty_cache`` on CUDA after it).
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any, Callable, TypeVar

from nbddp.worker.memory import heap
from nbddp.worker.memory import allocator as memory
T = TypeVar("T")

LAST: dict[str, float] = {}  # seconds the last release took: collect_s, full_collect_s, trim_s, cuda_s
FULL_COLLECTIONS: dict[str, Any] = {"count": 0, "frozen_after": None, "tasks": 0, "modules_frozen": -1}
CHECK_EVERY = 64  # tasks between two counts of the frozen objects
_WATCH: dict[int, Any] = {}  # id of a kept value -> weakref to it, or None (it cannot be weakly referenced)
_LAST_ERROR = ("last_value", "last_exc", "last_traceback")


def _kept_values() -> list[Any]:
    """What the person keeps on this worker, as far as the collector may care: ``%%ddp`` names, datasets, the last error."""
    from nbddp.worker.engine.rank_state import STATE

    values = [v for k, v in STATE.namespace.items() if not k.startswith("__")]
    values += list(STATE.dataset_cache.values())
    values += [getattr(sys, name, None) for name in _LAST_ERROR]
    values.append(STATE.failure)  # a failure kept for %ddp debug: its frames hold a model, an old group
    return [v for v in values if v is not None and gc.is_tracked(v)]


def _may_be_in_a_cycle(value: Any) -> bool:
    """False when ``value`` refers to nothing the collector tracks (a list of numbers): refcounting frees it."""
    if isinstance(value, (list, tuple, dict, set)) and len(value) > 1000:
        return True
    return any(gc.is_tracked(r) for r in gc.get_referents(value))


def _watch(values: list[Any]) -> dict[int, Any]:
    watched: dict[int, Any] = {}
    for value in values:
        if not _may_be_in_a_cycle(value):
            continue
        try:
            watched[id(value)] = weakref.ref(value)
        except TypeError:  # lists, dicts, exceptions: whether they were freed cannot be told
            watched[id(value)] = None
    return watched


def _let_go_but_alive(now: list[Any]) -> bool:
    """Whether a value kept at the last look was let go since, and may still be alive in a frozen cycle."""
    kept = {id(v) for v in now}
    return any(key not in kept and (ref is None or ref() is not None) for key, ref in _WATCH.items())


def _forget_shown_tracebacks() -> None:
    """Drop the tracebacks the interpreter and the engine's shell keep of the last error they showed.

    The engine's IPython shell keeps the last traceback it printed (``InteractiveTB.tb``) and Python
    keeps ``sys.last_*``: with them every frame of a failed task, its model, optimizer and data, until
    the next failure replaced them.
    """
    for name in ("last_type", *_LAST_ERROR):
        if hasattr(sys, name):
            setattr(sys, name, None)
    from ipykernel.zmqshell import ZMQInteractiveShell  # the engine's shell

    if ZMQInteractiveShell.initialized() and hasattr(ZMQInteractiveShell.instance().InteractiveTB, "tb"):
        ZMQInteractiveShell.instance().InteractiveTB.tb = None


def _collect_everything() -> None:
    """Collect the frozen objects too: what a let-go value held may have been frozen with the engine's."""
    t0 = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    FULL_COLLECTIONS["count"] += 1
    FULL_COLLECTIONS["frozen_after"] = gc.get_freeze_count()
    LAST["full_collect_s"] = time.perf_counter() - t0


def _collect(everything: bool = False) -> None:
    """Collect the unfrozen objects; the frozen ones too when a kept value was let go but lives on (or ``everything``)."""
    t0 = time.perf_counter()
    gc.collect()
    LAST["collect_s"] = time.perf_counter() - t0
    LAST["full_collect_s"] = 0.0
    kept = _kept_values()
    if everything or _let_go_but_alive(kept):
        _collect_everything()
        kept = _kept_values()
    _WATCH.clear()
    _WATCH.update(_watch(kept))


def begin_task() -> None:
    """Before the person's code: collect what arrived since the last task; freeze what is alive if modules came.

    The engine's objects are frozen at its first task, and again after a task
    imported modules (their objects are long-lived too). Between those, what
    the person's tasks create stays unfrozen, so a cell's own
    ``gc.collect()`` still finds its cycles. Every ``CHECK_EVERY`` tasks the
    frozen set is counted (a walk of it: ~10 ms); when it doubled since the
    last full collection, one runs.
    """
    _collect()
    if len(sys.modules) != FULL_COLLECTIONS["modules_frozen"]:
        gc.freeze()
        FULL_COLLECTIONS["modules_frozen"] = len(sys.modules)
    FULL_COLLECTIONS["tasks"] += 1
    if FULL_COLLECTIONS["frozen_after"] is None:
        FULL_COLLECTIONS["frozen_after"] = gc.get_freeze_count()
    elif FULL_COLLECTIONS["tasks"] % CHECK_EVERY == 0 and gc.get_freeze_count() > 2 * FULL_COLLECTIONS["frozen_after"]:
        _collect_everything()


def give_back(everything: bool = False) -> None:
    """After a task (its frames gone): collect what it allocated, trim the C heap, empty CUDA's cache.

    ``everything``: collect the frozen objects too (after a process group was
    torn down: what referred to it may have been frozen with the engine).
    """
    _collect(everything)
    memory.for_steady_state()  # a fit that ended before its first step (or an FSDP fit) left the set-up setting
    t0 = time.perf_counter()
    heap.trim()
    LAST["trim_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    LAST["cuda_s"] = time.perf_counter() - t0


def drop_failed_frames(everything: bool = False) -> None:
    """Break failed tasks' cycles (exception -> traceback -> frames -> DDP -> process group); give memory back.

    ``everything``: collect the frozen objects too (see ``give_back``).
    """
    _forget_shown_tracebacks()
    give_back(everything)


def run_task(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)`` as a task of the person's: the engine frozen before it, memory given back after it.

    A call rather than a decorator: ipyparallel ships the functions the
    kernel applies as code run in their module's globals, so a wrapper's
    code would run where its own names are missing. Memory is given back
    even when ``fn`` raised; what its traceback holds goes when the
    traceback does.
    """
    begin_task()
    try:
        return fn(*args, **kwargs)
    finally:
        give_back()
