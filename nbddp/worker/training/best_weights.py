"""The best check's weights, kept on the workers for ``EarlyStopping(restore_best=True)``.

The kernel's ``EarlyStopping`` decides when to stop, from the records it
receives; by the time its stop lands (the next sync) the ranks have trained
on. So the weights of the best check are kept here, where they are, and
put back when training ends, before rank 0 sends the weights to the
notebook: the kernel never holds a copy. What is kept is the strategy's to
say (``Strategy.snapshot_weights``): rank 0's CPU copy when replicated,
each rank's own shards under FSDP. The rule for "best" is the kernel's
(``nbddp.protocol.fit_options.BestSpec``), applied to the same reduced values, so
both sides agree on the step.
"""

from __future__ import annotations

from typing import Any

from nbddp.protocol.fit_options import BestSpec


class BestWeights:
    def __init__(self, spec: BestSpec):
        self.spec = spec
        self.value: float | None = None
        self.step: int | None = None
        self.saved: Any = None

    def consider(self, ts: Any, kind: str, record: dict[str, Any]) -> None:
        """After a check (every rank, same values): keep the weights when it is the best so far."""
        value = record.get(self.spec.monitor)
        if kind != self.spec.kind or not isinstance(value, (int, float)) or not self.spec.improved(value, self.value):
            return
        self.value, self.step = float(value), int(record["step"])
        self.saved = None  # the previous copy goes before the new one is made
        self.saved = ts.strategy.snapshot_weights(ts.rank)

    def restore(self, ts: Any) -> dict[str, Any] | None:
        """Put the best check's weights back on every rank (collective); what was restored, or None."""
        if self.step is None:
            return None
        ts.strategy.restore_weights(self.saved, ts.rank)
        self.saved = None
        return {"step": self.step, "value": self.value}
