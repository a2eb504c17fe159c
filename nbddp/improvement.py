"""Which check is the best one: a single rule, read by the kernel and by the workers.

``EarlyStopping`` decides in the kernel when to stop; with ``restore_best``
the workers keep the weights of the best check. Both must agree on which
check that was, so both apply this rule to the same reduced values (rank 0's
records are the kernel's records, bit for bit). ``BestSpec`` is plain data:
the only part of a callback that travels to the workers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MODES = ("min", "max")


@dataclass(frozen=True)
class BestSpec:
    """What is monitored, and which way is better."""

    monitor: str = "val_loss"
    mode: str = "min"
    min_delta: float = 0.0

    @property
    def kind(self) -> str:
        """The records the value is read from: every validation pass for ``val_*``, else every epoch's record."""
        return "val" if self.monitor.startswith("val_") else "epoch"

    def improved(self, value: float, best: float | None) -> bool:
        """Whether ``value`` beats ``best`` by more than ``min_delta`` (the first finite value always does)."""
        if not math.isfinite(value):
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta
