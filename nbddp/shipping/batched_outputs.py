"""Outputs made of batches, joined into one value: on a rank over its batches, in the kernel over the ranks.

Both sides use the same rules, so a value a rank could join is joined the
same way across ranks:

* tensors with a first (sample) dimension and the same other dimensions and
  dtype: one tensor, ``torch.cat`` (``kind="tensor"``);
* dicts of such tensors, with the same keys: a dict of concatenated tensors
  (``kind="dict"``);
* anything else: the list of the batches' outputs (``kind="list"``).

A rank's part is ``{"kind", "value", "rows"}``: ``rows`` holds each batch's
sample count, so a joined part can be cut back into its batches when
another rank's part could not be joined.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def joinable(tensors: list[Any]) -> bool:
    """Whether ``torch.cat`` joins these along the sample dimension: tensors, dim >= 1, same other dims and dtype."""
    import torch

    if not tensors or not all(isinstance(t, torch.Tensor) and t.dim() >= 1 for t in tensors):
        return False
    head = tensors[0]
    return all(t.shape[1:] == head.shape[1:] and t.dtype == head.dtype for t in tensors)


def join(values: list[Any]) -> tuple[str, Any]:
    """``(kind, value)`` of a list of outputs, as the module docstring says (``"empty"`` for none)."""
    import torch

    if not values:
        return "empty", None
    if joinable(values):
        return "tensor", torch.cat(values)
    if all(isinstance(v, Mapping) for v in values):
        keys = list(values[0])
        if keys and all(list(v) == keys for v in values) and all(joinable([v[k] for v in values]) for k in keys):
            return "dict", {k: torch.cat([v[k] for v in values]) for k in keys}
    return "list", list(values)


def batches_of(part: Mapping[str, Any]) -> list[Any]:
    """A rank's part cut back into its batches' outputs."""
    import torch

    kind, value, rows = part["kind"], part["value"], list(part["rows"])
    if kind == "empty":
        return []
    if kind == "tensor":
        return list(torch.split(value, rows))
    if kind == "dict":
        pieces = {k: torch.split(v, rows) for k, v in value.items()}
        return [{k: pieces[k][i] for k in pieces} for i in range(len(rows))]
    return list(value)


def assemble(parts: Sequence[Mapping[str, Any]], output: str) -> Any:
    """The ranks' parts, in rank order, as one value: joined (``output="tensor"``) or a list of batch outputs."""
    parts = [p for p in parts if p["kind"] != "empty"]
    if output == "tensor" and parts and all(p["kind"] in ("tensor", "dict") for p in parts):
        kind, value = join([p["value"] for p in parts])
        if kind != "list":
            return value
    return [b for p in parts for b in batches_of(p)]


def in_stream_order(parts: Sequence[Mapping[str, Any]], ids: list[Any], output: str) -> tuple[Any, Any]:
    """``(outputs, ids)`` of a stream's parts, in the order the samples came (by id).

    ``ids[r]``: the stream positions of rank ``r``'s samples, in the order it
    predicted them. Joined outputs are reordered sample by sample (``ids``: one
    tensor); a list of batches is ordered by each batch's first sample
    (``ids``: one tensor per batch).
    """
    import torch

    value = assemble(parts, output)
    every = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64)
    order = torch.argsort(every)
    if isinstance(value, torch.Tensor):
        return value[order], every[order]
    if isinstance(value, dict):
        return {k: v[order] for k, v in value.items()}, every[order]
    per_batch = [b for p, i in zip(parts, ids) if p["kind"] != "empty" for b in torch.split(i, list(p["rows"]))]
    ranked = sorted(range(len(value)), key=lambda k: int(per_batch[k][0]))
    return [value[k] for k in ranked], [per_batch[k] for k in ranked]
