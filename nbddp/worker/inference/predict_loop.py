"""``predict``/``evaluate`` on one rank: the model in eval mode under ``torch.inference_mode()``, over its block.

A model the kernel shipped (or a factory, built with the same seed on every
rank) is a whole copy on each rank: each predicts its block alone, no
collective runs, so a rank that fails or is stopped never leaves a peer
waiting. A kept model whose forward is collective runs on every rank in
step (``lockstep.py``: as many forwards everywhere, the stop agreed before
each): a kept FSDP model (each rank holds a shard of every parameter, the
forward all-gathers them) predicts its own block per rank; a kept pipeline
or tensor-parallel model (``parallel_forward.py``) predicts one block per
model copy (its ``dp`` rank), and the rank that holds the copy's outputs
(the last stage, ``tp`` rank 0) keeps them.

Kernel > Interrupt arrives as SIGINT, which ``stop_on_sigint``
(``worker/tasks/predict.py``) turns into ``STATE.stop_requested``; the loop
looks at it before every batch and ends ``"interrupted"`` with no outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from nbddp.protocol.data_forms import is_stream
from nbddp.protocol.messages import KeptModel, PredictLaunch
from nbddp.worker.data import loaders
from nbddp.worker.data.batches import batch_size_of, move
from nbddp.worker.data.datasets import materialise
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.inference.kept import KeptParallel, part_of
from nbddp.worker.inference.lockstep import lockstep
from nbddp.worker.inference.parallel_forward import PipelineForward, Resharding, tensor_forward
from nbddp.worker.inference.pipeline_step import stepped
from nbddp.worker.inference.shards import block, block_loader
from nbddp.worker.strategies.precision import precision_tools

SEED = 0  # a model factory is built with this seed on every rank: the same weights everywhere


class PredictionFailed(RuntimeError):
    """The person's model or ``step_fn`` raised on a batch; the message names the samples of that batch."""


@dataclass
class RankModel:
    module: nn.Module
    collective: bool = False  # its forward needs every rank (FSDP, pipeline, tensor parallel): lockstep batches
    part: KeptParallel | None = None  # a kept pipeline's or tensor-parallel model's part on this rank
    modes: list[tuple[nn.Module, bool]] = field(default_factory=list)  # kept modules go back to these modes

    @property
    def shard(self) -> tuple[int, int]:
        """``(block, blocks)`` of the data this rank reads: every rank its own, or its model copy's."""
        if self.part is not None:
            return self.part.dp_rank, self.part.dp
        return STATE.placement.rank, STATE.placement.world_size

    @property
    def holds_outputs(self) -> bool:
        return self.part is None or self.part.holds_outputs

    def no_grad(self) -> Any:
        """``torch.inference_mode()``; ``torch.no_grad()`` for tensor parallelism.

        Under inference mode ``aten.linear`` reaches DTensor whole, and DTensor
        works out its sharding by tracing the op's decomposition: 7.2 s for a
        4-layer MLP's first forward on 2 CPU ranks, against 0.9 s under
        ``no_grad``, where autograd's dispatch splits it into ops with ready
        rules first (measured here).
        """
        return torch.no_grad() if self.part is not None and self.part.kind == "tensor" else torch.inference_mode()

    def forward(self, step_fn: Callable | None, batch_size: int, device: torch.device) -> Callable[[Any], Any]:
        """``batch -> outputs`` (None on a rank that holds no outputs: a pipeline's first stages, ``tp`` rank > 0)."""
        if self.part is not None and self.part.kind == "pipeline":
            run = PipelineForward(self.part, device, batch_size)
            return run if step_fn is None else stepped(run, step_fn)  # step_fn on the last stage's outputs
        if self.part is not None:
            return tensor_forward(self.part, lambda b: forward(self.module, b, step_fn))
        return lambda b: forward(self.module, b, step_fn)


def build_model(spec: Any, device: torch.device) -> RankModel:
    """The kept module, the shipped one, or the factory's (seeded alike on every rank): on ``device``, in eval mode."""
    if isinstance(spec, KeptModel):
        module = STATE.namespace[spec.name]
        fitted = STATE.kept_by.get(spec.name)
        fitted = fitted if fitted is not None and fitted.module_id == id(module) else None
        part = part_of(module) if fitted is not None else None
        modules = [module, *(part.stage_modules if part is not None else ())]
        model = RankModel(module, fitted is not None and fitted.kind != "module", part,
                          [(m, m.training) for m in modules])
        for m in modules:
            m.eval()
        return model
    if not isinstance(spec, nn.Module):
        torch.manual_seed(SEED)
        spec = spec()
        if not isinstance(spec, nn.Module):
            raise TypeError(f"the model factory returned {type(spec).__name__}, not a torch.nn.Module; "
                            "pass model=MyNet (the class) or model=lambda: MyNet()")
    return RankModel(spec.to(device).eval())


