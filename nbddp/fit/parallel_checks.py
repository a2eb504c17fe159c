"""Before a model-parallel fit: one strategy and one mesh for the running workers, or an error that says why.

``resolve`` joins ``strategy=`` and ``mesh=`` against the world size;
``check_batch`` and ``check_model`` judge the batch size, the cut points of
a pipeline and the plan of tensor parallelism against the model (a factory
is built on the ``meta`` device for it). All of it runs in the kernel, before
anything is shipped; the workers apply the same rules (``partitioning/pipeline_stages.py``,
``partitioning/tensor_plan.py``) and so fail the same way for a model only they build.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nbddp.fit.arguments import ModelLike
from nbddp.protocol.mesh_layout import layout
from nbddp.protocol.parallel_settings import Pipeline, TensorParallel, is_model_parallel
from nbddp.protocol.strategy_settings import StrategySettings


def _mesh_for(strategy: Pipeline | TensorParallel, mesh: dict[str, int] | None, world: int) -> dict[str, int]:
    """The full mesh of a model-parallel strategy: the given one, or its default for ``world`` ranks."""
    dim = strategy.mp_dim
    assert dim is not None  # Pipeline and TensorParallel declare theirs
    if mesh is None:
        if isinstance(strategy, TensorParallel) or strategy.schedule == "interleaved":
            return {"dp": 1, dim: world}  # every rank holds a part of the one model
        mp = strategy.stages
        if world % mp:
            raise ValueError(f"nbddp.Pipeline(stages={strategy.stages}) needs a multiple of {mp} workers, but {world} "
                             f"are running; pass mesh={{'dp': ..., 'pp': ...}} or start a multiple of {mp} workers")
        return {"dp": world // mp, dim: mp}
    if dim not in mesh or mesh[dim] < 2:
        raise ValueError(f"strategy=nbddp.{type(strategy).__name__}(...) needs a '{dim}' dimension of 2 or more in "
                         f"mesh=..., got mesh={mesh}")
    full = {"dp": mesh.get("dp", world // mesh[dim] if world % mesh[dim] == 0 else 0), dim: mesh[dim]}
    if full["dp"] * full[dim] != world:
        raise ValueError(f"dist_fit(mesh={mesh}) spans {mesh.get('dp', 1) * mesh[dim]} ranks, but {world} workers "
                         f"are running: the product of the mesh's sizes must be the world size ({world})")
    return full


def resolve(strategy: str | StrategySettings, mesh: dict[str, int] | None,
            world: int) -> tuple[str | StrategySettings, dict[str, int] | None]:
    """``(strategy, mesh)`` for ``world`` ranks: a mesh with ``pp``/``tp`` turns ``"ddp"``/``"fsdp"`` into its dp."""
    if mesh is not None and not is_model_parallel(strategy):
        size = 1
        for value in mesh.values():
            size *= value
        if size != world:
            raise ValueError(f"dist_fit(mesh={mesh}) spans {size} ranks, but {world} workers are running: the "
                             f"product of the mesh's sizes must be the world size ({world})")
        if mesh.get("pp", 1) > 1:
            strategy = Pipeline(stages=mesh["pp"], microbatches=max(4, mesh["pp"]), dp=strategy)
        elif mesh.get("tp", 1) > 1:
            strategy = TensorParallel(dp=strategy)
        else:
            return strategy, None  # data parallel only: what strategy= says
    if not isinstance(strategy, (Pipeline, TensorParallel)):  # no other settings class may declare mp_dim
        return strategy, None
    full = _mesh_for(strategy, mesh, world)
    if isinstance(strategy, Pipeline):
        _check_pipeline(strategy, full["pp"])
    return strategy, full


def _check_pipeline(p: Pipeline, pp: int) -> None:
    if p.schedule == "interleaved":
        if p.stages % pp:
            raise ValueError(f"nbddp.Pipeline(schedule='interleaved', stages={p.stages}) on a pipeline of {pp} ranks: "
                             f"each rank holds stages/pp pieces, so stages must be a multiple of {pp}")
        rounds = max(1, p.microbatches // pp)
        if p.microbatches % rounds:
            raise ValueError(f"nbddp.Pipeline(schedule='interleaved', microbatches={p.microbatches}) on {pp} ranks: "
                             f"torch's interleaved 1F1B needs a multiple of {rounds} micro-batches (or fewer than {pp})")
    elif p.stages != pp:
        raise ValueError(f"nbddp.Pipeline(stages={p.stages}, schedule={p.schedule!r}) holds one stage per rank, but "
                         f"the mesh's 'pp' dimension is {pp}; use stages={pp}, or schedule='interleaved' for several "
                         "stages per rank")


def check_batch(strategy: str | StrategySettings, batch_size: int, step_fn: Callable[..., Any] | None = None,
                precision: str = "32-true") -> None:
    """A pipeline's batch must split into equal micro-batches, and its loss is the last stage's."""
    if is_model_parallel(strategy) and precision == "16-mixed":
        raise ValueError(f"dist_fit(precision='16-mixed') cannot train under nbddp.{type(strategy).__name__}: its "
                         "gradient scaler decides on each rank alone whether a step overflowed, and the ranks of a "
                         "pipeline or TP group hold different gradients, so they would not skip the same steps. "
                         "Use precision='bf16-mixed'")
    if not isinstance(strategy, Pipeline):
        return
    if batch_size % strategy.microbatches:
        lower = batch_size - batch_size % strategy.microbatches
        options = " or ".join(str(b) for b in (lower, lower + strategy.microbatches) if b > 0)
        raise ValueError(f"dist_fit(batch_size={batch_size}) does not split into microbatches={strategy.microbatches} "
                         f"equal micro-batches: the pipeline's stages exchange tensors of one shape. Use batch_size="
                         f"{options}, or other microbatches")
    if step_fn is not None:
        raise ValueError("dist_fit(step_fn=...) cannot run under nbddp.Pipeline: no rank holds the whole model. Give "
                         "(x, y) batches and loss_fn=...; the loss is computed on the last stage")


def check_model(model: ModelLike, strategy: str | StrategySettings, mesh: dict[str, int] | None) -> None:
    """Cut points and TP plans against the model; a factory is built on ``meta`` (no memory, no init)."""
    if not isinstance(strategy, (Pipeline, TensorParallel)):  # no other settings class may declare mp_dim
        return
    import torch

    if not isinstance(model, torch.nn.Module):
        with torch.device("meta"):
            model = model()
        if not isinstance(model, torch.nn.Module):
            return  # the workers say what the factory returned
    if isinstance(strategy, Pipeline):
        from nbddp.partitioning.pipeline_stages import plan_stages

        plan_stages(model, strategy.stages, strategy.split)
    elif mesh is not None:  # a TensorParallel's mesh, completed by resolve
        from nbddp.partitioning.tensor_plan import resolve_plan

        resolve_plan(model, strategy.plan, mesh["tp"])


def scaling_sizes(strategy: str | StrategySettings, mesh: dict[str, int] | None, world: int,
                  sizes: list[int]) -> list[int]:
    """World sizes a scaling report can measure: one rank (the model whole), then multiples of the group."""
    if not is_model_parallel(strategy):
        return sizes
    mp = layout(mesh, world).mp
    return [1, *[k for k in sizes if k >= mp and k % mp == 0]]


def batch_unit(strategy: str | StrategySettings, mesh: dict[str, int] | None, world: int) -> int:
    """The step between batch sizes a fit accepts: a pipeline's microbatches, else 1."""
    from nbddp.protocol.parallel_settings import resolve_strategy
    from nbddp.protocol.mesh_layout import check_mesh_shape

    resolved, _ = resolve(resolve_strategy(strategy), check_mesh_shape(mesh), world)
    return resolved.microbatches if isinstance(resolved, Pipeline) else 1
