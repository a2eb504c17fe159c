"""The ranks' outputs put together in the kernel: the shared file mapped whole, or the parts joined in order.

When every rank that holds outputs wrote them into the call's shared file
(``shipping/output_file.py``), the file already is the result, in the
dataset's order: it is mapped, and the tensors view it (no copy; the mapping
lives as long as they do, and the file's name is removed at once). When only
some did (the others' outputs did not fit the file's layout, or came from
another host), their rows are cut out of the file and joined with the
others' parts, as before.
"""

from __future__ import annotations

from typing import Any

from nbddp.protocol.messages import PredictResult
from nbddp.shipping import output_file
from nbddp.shipping.batched_outputs import assemble, in_stream_order


def put_together(parts: list[dict[str, Any]], holders: list[PredictResult], out_file: str, output: str) -> Any:
    """The call's value from the holders' parts (in rank order) and the shared file, if any rank used it."""
    kinds = {p["kind"] for p in parts}
    layout = output_file.claimed(out_file) if "file" in kinds else None
    if layout is not None and kinds <= {"file", "empty"} and \
            sum(r.samples for p, r in zip(parts, holders) if p["kind"] == "file") == layout.n:
        return output_file.load(out_file, layout)
    if layout is not None:
        views = output_file.regions(output_file.map_file(out_file, layout.nbytes), layout)
        parts = [rows_of(views, r, p["rows"]) if p["kind"] == "file" else p for p, r in zip(parts, holders)]
    if any(r.stream for r in holders):  # a stream: (outputs, ids) in the order samples came
        value = in_stream_order(parts, [stream_ids(r) for r in holders], output)
    else:
        value = assemble(parts, output)
    return owned(value)


def rows_of(views: dict[str | None, Any], result: PredictResult, rows: list[int]) -> dict[str, Any]:
    """One rank's rows of the file as the part it would have packed (``{"kind", "value", "rows"}``)."""
    block = {k: v[result.first:result.first + result.samples] for k, v in views.items()}
    if list(block) == [None]:
        return {"kind": "tensor", "value": block[None], "rows": rows}
    return {"kind": "dict", "value": block, "rows": rows}


def owned(value: object) -> object:
    """``value`` with no tensor left viewing a worker's file: batches are cloned (joined tensors are copies already).

    The workers rewrite their output files at the next call (pooled), so a
    view into one would change under the person's feet.
    """
    if isinstance(value, tuple) and value and isinstance(value[0], list):  # a stream's (batches, ids)
        return cloned(value[0]), value[1]
    return cloned(value) if isinstance(value, list) else value


def cloned(value: object) -> object:
    import torch

    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: cloned(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(cloned(v) for v in value)
    return value


def stream_ids(result: PredictResult) -> Any:
    """The stream positions of one rank's samples: ``first``, ``first + stride``, ... (``streams.RankShard``)."""
    import torch

    return result.first + result.stride * torch.arange(result.samples, dtype=torch.int64)
