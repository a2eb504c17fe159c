"""One validation pass on every rank, reduced once: exact means over the whole set.

Metric objects (torchmetrics ``Metric``s in ``metrics=``) are updated with
the counted batches and computed at the end, syncing their own state over
the ranks: exact for F1, AUROC and the like, which no mean of batch values is.

Each rank evaluates every ``world``-th sample (no padding, so no sample is
counted twice) and the sums are all-reduced at the end. Under a strategy
whose forward is collective (FSDP all-gathers parameters layer by layer),
every rank must run the same number of forwards: a rank with fewer batches
runs extra forwards on a batch it already has, counted with weight zero.
A validation stream's length is unknown, so there the ranks agree batch by
batch whether any rank still has one (``streams.val_batches``).
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from nbddp.protocol.data_forms import is_stream
from nbddp.worker.data import streams
from nbddp.worker.data.batches import move
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.training import early_stop
from nbddp.worker.inference.evaluation import batch_sum, is_metric_object, plain
from nbddp.worker.training.fit_state import TrainState


def lockstep_batches(loader: Any, n_samples: int, world: int) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` pairs, the same number on every rank.

    Every rank can work the count out alone: rank 0's strided shard is the
    largest, ``ceil(n / world)`` samples.
    """
    batch_size = loader.batch_size
    most = -(-(-(-n_samples // world)) // batch_size)
    last = None
    done = 0
    for batch in loader:
        last = batch
        done += 1
        yield batch, True
    if last is None:
        last = next(iter(_first_sample_loader(loader)))
    for _ in range(most - done):
        yield last, False


def _first_sample_loader(loader: Any) -> Any:
    """A loader over sample 0 alone, for a rank whose shard is empty."""
    from torch.utils.data import DataLoader

    return DataLoader(loader.dataset, batch_size=1, sampler=[0], collate_fn=loader.collate_fn)


def val_batches(ts: TrainState, loader: Any) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` pairs: this rank's shard, in lockstep with the others where the forward is collective."""
    if is_stream(loader.dataset):
        return streams.val_batches(ts, loader)
    if ts.strategy.lockstep_validation:  # ranks that share a model copy read the same batches
        return lockstep_batches(loader, len(loader.dataset), ts.strategy.data_shard(ts.rank, ts.world)[1])
    return ((b, True) for b in loader)


def metric_objects(ts: TrainState) -> dict[str, Any]:
    """The metrics that keep their own state (torchmetrics ``Metric``s), on this rank's device."""
    return {k: m.to(ts.device) if hasattr(m, "to") else m for k, m in ts.metrics.items() if is_metric_object(m)}


def accumulate(metrics: dict[str, Any], objects: dict[str, Any], sums: dict[str, float], output: Any, target: Any,
               n: int) -> None:
    """One counted batch: metric objects update their state; a function's values are summed (``batch_sum``)."""
    for name, fn in metrics.items():
        if name in objects:
            objects[name].update(output, target)
        else:
            sums[name] = sums.get(name, 0.0) + batch_sum(name, fn(output, target), n)


def computed(objects: dict[str, Any]) -> dict[str, Any]:
    """``val_<name>`` of each metric object over every rank (its ``compute()`` syncs: a collective), then reset.

    Exact over the whole set where a mean of batch values is not (F1, AUROC, precision).
    """
    out = {}
    for name, metric in objects.items():  # the same order on every rank
        out[f"val_{name}"] = plain(metric.compute())
        metric.reset()
    return out


def validate(ts: TrainState) -> dict[str, Any]:
    """One validation pass; every rank calls it at the same step. Records and returns ``val_*``."""
    rep, module = ts.reporter, ts.strategy.eval_module
    BEAT.mark("validation")
    rep.status = "validating"
    rep.publish(force=True)
    was_training = module.training
    module.eval()
    loss_sum, n_sum = 0.0, 0
    sums: dict[str, float] = {}
    objects = metric_objects(ts)
    loader = ts.vloader
    batches = val_batches(ts, loader)
    with torch.no_grad():
        for batch, counted in batches:
            BEAT.mark("validation")  # every batch: a long validation is progress, not a stall
            result = ts.strategy.eval_batch(ts, move(batch, ts.device))
            if result is None:
                continue  # this rank holds no loss (a pipeline stage before the last)
            loss, n, extras, output, target = result
            # one rank per model copy counts; every rank keeps the same keys: the reduction below is one flat vector
            if not counted or not ts.strategy.reports_metrics:
                for k in extras:
                    sums.setdefault(k, 0.0)
                continue
            loss_sum += float(loss) * n
            n_sum += n
            for k, v in extras.items():
                sums[k] = sums.get(k, 0.0) + float(v) * n
            accumulate(ts.metrics, objects, sums, output, target, n)
    names = sorted((set(ts.metrics) - set(objects)) | set(sums))
    reduced = rep.reduce_sums([loss_sum, float(n_sum), *[sums.get(k, 0.0) for k in names]])
    total = reduced[1]
    if not total:
        raise ValueError("val_data yielded no sample on any rank: a validation stream that is empty (or can be read "
                         "only once, and was read already) has nothing to validate on; pass val_data=None to skip")
    out = {"val_loss": reduced[0] / total if total else float("nan")}
    out.update({f"val_{k}": s / total if total else float("nan") for k, s in zip(names, reduced[2:])})
    out.update(computed(objects))
    record = {"epoch": ts.epoch, "step": ts.step, **out}
    rep.record("val", record)
    module.train(was_training)
    ts.strategy.end_evaluation()
    if ts.best is not None:  # after end_evaluation: a sharded module is back to its shards
        ts.best.consider(ts, "val", record)
    early_stop.after_check(ts, "val", record)
    rep.status = "training"
    ts.answers.exchange(ts, "val")  # the kernel's on_validation_end, when a callback has one
    return out
