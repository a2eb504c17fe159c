"""Cutting a model into pipeline stages: where the cuts go, the stage modules, and what each stage exchanges.

* An ``nn.Sequential`` is cut between its children and sliced
  (``seq[a:b]`` keeps the children's names, so every stage's state-dict keys
  are the model's own).
* Any other model is cut at its repeated blocks (``blocks.repeated_blocks``:
  the layers of a transformer) or at the modules ``split=`` names, and traced
  into stages by ``torch.distributed.pipelining.pipeline`` (torch.export),
  which also keeps the parameters' names.
* ``split=None`` balances the stages by parameter count: the contiguous cut
  that makes the largest stage smallest.

``plan_stages`` only reads the model, so the kernel runs it too (on a meta
copy of a factory's model) and a bad split fails before anything is shipped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from nbddp.partitioning.blocks import repeated_blocks


def _own_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters(recurse=False))


def _ordered(model: nn.Module) -> list[tuple[str, int]]:
    """Every module's path and own parameter count, in registration order (the order a forward usually runs)."""
    return [(name, _own_params(m)) for name, m in model.named_modules()]


def cut_candidates(model: nn.Module) -> list[str]:
    """Where a stage may begin: an ``nn.Sequential``'s children, else each repeated block."""
    if isinstance(model, nn.Sequential):
        return [name for name, _ in model.named_children()]
    names = {id(m): name for name, m in model.named_modules()}
    return [names[id(b)] for b in repeated_blocks(model)]


def _stage_sizes(model: nn.Module, cuts: list[str]) -> list[int]:
    """Parameters per stage when each name in ``cuts`` begins a stage (by registration order)."""
    order = _ordered(model)
    index = {name: i for i, (name, _) in enumerate(order)}
    bounds = [0, *[index[c] for c in cuts], len(order)]
    return [sum(n for _, n in order[a:b]) for a, b in zip(bounds, bounds[1:])]


def balanced_cuts(sizes: list[int], stages: int) -> list[int]:
    """Indices (into ``sizes``) where stages 2.. begin, so that the largest stage is as small as it can be."""
    n = len(sizes)
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[k][i]: first i units in k stages
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                if prefix[i] == prefix[j] or (j > 0 and sizes[j] == 0):
                    continue  # no stage without parameters, none that begins with one (an activation stays put)
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], back[k][i] = cost, j
    if best[stages][n] == inf:
        raise ValueError(f"cannot cut {n} pieces with {sum(1 for s in sizes if s)} holding parameters into {stages} "
                         "stages that each hold parameters")
    cuts, i = [], n
    for k in range(stages, 1, -1):
        i = back[k][i]
        cuts.append(i)
    return sorted(cuts)


def plan_stages(model: nn.Module, stages: int, split: tuple[str, ...] | None) -> list[str]:
    """The names of the modules that begin stages 2..``stages``; every stage must hold parameters."""
    if split is None:
        candidates = cut_candidates(model)
        if len(candidates) < stages:
            what = "children" if isinstance(model, nn.Sequential) else "repeated blocks (layers of an nn.ModuleList " \
                                                                       "or nn.Sequential that share one class)"
            raise ValueError(f"nbddp.Pipeline(stages={stages}) cannot cut {type(model).__name__}: it has "
                             f"{len(candidates)} {what}, and each stage needs at least one. Use fewer stages, or name "
                             "the cut points with split=[...]")
        order = _ordered(model)
        index = {name: i for i, (name, _) in enumerate(order)}
        starts = [0, *[index[c] for c in candidates[1:]], len(order)]
        weights = [sum(n for _, n in order[a:b]) for a, b in zip(starts, starts[1:])]
        try:
            cuts = [candidates[i] for i in balanced_cuts(weights, stages)]
        except ValueError as exc:
            raise ValueError(f"nbddp.Pipeline(stages={stages}) {exc} in {type(model).__name__}; use fewer stages or "
                             "name the cut points with split=[...]") from None
    else:
        cuts = list(split)
        known = dict(model.named_modules())
        missing = [c for c in cuts if c not in known or c == ""]
        if missing:
            sample = ", ".join(cut_candidates(model)[:8]) or ", ".join(n for n in list(known)[1:9])
            raise ValueError(f"nbddp.Pipeline(split={list(split)}): {type(model).__name__} has no module "
                             f"{', '.join(map(repr, missing))}; name modules where a stage begins, such as {sample}")
        registered = [name for name, _ in model.named_modules()]
        if [registered.index(c) for c in cuts] != sorted(registered.index(c) for c in cuts):
            raise ValueError(f"nbddp.Pipeline(split={list(split)}): the cut points must be in the model's order "
                             "(the order its modules are registered and run)")
    sizes = _stage_sizes(model, cuts)
    if 0 in sizes:
        raise ValueError(f"nbddp.Pipeline(split={cuts}) leaves stage {sizes.index(0)} of {type(model).__name__} "
                         f"empty (no parameters; parameters per stage: {sizes}); move the cut points")
    return cuts


