"""``predict``/``evaluate`` on one rank: the model in eval mode under ``torch.inference_mode()``, over its block.

A model the kernel shipped (or a factory, built with the same seed on every
rank) is a whole copy on each rank: each predicts its block alone, no
collective runs, so a rank that fails or is stopped never leaves a peer
waiting. A kept FSDP model (``dist_fit(strategy="fsdp", keep=...)``) holds a
shard per rank, and its forward all-gathers the parameters: every rank then
runs as many forwards (a rank with fewer batches repeats its last one,
discarded: ``lockstep_batches``) and the ranks agree before each batch
whether to stop.

Kernel > Interrupt arrives as SIGINT, which ``stop_on_sigint``
(``worker/tasks/predict.py``) turns into ``STATE.stop_requested``; the loop
looks at it before every batch and ends ``"interrupted"`` with no outputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from nbddp.protocol.data_forms import is_stream
from nbddp.protocol.messages import KeptModel, PredictLaunch
from nbddp.worker.data import loaders
from nbddp.worker.data.batches import batch_size_of, move
from nbddp.worker.data.datasets import materialise
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.inference.shards import block, block_loader
from nbddp.worker.strategies.precision import precision_tools
from nbddp.worker.training.validate import lockstep_batches

SEED = 0  # a model factory is built with this seed on every rank: the same weights everywhere


class PredictionFailed(RuntimeError):
    """The person's model or ``step_fn`` raised on a batch; the message names the samples of that batch."""


@dataclass
class RankModel:
    module: nn.Module
    sharded: bool  # its forward is collective (FSDP): every rank runs as many forwards
    was_training: bool = False  # a kept module goes back to its mode afterwards


def kept_kind(name: str) -> str:
    """What ``name`` holds on this rank, for the kernel's check: ``"module"`` (a whole model), ``"fsdp"`` (a kept
    FSDP model's shards), or what predict cannot run; ``""``: nothing.

    A module a fit kept (``keep=``) is known by the strategy that trained it:
    a pipeline keeps one stage per rank, which looks like any module.
    """
    if name not in STATE.namespace:
        return ""
    module = STATE.namespace[name]
    if not isinstance(module, nn.Module):
        return f"not a module ({type(module).__name__})"
    fitted = STATE.kept_by.get(name)
    if fitted is not None and fitted[0] == id(module):
        return {"ddp": "module", "fsdp": "fsdp"}.get(fitted[1], f"a {fitted[1]} model's part on each rank")
    if any(hasattr(p, "device_mesh") for p in module.parameters()):
        return "a sharded module (DTensor parameters)"
    return "module"


def build_model(spec: Any, device: torch.device) -> RankModel:
    """The kept module, the shipped one, or the factory's (seeded alike on every rank): on ``device``, in eval mode."""
    if isinstance(spec, KeptModel):
        module = STATE.namespace[spec.name]
        model = RankModel(module, kept_kind(spec.name) == "fsdp", module.training)
        module.eval()
        return model
    if not isinstance(spec, nn.Module):
        torch.manual_seed(SEED)
        spec = spec()
        if not isinstance(spec, nn.Module):
            raise TypeError(f"the model factory returned {type(spec).__name__}, not a torch.nn.Module; "
                            "pass model=MyNet (the class) or model=lambda: MyNet()")
    return RankModel(spec.to(device).eval(), False)


def release(model: RankModel) -> None:
    """A kept module back to its mode; a sharded one drops the parameters its root kept gathered."""
    model.module.train(model.was_training)
    if model.sharded:
        model.module.reshard()


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


def batches(data: RankData, sharded: bool, device: torch.device) -> Iterator[tuple[int, Any, bool]]:
    """``(dataset index of the batch's first sample, batch, counted)``, with a heartbeat per batch.

    ``sharded``: as many batches on every rank (``counted=False`` for the
    repeats), and the stop agreed before each.
    """
    at = data.first
    if data.n is None:  # a stream: no lockstep (refused for sharded models), samples counted as they come
        for batch in data.loader:
            BEAT.micro_batch()
            rows = batch_size_of(batch)
            yield at, batch, True
            at += rows * data.stride
            data.samples += rows
        return
    source = lockstep_batches(data.loader, data.n, STATE.placement.world_size) if sharded else \
        ((b, True) for b in data.loader)
    for batch, counted in source:
        BEAT.micro_batch()
        if sharded:
            flag = torch.tensor([float(STATE.stop_requested)], device=device)
            dist.all_reduce(flag)
            STATE.stop_requested = bool(flag.item() > 0)
        yield at, batch, counted
        if counted:
            at += batch_size_of(batch)


def run_batches(model: RankModel, data: RankData, launch: PredictLaunch, step_fn: Callable | None,
                device: torch.device, keep: Callable[[Any, int], None]) -> bool:
    """Every batch of the block through the model; ``keep(output, rows)`` for each counted one. False: stopped."""
    autocast, _ = precision_tools(launch.precision, device)
    with torch.inference_mode(), autocast():
        for at, batch, counted in batches(data, model.sharded, device):
            if STATE.stop_requested:
                return False
            rows = batch_size_of(batch)
            BEAT.mark("forward")
            try:
                out = forward(model.module, move(batch, device), step_fn)
            except Exception as exc:  # noqa: BLE001 - re-raised naming the samples
                raise PredictionFailed(f"{type(exc).__name__}: {exc} (rank {STATE.placement.rank}, on "
                                       f"{samples_text(at, rows, data.stride)} of the "
                                       f"{'stream' if data.n is None else 'dataset'})") from exc
            if counted:
                keep(out, rows)
    return not STATE.stop_requested


def rank_data(spec: Any, launch: PredictLaunch, device: torch.device, sharded: bool) -> RankData:
    """This rank's loader over its block, where the block starts, its size, and the dataset's."""
    ds = materialise(spec, {})
    p = STATE.placement
    if is_stream(ds):
        return stream_data(ds, spec, launch, p.rank, p.world_size, sharded)
    rows = block(len(ds), p.rank, p.world_size)
    loader = block_loader(ds, spec, launch.batch_size, p.rank, p.world_size, device)
    return RankData(loader, rows.start, len(rows), len(ds))


def stream_data(ds: Any, spec: Any, launch: PredictLaunch, rank: int, world: int, sharded: bool) -> RankData:
    """Every ``world``-th sample of the stream from sample ``rank`` (``streams.RankShard``), one loader process."""
    from nbddp.worker.data import streams

    if sharded:
        raise ValueError("a kept FSDP model predicts map-style data only: its ranks run their forwards together, "
                         "so each must know how many batches it has; a stream's length is known only at its end. "
                         "Pass a map-style Dataset, or the notebook's model (dist_fit brings the weights back)")
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
