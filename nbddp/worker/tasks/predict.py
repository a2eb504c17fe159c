"""``nbddp.predict`` and ``nbddp.evaluate``: the tasks the kernel sends, one per rank.

Each unpacks the shipped arguments, runs ``worker/inference`` over this
rank's block of the data, and returns a ``PredictResult``. Outputs travel
back as ``fit_task``'s weights do: a ``shipping.Parcel`` whose tensors are in
a ``/dev/shm`` file on the kernel's host (named with this worker's prefix,
so the session can remove it if the kernel never reads it), inside the
pickle across hosts.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from nbddp.protocol.messages import PredictLaunch, PredictResult
from nbddp.shipping import pickling as shipping
from nbddp.worker.engine.rank_state import STATE, stop_on_sigint
from nbddp.worker.memory.release import run_task
from nbddp.worker.tasks.user_task import user_task


def predict_task(parcel: shipping.Parcel, launch: PredictLaunch) -> PredictResult:
    """This rank's block through the model; its outputs packed for the kernel; then the memory goes back."""
    return run_task(_predict, parcel, launch)


def _predict(parcel: shipping.Parcel, launch: PredictLaunch) -> PredictResult:
    from nbddp.worker.inference import predict_loop as loop
    from nbddp.worker.inference.outputs import Outputs

    t0 = time.perf_counter()
    with user_task(launch.generation, "call"), stop_on_sigint():
        device = torch.device(STATE.placement.device)
        parts = shipping.unpack(parcel)
        model = loop.build_model(parts["model"], device)
        outputs = Outputs(launch.output)
        try:
            data = loop.rank_data(parts["data"], launch, device, model.sharded)
            done = loop.run_batches(model, data, launch, parts["step_fn"], device, outputs.add)
        finally:
            loop.close_loaders()
            loop.release(model)
        del model, parts
    result = PredictResult(STATE.placement.rank, "completed" if done else "interrupted", data.first, data.samples,
                           data.stride, data.n is None)
    result.timings["predict_s"] = time.perf_counter() - t0
    if done:
        t1 = time.perf_counter()
        if launch.to:
            result.path = _write_part(launch.to, {**outputs.packed(), "first": result.first,
                                                  "samples": result.samples, "stride": result.stride,
                                                  "stream": result.stream})
        else:
            # a file of its own, as the fit's weights: this rank unmaps it once written and the kernel removes it
            # once read, so no copy of the outputs stays with the worker after the call
            result.outputs = shipping.pack(outputs.packed(), what="the predictions", local=STATE.placement.local,
                                           prefix=f"{STATE.file_prefix}-o" if STATE.file_prefix else None)
        result.timings["pack_s"] = time.perf_counter() - t1
    return result


def part_path(to: str, rank: int) -> str:
    """Where rank ``rank`` writes its part: ``DIR/part-00001.pt``, or ``x.part-00001.pt`` next to ``to="x.pt"``."""
    import os

    if to.endswith(".pt"):
        return f"{to[:-3]}.part-{rank:05d}.pt"
    return os.path.join(to, f"part-{rank:05d}.pt")


def _write_part(to: str, part: dict[str, Any]) -> str:
    """``torch.save`` this rank's part, owner-only (0600), atomically (a temporary name, then renamed)."""
    import os

    path = part_path(to, STATE.placement.rank)
    os.makedirs(os.path.dirname(path) or ".", mode=0o700, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(part, f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def evaluate_task(parcel: shipping.Parcel, launch: PredictLaunch) -> PredictResult:
    """This rank's block through the model and the metrics; rank 0 returns the exact values over every rank."""
    return run_task(_evaluate, parcel, launch)


def _evaluate(parcel: shipping.Parcel, launch: PredictLaunch) -> PredictResult:
    from nbddp.worker.inference import evaluation
    from nbddp.worker.inference import predict_loop as loop

    rank = STATE.placement.rank
    with user_task(launch.generation, "call"), stop_on_sigint():
        device = torch.device(STATE.placement.device)
        error: BaseException | None = None
        done, model, data = False, None, None
        try:
            parts = shipping.unpack(parcel)
            model = loop.build_model(parts["model"], device)
            scores = evaluation.Scores(parts["metrics"], parts["loss_fn"], device)
            data = loop.rank_data(parts["data"], launch, device, model.sharded)
            done = loop.run_batches(model, data, launch, _scoring(scores), device, _ignore)
        except Exception as exc:  # noqa: BLE001 - told to the peers first, then raised
            error = exc
        finally:
            loop.close_loaders()
            if model is not None:
                loop.release(model)
        failed, stopped = evaluation.agree(error is not None, not done and error is None, device)
        if error is not None:
            raise error
        if failed:
            from nbddp.worker.data.batch_agreement import PeerFailed

            raise PeerFailed("another rank failed during nbddp.evaluate")
        values = None if stopped else scores.reduced(device)
    result = PredictResult(rank, "interrupted" if stopped else "completed", data.first, data.samples, data.stride)
    if values is not None and rank == 0:
        result.values = shipping.pack(values, what="the metric values", local=False)
    return result


def _scoring(scores: Any) -> Any:
    """A ``step_fn`` that feeds the metrics and keeps nothing: outputs never leave the rank."""
    from nbddp.worker.data.batches import batch_size_of
    from nbddp.worker.inference.evaluation import split_batch

    def step(model: Any, batch: Any) -> None:
        inputs, targets = split_batch(batch)
        outputs = model(*inputs)
        scores.add(outputs, targets, batch_size_of(targets))

    return step


def _ignore(out: Any, rows: int) -> None:
    """``evaluate`` keeps no outputs."""


def kept_kind(name: str, generation: int) -> str:
    """What this rank holds under ``name`` (``keep=``): ``"module"``, ``"fsdp"``, or why it cannot predict; ``""``: nothing."""
    from nbddp.worker.engine.rank_state import check_generation
    from nbddp.worker.inference.predict_loop import kept_kind as kind_of

    check_generation(generation)
    return kind_of(name)
