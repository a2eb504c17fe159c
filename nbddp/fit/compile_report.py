"""Recompiles explained: every rank's compiles gathered into ``History.compile_report``, one warning under the cell.

A recompile costs a compile (seconds to minutes), and after
``torch._dynamo.config.recompile_limit`` of them a function runs eagerly.
The usual cause in a fit is a batch of another size (the last one of an
epoch, or of a validation pass); Dynamo names it ("size mismatch at index
0"), and the fix is ``drop_last=True`` or ``compile={"dynamic": True}``.
Recompiles for validation (grad mode off, inputs without gradients) are
expected, kept in the report, and not warned about.
"""

from __future__ import annotations

import warnings
from typing import Any

from nbddp.protocol.notices import NbddpWarning

EXPECTED = ("GLOBAL_STATE changed: grad_mode", "requires_grad mismatch", "training mismatch")


class RecompileWarning(NbddpWarning):
    """A compiled fit recompiled for a reason the person can remove (an ``NbddpWarning``, as every notice)."""


def gather(results: dict[int, Any]) -> list[dict[str, Any]]:
    """One row per rank that compiled: ``rank``, ``compiles``, ``recompiles``, ``reasons``, ``graph_breaks``, ..."""
    return [{"rank": r, **results[r].compile} for r in sorted(results) if getattr(results[r], "compile", None)]


def advice(reason: str) -> str:
    """What to do about one recompile reason."""
    if "size mismatch" in reason:
        return "a batch of another size, such as the last; try drop_last=True or compile={'dynamic': True}"
    return "see torch.compile's troubleshooting guide, 'recompilations'"


def explain(report: list[dict[str, Any]]) -> str | None:
    """The warning for the first rank with an avoidable recompile, or ``None``."""
    for row in report:
        avoidable = [r for r in row["reasons"] if not any(e in r for e in EXPECTED)]
        if avoidable:
            times = "once" if len(avoidable) == 1 else f"{len(avoidable)} times"
            return (f"rank {row['rank']} recompiled {times}: `{avoidable[0]}` ({advice(avoidable[0])}); "
                    "History.compile_report has every rank's reasons")
    return None


def warn_once(report: list[dict[str, Any]]) -> None:
    """Show ``explain``'s warning under the cell, once per fit."""
    text = explain(report)
    if text is not None:
        warnings.warn(text, RecompileWarning, stacklevel=2)
