"""The units of a model: what FSDP shards one by one, and what activation checkpointing recomputes.

A transformer is a stack of identical layers, and those layers are the
natural units for both: ``repeated_blocks`` finds every child of an
``nn.ModuleList``/``nn.Sequential`` whose children share one class (with at
least two of them), outermost first. Or the person names the classes.

A model without repeated blocks (``nn.Sequential(Linear, ReLU, Linear, ...)``,
or 96 ``nn.Linear`` in a row, which count as layers, not blocks):

* FSDP shards each layer that holds parameters of its outermost
  ``Sequential``/``ModuleList`` as a unit (``layer_units``). Sharding only the
  root would gather the whole model for the forward and keep it gathered
  until backward ends: measured on 96 x ``Linear(1024, 1024)`` with AdamW,
  2 CPU ranks, FSDP's peak was then 0.9x DDP's instead of under half.
* activation checkpointing cuts each outermost ``nn.Sequential`` into
  ``ceil(sqrt(n))`` runs of consecutive layers (``segments``), the classic
  choice (memory for about ``2 sqrt(n)`` layers' activations), as
  ``torch.utils.checkpoint.checkpoint_sequential`` does: every segment but
  the last is checkpointed (the last one's activations would be recomputed
  at once).

Activation checkpointing wraps a unit's (or a segment's) forward in
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: its
activations are dropped after the forward and recomputed in backward. The
instance's ``forward`` is replaced, so parameter names and state-dict keys
stay exactly as they were (no ``_checkpoint_wrapped_module.`` prefix), and it
composes with FSDP2's hooks (measured: weights equal to the run without it).
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def class_name(module: nn.Module) -> str:
    return type(module).__qualname__


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """Children of containers whose children all share one class (>= 2 of them), outermost first."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(module: nn.Module) -> None:
        children = list(module.children())
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(children) >= 2 \
                and len({type(c) for c in children}) == 1 and not isinstance(children[0], _LEAVES):
            for child in children:
                if id(child) not in seen:
                    seen.add(id(child))
                    found.append(child)
            return  # the blocks are the units: do not split them further
        for child in children:
            visit(child)

    visit(model)
    return found


# layers that are leaves, never units of their own (a Sequential of Linears is one block, not N units)
_LEAVES = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.LayerNorm, nn.ReLU, nn.GELU, nn.Dropout,
           nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.Identity, nn.Tanh, nn.Sigmoid, nn.SiLU)


def named_blocks(model: nn.Module, names: frozenset[str]) -> list[nn.Module]:
    """Every module whose class is one of ``names`` (outermost first; a match is not searched inside)."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if class_name(child) in names or type(child).__name__ in names:
                found.append(child)
            else:
                visit(child)

    visit(model)
    return found


def units(model: nn.Module, names: frozenset[str] | None) -> list[nn.Module]:
    """The units for ``names`` (or the repeated blocks); a name that matches nothing is an error."""
    if names is None:
        return repeated_blocks(model)
    blocks = named_blocks(model, names)
    matched = {class_name(b) for b in blocks} | {type(b).__name__ for b in blocks}
    missing = sorted(n for n in names if n not in matched)
    if missing:
        present = sorted({class_name(m) for m in model.modules()})
        raise ValueError(f"no module of the model is a {', '.join(missing)}; its module classes are: "
                         f"{', '.join(present)}. Name one of those, or leave it None for the repeated blocks")
    return blocks


def layer_units(model: nn.Module) -> list[nn.Module]:
    """The layers holding parameters of each outermost ``Sequential``/``ModuleList`` with at least two of them."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if isinstance(module, (nn.Sequential, nn.ModuleList)):
            layers = [c for c in module.children() if any(True for _ in c.parameters())]
            if len(layers) >= 2:
                found.extend(layers)
                return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def shard_units(model: nn.Module, names: frozenset[str] | None) -> list[nn.Module]:
    """What FSDP shards one by one: the named classes, else the repeated blocks, else the layers (``layer_units``)."""
    return units(model, names) or (layer_units(model) if names is None else [])


def segments(n: int) -> list[tuple[int, int]]:
    """``(start, stop)`` of each segment of ``n`` layers: ``ceil(sqrt(n))`` runs of consecutive layers, near-equal."""
    k = min(n, max(2, math.ceil(math.sqrt(n))))
    bounds = [round(i * n / k) for i in range(k + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def outer_sequentials(model: nn.Module) -> list[nn.Sequential]:
    """The outermost ``nn.Sequential`` modules with at least two layers."""
    if isinstance(model, nn.Sequential) and len(model) >= 2:
        return [model]
    return [s for child in model.children() for s in outer_sequentials(child)]


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _run_layers(layers: list[nn.Module], x: Any) -> Any:
    for layer in layers:
        x = layer(x)
    return x


def _segmented(sequential: nn.Sequential, spans: list[tuple[int, int]], x: Any) -> Any:
    layers = list(sequential)
    for i, (start, stop) in enumerate(spans):
        run = functools.partial(_run_layers, layers[start:stop])
        x = checkpoint(run, x, use_reentrant=False) if i < len(spans) - 1 else run(x)
    return x


def apply_activation_checkpointing(model: nn.Module, names: frozenset[str] | None) -> int:
    """Recompute activations in backward, per unit or per segment; return how many were checkpointed (0: none found)."""
    blocks = units(model, names)
    for block in blocks:
        _set_forward(block, functools.partial(_checkpointed, block.forward))
    if blocks or names is not None:
        return len(blocks)
    checkpointed = 0
    for sequential in outer_sequentials(model):
        spans = segments(len(sequential))
        _set_forward(sequential, functools.partial(_segmented, sequential, spans))
        checkpointed += len(spans) - 1
    return checkpointed


def _set_forward(module: nn.Module, forward: Callable[..., Any]) -> None:
    """An instance ``forward`` in front of the class's: ``nn.Module`` declares ``forward`` an attribute for this,
    though a subclass (``nn.Sequential``) defines it as a method. ``remove_activation_checkpointing`` deletes it."""
    module.forward = forward


def remove_activation_checkpointing(model: nn.Module) -> nn.Module:
    """Give every unit its class's own ``forward`` again (before the module travels back to the kernel)."""
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, functools.partial) and forward.func in (_checkpointed, _segmented):
            del module.forward
    return model
