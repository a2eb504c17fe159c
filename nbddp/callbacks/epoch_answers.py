"""The kernel's side of synchronous callbacks: collect what the hooks ask, answer every point the ranks wait at.

A fit is synchronous when one of its callbacks defines ``on_epoch_end`` or
``on_validation_end`` (``sync_kinds``): after each such record rank 0
waits for this side's answer (``protocol/epoch_answer.py``). While the
hooks of that record run, a stop (a hook returning ``"stop"``,
``nbddp.stop_fit()``, a hook that raised) and the handle's ``set_lr`` and
``save_checkpoint`` are collected here; then ``answer`` writes them, always,
whatever the hooks did, so the ranks never wait for an answer that never
comes.

The answer goes in rank 0's answer file on one host, or under a key of
the group's torch store when the ranks met at a TCPStore (``link``:
``fit/rank0_store.Rank0Link``).
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import asdict
from typing import Protocol

from nbddp.callbacks.base import Callback
from nbddp.protocol.epoch_answer import EpochAnswer, answer_path, remove_answer, write_answer
from nbddp.protocol.notices import notify
from nbddp.protocol.store_channel import KernelStore

#: the hook behind each record kind the ranks can wait after
HOOK_OF_KIND = {"epoch": "on_epoch_end", "val": "on_validation_end"}


class Rank0Reach(Protocol):
    """How one fit's kernel reaches rank 0: ``fit/rank0_store.Rank0Link`` (``fit/`` imports this package)."""

    reason: str  # why rank 0 cannot be reached ("" when it can)

    @property
    def remote(self) -> bool: ...  # through the group's store (else the file in /dev/shm)

    @property
    def reachable(self) -> bool: ...

    def store(self) -> KernelStore: ...

    def answer_key(self, seq: int) -> str: ...


def defines(cb: object, hook: str) -> bool:
    """Whether ``cb`` has its own ``hook`` (the empty one ``Callback`` inherits does not count: no wait for it)."""
    fn = getattr(type(cb), hook, None)
    if fn is None:
        return callable(getattr(cb, hook, None))
    return callable(fn) and fn is not getattr(Callback, hook, None)


def sync_kinds(callbacks: list[object]) -> tuple[str, ...]:
    """The record kinds the ranks wait after: ``"epoch"`` for an ``on_epoch_end``, ``"val"`` for an
    ``on_validation_end``; ``()`` (no wait at all) when no callback defines either."""
    return tuple(kind for kind, hook in HOOK_OF_KIND.items() if any(defines(cb, hook) for cb in callbacks))


class Answers:
    """What the synchronous hooks of one fit ask, and the answers written for rank 0."""

    def __init__(self, worker_prefix: str, kinds: tuple[str, ...], link: Rank0Reach | None = None):
        self.link = link if link is not None and link.remote else None  # rank 0's store, else the file
        self.path = "" if self.link is not None else answer_path(worker_prefix)
        self.last_key = ""  # the store key of the last answer (removed at close if rank 0 never took it)
        self.kinds = kinds
        self.lock = threading.Lock()
        self.stop_reason: str | None = None
        self.lr: float | None = None
        self.checkpoint: str | None = None
        self.due: set[int] = set()  # records the ranks wait on, handed to the hooks and not answered yet
        self.answered = 0
        self.launch = 0  # counts close(): a record handed to the hooks before an elastic relaunch is not answered
        remove_answer(self.path)  # a previous fit's answer is never read as this one's

    def waits_after(self, kind: str) -> bool:
        return kind in self.kinds

    def stop(self, reason: str) -> None:
        """A hook asked to stop: the fit ends at this point, a normal end (``status="completed"``)."""
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason

    def set_lr(self, lr: float) -> None:
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise TypeError(f"handle.set_lr(lr) takes a number, got {type(lr).__name__} {lr!r}; e.g. "
                            "handle.set_lr(1e-4)")
        if not math.isfinite(lr) or lr < 0:
            raise ValueError(f"handle.set_lr({lr!r}): the learning rate must be a finite number >= 0")
        with self.lock:
            self.lr = float(lr)

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise TypeError(f"handle.save_checkpoint(path) takes a folder path (str or os.PathLike), got "
                            f"{type(path).__name__} {path!r}")
        folder = os.path.abspath(os.fspath(path))
        if os.path.isfile(folder):
            raise ValueError(f"handle.save_checkpoint({os.fspath(path)!r}) is a file; pass a folder: the checkpoint "
                             "is written in it as step-<N>.pt (a sharded folder under FSDP), as checkpoint_dir's are")
        with self.lock:
            self.checkpoint = folder
        return folder

    def answer(self, seq: int, launch: int | None = None) -> None:
        """Write the answer to record ``seq`` (what was asked since the last answer), and forget it.

        ``launch``: the launch the record was handed to the hooks in; if the ranks were relaunched (or the fit
        ended) since, nobody waits for it, and the new ranks, who count their records from 0 again, must not
        take it for theirs: it is not written.
        """
        with self.lock:
            if launch is not None and launch != self.launch:
                return
            answer = EpochAnswer(seq=seq, stop=self.stop_reason, lr=self.lr, checkpoint=self.checkpoint)
            self.lr = self.checkpoint = None
            if self.link is None:
                write_answer(self.path, answer)
            else:
                self._send(self.link, answer)
            self.due.discard(seq)
            self.answered += 1

    def _send(self, link: Rank0Reach, answer: EpochAnswer) -> None:
        """Set the answer's key in rank 0's store (rank 0 waits on it, takes it and deletes it)."""
        key = link.answer_key(answer.seq)
        try:
            link.store().set(key, asdict(answer))
        except Exception as e:  # noqa: BLE001 - the store went with its group: no rank waits any more
            notify(f"nbddp: the answer to the callbacks' point {answer.seq} could not reach rank 0's store "
                   f"({type(e).__name__}: {e}); rank 0 trains on without it after its timeout")
            return
        self.last_key = key

    def close(self) -> None:
        with self.lock:
            self.launch += 1
            self.due.clear()
            if self.link is not None and self.last_key:
                try:
                    self.link.store().delete(self.last_key)
                except OSError:  # the group's store is gone, and its keys with it
                    pass
                self.last_key = ""
            remove_answer(self.path)
