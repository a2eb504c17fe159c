"""``nbddp.report`` and ``nbddp.should_stop``: called by the person's code on the ranks (the public names).

They act only inside a task nbddp runs (a ``%%ddp`` cell, ``nbddp.run``, a
script: ``worker/engine/report_channel.py`` holds the open channel). Anywhere
else, in a plain process or under ``torchrun``, ``report`` returns at once
and ``should_stop`` answers False, so the same script runs unchanged: one
list lookup, well under a microsecond (``benchmarks/bench_report.py``).
"""

from __future__ import annotations

from typing import Any

from nbddp.worker.engine.report_channel import OPEN


def report(step: int | None = None, *, reduce: str | None = "mean", **metrics: Any) -> None:
    """Report metrics of this rank at ``step``; the kernel reduces them over the ranks and shows them live.

    Args:
        step: this rank's step, an int that never goes back; None (the
            default) counts: the step after this rank's last report (1 first).
            Reporting a step again adds metrics to it.
        reduce: how each metric of this call is reduced over the ranks:
            ``"mean"`` (default), ``"sum"``, ``"max"``, ``"min"``, or None for
            rank 0's value. Each rank's own value is kept as well.
        **metrics: name=value: a Python number, or a 0-d or one-element
            tensor on any device (read off the training thread). ``samples=n``
            is summed over the ranks and gives samples/s.

    A refused call keeps nothing of itself; the rank's other reports go on as before.

    Raises:
        TypeError: a value that is not a number or tensor (a string...), or a bad ``step``.
        ValueError: a tensor of several elements, an unknown ``reduce``, a step that goes back.
    """
    if OPEN:
        OPEN[-1].report(step, reduce, metrics)


def should_stop(step: int | None = None) -> bool:
    """Whether the loop should end now: True on every rank at the same step once a stop was asked.

    The Stop button, Kernel > Interrupt or a kernel callback (``EarlyStopping``)
    ask; the kernel picks a step every rank has not reached yet and tells
    every rank, which answers True once its reported step (or ``step``)
    reaches it. False outside nbddp.
    """
    return OPEN[-1].should_stop(step) if OPEN else False
