"""Which ``nn.Linear`` layers tensor parallelism splits, and how: the plan, found or checked.

A pair of layers splits without any communication between them: the first
by its output features (``colwise``: each rank computes some of the hidden
units), the second by its input features (``rowwise``: each rank multiplies
its part, one all-reduce sums them). ``plan=None`` finds those pairs under
the names models use for them (Llama, Mistral, GPT-2-style MLPs, ...), and in
any ``nn.Sequential`` of Linear, activation, Linear. A split dimension must
be divisible by the TP size, which is checked here for every planned layer.

Read-only on the model: the kernel runs it on the person's model (or a meta
copy of a factory's) before shipping, and each rank again before it splits.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

COLWISE_NAMES = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "fc1")
ROWWISE_NAMES = ("o_proj", "down_proj", "fc2")
_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.Mish, nn.ELU, nn.Identity, nn.Dropout)


def _sequential_pairs(model: nn.Module) -> dict[str, str]:
    """Linear-activation-Linear runs inside every ``nn.Sequential``: the first colwise, the second rowwise."""
    found: dict[str, str] = {}
    for path, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        children = list(module.named_children())
        i = 0
        while i + 2 < len(children):
            (a, first), (_, act), (b, second) = children[i:i + 3]
            if isinstance(first, nn.Linear) and isinstance(act, _ACTIVATIONS) and isinstance(second, nn.Linear):
                prefix = f"{path}." if path else ""
                found[prefix + a], found[prefix + b] = "colwise", "rowwise"
                i += 3
            else:
                i += 1
    return found


def find_plan(model: nn.Module) -> dict[str, str]:
    """The usual pairs, by name and by shape (see the module docstring)."""
    plan = _sequential_pairs(model)
    for path, module in model.named_modules():
        if not isinstance(module, nn.Linear) or path in plan:
            continue
        leaf = path.rsplit(".", 1)[-1]
        if leaf in COLWISE_NAMES:
            plan[path] = "colwise"
        elif leaf in ROWWISE_NAMES:
            plan[path] = "rowwise"
    return plan


def _split_dim(style: Any) -> str | None:
    """``"out"`` for colwise, ``"in"`` for rowwise (a ParallelStyle's kind, by its class), None if unknown."""
    if style == "colwise":
        return "out"
    if style == "rowwise":
        return "in"
    kind = type(style).__name__
    return "out" if kind.startswith("Colwise") else "in" if kind.startswith("Rowwise") else None


def resolve_plan(model: nn.Module, plan: dict[str, Any] | None, tp: int) -> dict[str, Any]:
    """The plan to apply: ``plan`` checked against the model, or the one found; every split dimension divisible."""
    modules = dict(model.named_modules())
    if plan is None:
        plan = find_plan(model)
        if not plan:
            raise ValueError(f"nbddp.TensorParallel(plan=None) found no layers to split in {type(model).__name__}: no "
                             f"nn.Linear named {', '.join(COLWISE_NAMES + ROWWISE_NAMES)}, and no nn.Sequential of "
                             "Linear-activation-Linear. Pass plan={'path.to.linear': 'colwise', ...}")
    missing = [name for name in plan if name not in modules or name == ""]
    if missing:
        linears = [n for n, m in modules.items() if isinstance(m, nn.Linear)][:10]
        raise ValueError(f"nbddp.TensorParallel(plan=...) names {', '.join(map(repr, missing))}, which "
                         f"{type(model).__name__} does not have; its nn.Linear layers are: {', '.join(linears) or 'none'}")
    for name, style in plan.items():
        module, dim = modules[name], _split_dim(style)
        if not isinstance(module, (nn.Linear, nn.Embedding)) or dim is None:
            continue
        size = (module.out_features if dim == "out" else module.in_features) if isinstance(module, nn.Linear) \
            else module.embedding_dim
        what = "output" if dim == "out" else "input"
        if size % tp:
            raise ValueError(f"nbddp.TensorParallel: {name} ({module}) is split by its {what} features, {size}, "
                             f"which {tp} ranks do not divide; use a TP size that divides {size}, or leave {name} "
                             "out of the plan")
    return dict(plan)


def parallel_styles(plan: dict[str, Any]) -> dict[str, Any]:
    """The plan as torch ``ParallelStyle`` objects (strings become ``ColwiseParallel()`` / ``RowwiseParallel()``)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    made = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: made[style]() if isinstance(style, str) else style for name, style in plan.items()}
