"""The kernel's answer to a synchronous callback point: what every rank does before it trains on.

A fit whose callbacks define ``on_epoch_end`` (or ``on_validation_end``)
is synchronous at those points: after the epoch's record (or a validation
check's), rank 0 publishes it and waits for the kernel's answer before any
rank trains on. The engine runs its fit in its main thread and takes no
other task meanwhile, so the answer travels, as ``handle.profile``'s
request does, in a small owner-only file next to the session's other files
(``<prefix>-w0-epoch-answer``), replaced atomically. Rank 0 reads it and
broadcasts it, so every rank applies the same answer at the same step.

An answer is ``{"seq": n, "stop": reason or None, "lr": float or None,
"checkpoint": folder or None}``; ``seq`` is the record it answers (its
index in rank 0's records), so an answer is never taken for another point.

The kernel that runs the callbacks may die while the ranks wait (a detached
session outlives it, ``docs/sessions.md``). Rank 0 then hears from nobody:
``wait_answer`` also asks ``gone`` every ``GONE_CHECK_S``, and the answer
it makes up (``kernel_gone``) tells every rank to skip the later points at
once instead of waiting ``TIMEOUT_S`` at each.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from nbddp.protocol.notes import read_note, shm_dir, write_note

#: a kernel that has not answered in this long is gone or stuck: the workers go on without its answer, with a
#: notice (the kernel's side answers every point, also when a hook raises; slow hooks get this much time)
TIMEOUT_S = 600.0
FIRST_POLL_S = 0.0005  # rank 0's first look again after a miss; doubled up to MAX_POLL_S
MAX_POLL_S = 0.005
GONE_CHECK_S = 0.25  # how often rank 0, waiting, asks whether the kernel that answers is still alive


@dataclass(frozen=True)
class EpochAnswer:
    """What the kernel's callbacks asked at one synchronous point (every field ``None``: train on)."""

    seq: int
    stop: str | None = None  # the fit ends here; History.stop_reason says this
    lr: float | None = None  # every parameter group's learning rate, from the next optimizer step on
    checkpoint: str | None = None  # a folder: every rank writes the fit's checkpoint there before training on
    kernel_gone: bool = False  # no kernel will answer (it died): every rank skips the later points without waiting


def answer_path(worker_prefix: str) -> str:
    """The answer file of the worker whose files are named ``worker_prefix`` (rank 0's)."""
    return os.path.join(shm_dir(), f"{worker_prefix}-epoch-answer")


def write_answer(path: str, answer: EpochAnswer) -> None:
    """The kernel's side: replace the answer file atomically, owner-only."""
    write_note(path, asdict(answer))


def read_answer(path: str, seq: int) -> EpochAnswer | None:
    """The answer to record ``seq`` if the file holds it now (None: not yet)."""
    data = read_note(path)
    if not isinstance(data, dict) or data.get("seq") != seq:
        return None
    return EpochAnswer(seq, stop=data.get("stop"), lr=data.get("lr"), checkpoint=data.get("checkpoint"))


def wait_answer(path: str, seq: int, timeout_s: float = TIMEOUT_S,
                gone: Callable[[], bool] | None = None) -> EpochAnswer | None:
    """Rank 0: poll for the answer to ``seq`` (a short backoff: it lands within ms of the kernel writing it).

    ``gone``: whether the kernel that answers has died (asked every ``GONE_CHECK_S``, the first time at once);
    then the answer is ``EpochAnswer(seq, kernel_gone=True)``. Returns None after ``timeout_s`` without an answer.
    """
    now = time.monotonic()
    deadline, next_check = now + timeout_s, now
    pause = FIRST_POLL_S
    while True:
        answer = read_answer(path, seq)
        if answer is not None:
            return answer
        now = time.monotonic()
        if gone is not None and now >= next_check:
            if gone():
                return EpochAnswer(seq, kernel_gone=True)
            next_check = now + GONE_CHECK_S
        if now >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, MAX_POLL_S)


def remove_answer(path: str) -> None:
    if path:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
