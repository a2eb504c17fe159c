"""A rank's outputs, batch by batch, made into one part to send back (``shipping/batched_outputs.py``'s rules)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nbddp.shipping.batched_outputs import join


def to_cpu(out: Any) -> Any:
    """``out`` with every tensor detached and on the CPU (tuples, lists and dicts walked)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, Mapping):
        return {k: to_cpu(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(to_cpu(v) for v in out)
    return out


class Outputs:
    """The batches of one rank, in order."""

    def __init__(self, output: str):
        self.output = output  # "tensor": join where possible; "list": keep the batches as they are
        self.batches: list[Any] = []
        self.rows: list[int] = []

    def add(self, out: Any, rows: int) -> None:
        self.batches.append(to_cpu(out))
        self.rows.append(rows)

    def packed(self) -> dict[str, Any]:
        """What travels to the kernel: ``{"kind", "value", "rows"}``."""
        if not self.batches:
            return {"kind": "empty", "value": None, "rows": []}
        kind, value = join(self.batches) if self.output == "tensor" else ("list", list(self.batches))
        return {"kind": kind, "value": value, "rows": list(self.rows)}
