"""``nbddp.report``'s records as both sides read them: the values a rank may report, the reductions, the batch.

A rank checks each value at the call (``metric_value``, ``check_reduce``,
``check_step``), so a bad report is refused where it was made, with the
metric's name, before anything of it is kept: the rank's earlier records and
its later reports are untouched. The kernel reduces each step over the
ranks that reported it (``reduce_values``). Both import this module, so
the rules and the message (``ReportBatch``) are one.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass
from typing import Any, NamedTuple

from nbddp.protocol.notes import shm_dir

REDUCES = ("mean", "sum", "max", "min", None)  # None: rank 0's value (the others are kept per rank)
SAMPLES = "samples"  # report(samples=n): summed over the ranks, and samples/s derived from it


class ReportRecord(NamedTuple):
    """What one rank reported at one step (several ``report`` calls at one step are one record).

    A tuple, and sent as a plain one (``tuple(record)``): a batch of plain
    tuples pickles about 6x faster than one of dataclasses (10 against 60 us
    for 70 records), and both the rank's publisher and the kernel's IO thread
    take that time from training on a machine whose cores the ranks fill.
    Never changed once made (a later report at the same step makes a new one),
    so the publisher thread reads it without a lock.
    """

    step: int
    time: float  # time.time() on the rank at the step's last report
    values: dict[str, Any]  # name -> float (or a device tensor until the rank's publisher reads it)
    # how its values are reduced over the ranks: one of REDUCES for all of them (what one report() call makes),
    # or name -> one of REDUCES (several calls at one step that asked differently); see reduce_of
    reduce: str | None | dict[str, str | None] = "mean"


def reduce_of(record: tuple[Any, ...]) -> dict[str, str | None]:
    """``record``'s reduction of each of its values, as a dict (a record holds one for all of them or a dict)."""
    how = record[3]
    return dict(how) if isinstance(how, dict) else dict.fromkeys(record[2], how)


def how_reduced(record: ReportRecord, name: str) -> str | None:
    """How ``record``'s value ``name`` is reduced over the ranks."""
    how = record.reduce
    return how.get(name, "mean") if isinstance(how, dict) else how


@dataclass
class ReportBatch:
    """A rank's records since its last batch: ``seq`` records so far; ``window`` the new and changed ones.

    The kernel listens to every batch as it arrives (``nbddp/reports/inbox.py``),
    so a batch carries only what the last did not (a record that a later
    report at its step changed, again); the ``final`` one carries them all.
    Each is ``(seq, (step, time, values, reduce))``, a plain tuple.
    ``checks_stop``: the rank's code asked ``should_stop()`` (so a stop can
    be agreed through the reports instead of an interrupt); ``stopped_at``:
    the step at which ``should_stop()`` first answered True; ``position``:
    the furthest step ``should_stop(step)`` was told.
    """

    rank: int
    seq: int
    window: list[tuple[int, tuple[Any, ...]]]
    final: bool = False
    checks_stop: bool = False
    stopped_at: int | None = None
    position: int = 0  # the furthest step the rank told should_stop(step) (a framework's step between its logs)


def is_tensor(value: object) -> bool:
    """A torch tensor, told without importing torch (the shared layer imports nothing heavy)."""
    return type(value).__module__ == "torch" and hasattr(value, "numel")


def metric_value(name: str, value: object) -> Any:
    """``value`` as a reported number: a float, or a one-element tensor on the device (read later, off the step).

    Raises:
        TypeError: a string, or anything that is not a number or a tensor.
        ValueError: a tensor of more than one element.
    """
    if is_tensor(value):
        n = value.numel()  # type: ignore[attr-defined]
        if n != 1:
            shape = tuple(value.shape)  # type: ignore[attr-defined]
            raise ValueError(f"nbddp.report({name}=...): a tensor of shape {shape} ({n} elements); a metric is one "
                             f"number. Reduce it first, e.g. report({name}=t.mean()), or report each element by name")
        if value.is_cpu:  # type: ignore[attr-defined]  # (a sixth of .device.type's cost: this runs every step)
            return float(value.item())  # type: ignore[attr-defined]
        return value.detach().reshape(()).clone()  # type: ignore[attr-defined]
    if isinstance(value, numbers.Real):  # numpy scalars too; True/False count as 1/0
        return float(value)
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    raise TypeError(f"nbddp.report({name}=...): got {type(value).__name__} {shown}; a metric is a number: a Python "
                    "int or float, or a 0-d or one-element tensor on any device. Log text elsewhere (print shows "
                    "it labelled by rank)")


def check_reduce(reduce: object, names: list[str]) -> str | None:
    """``reduce`` if it is one of ``REDUCES``; else a ValueError naming the metrics it was given for."""
    if reduce in REDUCES and (reduce is None or isinstance(reduce, str)):
        return reduce
    raise ValueError(f"nbddp.report(reduce={reduce!r}) for {', '.join(names) or 'no metric'}: the reduction over "
                     "the ranks is 'mean' (the default), 'sum', 'max', 'min' or None (rank 0's value); each rank's "
                     "own value is kept as well (History.rank_steps)")


def check_step(step: object, last: int | None, names: list[str]) -> int:
    """``step`` as an int that does not go back before ``last`` (this rank's previous step)."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or int(step) < 0:
        raise TypeError(f"nbddp.report(step={step!r}) for {', '.join(names)}: a step is an int >= 0 (or None: "
                        "the step after this rank's last report)")
    if last is not None and int(step) < last:
        raise ValueError(f"nbddp.report(step={step}) for {', '.join(names)}: this rank reported step {last} "
                         "already, and steps only go forward. Report the same step again to add metrics to it, or "
                         "leave step=None to count the reports")
    return int(step)


def reduce_values(values: list[float], how: str | None) -> float:
    """Values of one metric at one step, one per rank in rank order, reduced as ``how`` says."""
    if how is None:
        return values[0]
    if how == "sum":
        return float(sum(values))
    if how == "max":
        return max(values)
    if how == "min":
        return min(values)
    return float(sum(values) / len(values))


def stop_note(rank_prefix: str) -> str:
    """The note where the kernel tells a rank the step to stop after (``{"stop_at": step}``), on its host.

    ``rank_prefix``: the rank's file prefix, ``<session prefix>-w<rank>`` (the worker's ``STATE.file_prefix``).
    """
    return os.path.join(shm_dir(), f"{rank_prefix}-report-stop")
