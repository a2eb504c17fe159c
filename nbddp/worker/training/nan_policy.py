"""What a NaN (or inf) loss does: ``dist_fit(on_nan="raise" | "stop" | "skip")``.

``"raise"`` (the default) costs nothing per step: the reporter sees the
reduced loss at each sync, and every rank raises at that same step.

``"stop"`` and ``"skip"`` must act *before* the optimizer applies a NaN
update, or the weights are lost: each rank checks its own micro-batch
losses, and one small all-reduce per optimizer step tells every rank whether
any rank saw one, so all skip (or stop at) the same step. That is one
collective and one host sync per step, paid only when asked for.

* ``"skip"``: the step's update is dropped (gradients zeroed), training goes
  on; ``History`` notices say how many steps were skipped.
* ``"stop"``: training ends before the bad update, with the last good
  weights, ``status="completed"`` and ``History.stop_reason`` saying why.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from nbddp.worker.engine.heartbeat import BEAT


def loss_is_bad(ts: Any, loss: torch.Tensor) -> bool:
    """Whether this micro-batch's loss is NaN/inf (checked only under ``"stop"``/``"skip"``); remembered for the step."""
    if ts.cfg.on_nan == "raise":
        return False
    bad = not math.isfinite(float(loss.detach()))
    ts.nan_seen = ts.nan_seen or bad
    return bad


def agree_on_step(ts: Any) -> str:
    """``"ok"``, ``"skip"`` or ``"stop"`` for the optimizer step about to run, the same on every rank."""
    if ts.cfg.on_nan == "raise":
        return "ok"
    BEAT.mark("collective")
    flag = torch.tensor([1.0 if ts.nan_seen else 0.0], device=ts.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    ts.nan_seen = False
    if flag.item() == 0:
        return "ok"
    step = ts.step + 1
    if ts.cfg.on_nan == "skip":
        ts.nan_skipped += 1
        ts.nan_first = ts.nan_first or step
        return "skip"
    ts.stop_reason = (f"the loss was NaN or inf at step {step} (epoch {ts.epoch}) on some rank, and on_nan='stop': "
                      f"training stopped before that step's update, with the weights of step {ts.step}")
    return "stop"


def notices(ts: Any) -> list[str]:
    """What the person should hear about the fit's NaN steps, once it ends."""
    if not ts.nan_skipped:
        return []
    return [f"nbddp: {ts.nan_skipped} optimizer step(s) were skipped because the loss was NaN or inf on some rank "
            f"(on_nan='skip'; the first at step {ts.nan_first})"]
