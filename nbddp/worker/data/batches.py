"""One batch -> (loss, sample count, extra values, output, target).

The rules, as ``docs/dist_fit.md`` states them for a person:

* ``step_fn(model, batch)`` returns the loss, or a dict with ``"loss"`` whose
  other entries are recorded too; it overrides everything else.
* a dict batch runs as ``model(**batch)``; the loss is the output itself, its
  ``.loss``, or its ``["loss"]``;
* a ``(x, y)`` batch runs as ``loss_fn(model(x), y)``; ``(x1, x2, ..., y)``
  as ``loss_fn(model(x1, x2, ...), y)``. Without ``loss_fn`` the loss is
  inferred: cross-entropy for integer targets, mean squared error for
  floating targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.nn.functional as F


class BatchError(TypeError):
    """A batch or a model output has a form the loop cannot train on."""


def move(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(v, device, non_blocking) for v in batch)
    return batch


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else 1
    if isinstance(batch, Mapping):
        for v in batch.values():
            if isinstance(v, torch.Tensor) and v.dim():
                return int(v.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    raise BatchError(f"cannot tell how many samples a batch of type {type(batch).__name__} holds")


def default_loss(output: Any, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy for class indices, MSE for real-valued targets."""
    if not isinstance(output, torch.Tensor):
        raise BatchError(
            f"the model returned {type(output).__name__}, not a tensor, and no loss_fn was given; "
            "pass loss_fn=... or a step_fn that returns the loss"
        )
    if target.dtype in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        return F.cross_entropy(output, target.long())
    return F.mse_loss(output, target.to(output.dtype).reshape(output.shape))


def refuse_binary_float_targets(batch: Any) -> None:
    """Float targets that hold only 0 and 1 are labels: MSE on them trains, but not what was meant.

    Checked on a fit's first batch when no ``loss_fn`` or ``step_fn`` was
    given (one look, not a host sync per step). Keras and Lightning make the
    person name the loss; here the default would have been MSE, silently.
    """
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        return
    target = batch[-1]
    if not isinstance(target, torch.Tensor) or not target.dtype.is_floating_point or target.numel() == 0:
        return
    if bool(((target == 0) | (target == 1)).all()):
        raise BatchError(
            f"the targets are float {tuple(target.shape)} and hold only 0 and 1: labels, not values to regress, so "
            "nbddp will not guess MSE for them. Name the loss: loss_fn=torch.nn.functional."
            "binary_cross_entropy_with_logits for binary labels (the model returns logits), or "
            "loss_fn=torch.nn.functional.mse_loss if MSE is what you mean"
        )


def loss_from_output(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, Mapping):
        loss = output.get("loss")
    if loss is None:
        raise BatchError(
            f"the batch is a dict, so the model's output must be the loss, have .loss or a 'loss' entry; "
            f"got {type(output).__name__} without one. Return the loss from forward() (e.g. when labels are given), "
            "or pass step_fn=lambda model, batch: ..."
        )
    return loss


def split(out: Any) -> tuple[torch.Tensor, dict[str, Any]]:
    """A step_fn result -> (loss, other entries)."""
    if isinstance(out, Mapping):
        if "loss" not in out:
            raise BatchError(f"step_fn returned a dict without 'loss' (keys: {sorted(out)}); add the loss under 'loss'")
        return out["loss"], {k: v for k, v in out.items() if k != "loss"}
    return out, {}


def run_batch(
    model: Callable[..., Any],
    batch: Any,
    loss_fn: Callable[..., Any] | None,
    step_fn: Callable[..., Any] | None,
) -> tuple[torch.Tensor, int, dict[str, Any], Any, Any]:
    """Forward one batch; return ``(loss, n, extras, output, target)``."""
    n = batch_size_of(batch)
    if step_fn is not None:
        loss, extras = split(step_fn(model, batch))
        return check_loss(loss), n, extras, None, None
    if isinstance(batch, Mapping):
        output = model(**batch)
        return check_loss(loss_from_output(output)), n, {}, output, batch.get("labels", batch.get("label"))
    if isinstance(batch, (list, tuple)) and len(batch) >= 2:
        *inputs, target = batch
        output = model(*inputs)
        loss = loss_fn(output, target) if loss_fn is not None else default_loss(output, target)
        return check_loss(loss), n, {}, output, target
    raise BatchError(
        f"a batch of type {type(batch).__name__} is neither (x, y), (x1, ..., y) nor a dict; "
        "pass step_fn=lambda model, batch: loss to train on it"
    )


def check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor):
        raise BatchError(f"the loss must be a tensor, got {type(loss).__name__} {loss!r}")
    if loss.numel() != 1:
        raise BatchError(
            f"the loss must be a scalar, got a tensor of shape {tuple(loss.shape)}; "
            "reduce it (loss.mean(), or reduction='mean' in the loss function)"
        )
    return loss.reshape(())