def release(model: RankModel) -> None:
    """Kept modules back to their modes; sharded ones drop the parameters their roots kept gathered."""
    for m, training in model.modes:
        m.train(training)
        if model.collective and isinstance(m, Resharding):
            m.reshard()


def forward(model: nn.Module, batch: Any, step_fn: Callable | None) -> Any:
    """``step_fn(model, batch)``, or the model on the batch's inputs: ``model(x)`` for ``(x,)`` and ``(x, y)``,
    ``model(x1, ..., xk)`` for ``(x1, ..., xk, y)``, ``model(**batch)`` for a dict, ``model(batch)`` for a tensor."""
    if step_fn is not None:
        return step_fn(model, batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)):
        inputs = batch if len(batch) == 1 else batch[:-1]
        return model(*inputs)
    return model(batch)


def samples_text(first: int, rows: int, stride: int = 1) -> str:
    if rows == 1:
        return f"sample {first}"
    if stride == 1:
        return f"samples {first}..{first + rows - 1}"
    return f"samples {first}, {first + stride}, ..., {first + (rows - 1) * stride}"


@dataclass
class RankData:
    loader: Any
    first: int  # dataset index of this rank's first sample
    samples: int  # samples in this rank's block (a stream's: counted as they come)
    n: int | None  # samples in the dataset (None: a stream)
    stride: int = 1  # a stream's samples of this rank are first, first + stride, ...

    def dummy(self) -> Any:
        """A batch for a rank whose block is empty, to run in step with the others: the dataset's first sample."""
        from torch.utils.data import DataLoader

        return next(iter(DataLoader(self.loader.dataset, batch_size=1, sampler=[0], collate_fn=self.loader.collate_fn)))


def batches(data: RankData, model: RankModel) -> Iterator[tuple[int, Any, bool]]:
    """``(dataset or stream index of the batch's first sample, batch, counted)``, with a heartbeat per batch.

    A collective forward: as many batches on every rank (``counted=False``
    for the dummies), and the stop agreed before each (``lockstep.py``).
    """
    if model.collective:
        source = lockstep(data.loader, data.dummy if data.n is not None else None, "nbddp.predict")
    else:
        source = ((b, True) for b in data.loader)
    at = data.first
    for batch, counted in source:
        BEAT.micro_batch()
        yield at, batch, counted
        if counted:
            rows = batch_size_of(batch)
            at += rows * data.stride
            if data.n is None:  # a stream's samples are counted as they come
                data.samples += rows


def run_batches(model: RankModel, data: RankData, launch: PredictLaunch, step_fn: Callable | None,
                device: torch.device, keep: Callable[[Any, Any, int], None]) -> bool:
    """Every batch of the block through the model; ``keep(output, batch, rows)`` for each counted one, on a rank
    that holds the outputs. False: stopped."""
    autocast, _ = precision_tools(launch.precision, device)
    with model.no_grad(), autocast():
        run = model.forward(step_fn, launch.batch_size, device)
        for at, batch, counted in batches(data, model):
            if STATE.stop_requested:
                return False
            rows = batch_size_of(batch)
            BEAT.mark("forward")
            batch = move(batch, device)
            try:
                out = run(batch)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the samples
                raise PredictionFailed(f"{type(exc).__name__}: {exc} (rank {STATE.placement.rank}, on "
                                       f"{samples_text(at, rows, data.stride)} of the "
                                       f"{'stream' if data.n is None else 'dataset'})") from exc
            if counted and model.holds_outputs:
                keep(out, batch, rows)
    return not STATE.stop_requested


def rank_data(spec: Any, launch: PredictLaunch, device: torch.device, model: RankModel) -> RankData:
    """This rank's loader over its block (its model copy's), where the block starts, its size, and the dataset's."""
    ds = materialise(spec, {})
    shard, shards = model.shard
    if is_stream(ds):
        return stream_data(ds, spec, launch, shard, shards)
    rows = block(len(ds), shard, shards)
    loader = block_loader(ds, spec, launch.batch_size, shard, shards, device)
    return RankData(loader, rows.start, len(rows), len(ds))


def stream_data(ds: Any, spec: Any, launch: PredictLaunch, rank: int, world: int) -> RankData:
    """Every ``world``-th sample of the stream from sample ``rank`` (``streams.RankShard``), one loader process."""
    from nbddp.worker.data import streams

    shard, how = streams.split(ds, rank, world)
    if how != "strided":
        raise TypeError(f"nbddp.predict reads a stream by taking every {world}th sample on each rank, so that each "
                        "output's place in the stream is known; this stream splits itself ('shards_itself', or a "
                        "Hugging Face IterableDataset), which hides that place. Pass a map-style dataset, or a plain "
                        "IterableDataset")
    loader = loaders.loader(shard, batch_size=launch.batch_size, collate_fn=spec.collate_fn, num_workers=0)
    return RankData(loader, rank, 0, None, world)


def close_loaders() -> None:
    loaders.close_all()
