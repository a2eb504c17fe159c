"""Precision on a rank: the autocast context and the gradient scaler, by precision name.

Names as Lightning spells them (``nbddp.protocol.fit_options.PRECISIONS``): ``"32-true"`` (no
autocast), ``"bf16-mixed"`` (bf16 autocast, fp32 weights; CPU and GPU),
``"16-mixed"`` (fp16 autocast with a gradient scaler; CUDA only).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch

from nbddp.protocol.fit_options import check_device_rules


def precision_tools(precision: str, device: torch.device) -> tuple[Callable[[], Any], Any]:
    """(autocast context factory, GradScaler or None) for ``precision`` on ``device``."""
    check_device_rules(precision, False, {device.type})
    if precision == "bf16-mixed":
        return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None
    if precision == "16-mixed":
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), torch.amp.GradScaler("cuda")
    return contextlib.nullcontext, None
