"""``EarlyStopping`` decided on the workers, at exactly the check where its patience runs out.

The kernel's callback used to decide from the records streamed to it,
while the ranks trained on: on a fast fit its stop landed epochs late, and
where it landed depended on the machine's speed. Every rank already holds
the reduced value of each check (the same numbers, bit for bit), so each
applies the same rule (``BestSpec.improved``) and all stop after the same
check, whatever the speed: two runs of a seeded fit stop at the same epoch.
The stop is a normal end: ``status="completed"``, ``stop_reason`` set.
"""

from __future__ import annotations

from typing import Any

from nbddp.protocol.fit_options import BestSpec


class Patience:
    """One ``EarlyStopping``'s count of checks without improvement."""

    def __init__(self, spec: BestSpec):
        self.spec = spec
        self.best: float | None = None
        self.best_step: int | None = None
        self.wait = 0

    def after_check(self, kind: str, record: dict[str, Any]) -> str | None:
        """The stop reason when this check used up the patience, else None."""
        value = record.get(self.spec.monitor)
        if kind != self.spec.kind or not isinstance(value, (int, float)):
            return None
        if self.spec.improved(float(value), self.best):
            self.best, self.best_step, self.wait = float(value), int(record["step"]), 0
            return None
        self.wait += 1
        if self.wait < self.spec.patience:
            return None
        best = "none finite" if self.best is None else f"{self.best:.6g} at step {self.best_step}"
        return f"EarlyStopping: {self.spec.monitor} did not improve for {self.wait} checks (best {best})"


def after_check(ts: Any, kind: str, record: dict[str, Any]) -> None:
    """Every rank, after a check's record: ``ts.stop_reason`` is set when some ``EarlyStopping`` ran out."""
    for patience in ts.stoppers:
        reason = patience.after_check(kind, record)
        if reason is not None and ts.stop_reason is None:
            ts.stop_reason = reason