def stage_modules(model: nn.Module, cuts: list[str], example: tuple[Any, ...]) -> list[nn.Module]:
    """Every stage's module, in order (this rank keeps its own and drops the rest)."""
    if isinstance(model, nn.Sequential):
        names = [name for name, _ in model.named_children()]
        bounds = [0, *[names.index(c) for c in cuts], len(names)]
        return [model[a:b] for a, b in zip(bounds, bounds[1:])]
    from torch.distributed.pipelining import SplitPoint, pipeline

    try:
        pipe = pipeline(model, mb_args=example, split_spec={c: SplitPoint.BEGINNING for c in cuts})
    except Exception as exc:  # noqa: BLE001 - torch.export's reasons are many; say what to do
        raise RuntimeError(f"nbddp.Pipeline could not trace {type(model).__name__} into stages with "
                           f"torch.distributed.pipelining.pipeline (torch.export): {type(exc).__name__}: "
                           f"{str(exc).splitlines()[0] if str(exc) else ''}. Write the model as an nn.Sequential of "
                           "its pieces, or remove data-dependent control flow from forward()") from exc
    if pipe.num_stages != len(cuts) + 1:
        raise RuntimeError(f"tracing {type(model).__name__} gave {pipe.num_stages} stages, not {len(cuts) + 1}: a "
                           f"cut point in {cuts} is not on the path forward() runs")
    return [pipe.get_stage_module(i) for i in range(pipe.num_stages)]


def stage_shapes(modules: list[nn.Module], example: tuple[Any, ...], autocast: Any,
                 device: torch.device) -> list[tuple[Any, Any]]:
    """``(inputs, outputs)`` of every stage for one micro-batch on ``device``, as meta tensors: nothing runs.

    The stages run on fake tensors (shapes and dtypes only) standing in for
    their parameters and buffers on ``device``, in training mode and under the
    fit's autocast: no weight moves, and no buffer changes (a real forward
    would count as a BatchNorm step).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.func import functional_call

    shapes = []
    modes = [m.training for m in modules]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            h: Any = tuple(mode.from_tensor(t).to(device) for t in example)
            for m in modules:
                fake = {name: _fake(mode, t, device) for name, t in [*m.named_parameters(), *m.named_buffers()]}
                m.train()
                with autocast():
                    out = functional_call(m, fake, h)
                outs = out if isinstance(out, tuple) else (out,)
                shapes.append((_meta(h), _meta(outs)))
                h = tuple(outs)
    finally:
        for m, training in zip(modules, modes):
            m.train(training)
    return shapes


def _fake(mode: Any, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    fake = mode.from_tensor(t).to(device)
    return nn.Parameter(fake, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fake


def _meta(tensors: tuple[Any, ...]) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(t.requires_grad) for t in tensors)


def holder(stages: list[nn.Module]) -> nn.Module:
    """One module holding this rank's stages under their own names (what its state dict and optimizer see)."""
    if len(stages) == 1:
        return stages[0]
    root = nn.Module()
    for stage in stages:
        for path, module in stage.named_modules():
            direct = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
            if not direct:
                continue
            if not path:
                for name, t in direct:
                    (root.register_parameter if isinstance(t, nn.Parameter) else root.register_buffer)(name, t)
                continue
            *parents, leaf = path.split(".")
            at = root
            for p in parents:
                if not hasattr(at, p):
                    at.add_module(p, nn.Module())
                at = getattr(at, p)
            at.add_module(leaf, module)
    return root
