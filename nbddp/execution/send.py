"""Sending tasks to engines: the only kernel code that calls ipyparallel's ``apply_async`` or ``apply_sync``.

One ``AsyncResult`` per engine (``to_ranks``, ``to_engines``), never one
task over several engines: a task over several reports a dead engine only
when every engine has answered, and the fault contract needs each death at
once (``nbddp/execution/rank_tasks.py``). ``on_engines`` is the blocking
form for the few set-up calls whose failure the caller handles as one
(following the kernel's paths, leaving a group, the debugger's address).
``tests/test_house.py`` checks that no other kernel module sends a task.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Callable

from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import AsyncResult, Client

def to_engine(client: Client, engine_id: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> AsyncResult:
    """``fn(*args, **kwargs)`` on one engine: its ``AsyncResult``."""
    return client[engine_id].apply_async(fn, *args, **kwargs)


def to_engines(client: Client, engine_ids: Iterable[int], fn: Callable[..., Any], *args: Any,
               **kwargs: Any) -> dict[int, AsyncResult]:
    """The same call on each engine: engine id -> its ``AsyncResult``."""
    return {eid: client[eid].apply_async(fn, *args, **kwargs) for eid in engine_ids}


def to_ranks(client: Client, placements: Iterable[Placement], fn: Callable[..., Any],
             args_for: Callable[[Placement], tuple[Any, ...]],
             listen: Callable[[int, Any], None] | None = None) -> dict[int, AsyncResult]:
    """``fn(*args_for(p))`` on each placement's engine: rank -> its ``AsyncResult``.

    ``args_for`` is called once per rank, in rank order, right before that
    rank's task is sent (a parcel packed for the first local rank is reused
    by the next). ``listen(rank, message_future)`` is given each task's
    ipyparallel ``MessageFuture`` before the task leaves (``_futures_seen``):
    the moment to add an output callback (``nbddp/cells/rank_messages.py``)
    that misses nothing.
    """
    sent = {}
    for p in placements:
        args = args_for(p)
        with _futures_seen(client, None if listen is None else functools.partial(listen, p.rank)):
            sent[p.rank] = client[p.engine_id].apply_async(fn, *args)
    return sent


@contextlib.contextmanager
def _futures_seen(client: Client, seen: Callable[[Any], None] | None) -> Iterator[None]:
    """Hand ``seen`` the message future of each task this thread sends meanwhile, before it is sent.

    ipyparallel creates a task's futures in the sending thread, then leaves
    the sending to its IO thread, which may read the first replies before
    the sender gets the ``AsyncResult`` back: a callback added then has
    missed them (seen: a short cell's ``clear_output``). So the client's
    ``create_message_futures`` is wrapped, for this thread, while it sends.
    """
    if seen is None:
        yield
        return
    create, me = client.create_message_futures, threading.get_ident()

    def create_message_futures(*args: Any, **kwargs: Any) -> Any:
        futures = create(*args, **kwargs)
        if threading.get_ident() == me and futures:
            seen(futures[0])
        return futures

    client.create_message_futures = create_message_futures
    try:
        yield
    finally:
        del client.create_message_futures  # the class's method again


def on_engines(client: Client, engine_ids: list[int], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on all of ``engine_ids`` at once, waited for (ipyparallel's ``CompositeError`` if one raised)."""
    return client[engine_ids].apply_sync(fn, *args)


def silent_engines(client: Client, engine_ids: Iterable[int], timeout: float) -> list[int]:
    """The engines that do not answer a ping within ``timeout`` s (asked at once, one bound for all): dead or
    stuck ones, for the supervisor's heal and a lost Slurm job's cleanup."""
    from nbddp.worker.tasks.entry import ping

    asked: dict[int, AsyncResult] = {}
    silent: list[int] = []
    for eid in engine_ids:
        try:
            asked[eid] = client[eid].apply_async(ping)
        except Exception:  # noqa: BLE001 - unregistered meanwhile
            silent.append(eid)
    deadline = time.monotonic() + timeout
    for eid, ar in asked.items():
        try:
            ar.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - dead or stuck
            silent.append(eid)
    return silent


def once_per_other_host(client: Client, placements: Iterable[Placement], fn: Callable[..., Any], *args: Any,
                        timeout: float) -> list[str]:
    """``fn(*args)`` on one engine of every host but the kernel's, waited for ``timeout`` s in all: the hosts asked.

    Best effort, for a host's own files (a fit's snapshots, the session's
    compile cache): an engine that is gone or busy leaves that host's files
    as they are.
    """
    one_per_host: dict[str, int] = {}
    for p in placements:
        if not p.local:
            one_per_host.setdefault(p.host, p.engine_id)
    asked = []
    for host, engine in one_per_host.items():
        try:
            asked.append((host, client[engine].apply_async(fn, *args)))
        except Exception:  # noqa: BLE001 - a lost engine: nothing to do through it
            continue
    deadline = time.monotonic() + timeout
    for _, ar in asked:
        try:
            ar.get(timeout=max(0.1, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - best effort: that host keeps its files
            pass
    return [host for host, _ in asked]
