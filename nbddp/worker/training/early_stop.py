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



def after_check(ts: Any, kind: str, record: dict[str, Any]) -> None:
    """Every rank, after a check's record: ``ts.stop_reason`` is set when some ``EarlyStopping`` ran out."""
    for patience in ts.stoppers:
        value = record.get(patience.spec.monitor)
        if kind != patience.spec.kind or not isinstance(value, (int, float)):
            continue
        reason = patience.after_check(float(value), int(record["step"]))
        if reason is not None and ts.stop_reason is None:
            ts.stop_reason = reason
