"""``nbddp.predict`` and ``nbddp.evaluate``: the tasks the kernel sends, one per rank.

Each unpacks the shipped arguments, runs ``worker/inference`` over this
rank's block of the data, and returns a ``PredictResult``. On the kernel's
host, tensor outputs of map-style data go straight into the kernel's one
shared file at their rows (``worker/inference/outputs.py``). Other outputs
travel back as ``fit_task``'s weights do: a ``shipping.Parcel`` whose
tensors are in a ``/dev/shm`` file on the kernel's host (named with this
worker's prefix, so the session can remove it if the kernel never reads it),
inside the pickle across hosts.
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
    from nbddp.worker.inference.outputs import Outputs, ignored_keys, predictions

    t0 = time.perf_counter()
    with user_task(launch.generation, "call"), stop_on_sigint():
        device = torch.device(STATE.placement.device)
        parts = shipping.unpack(parcel)
        model = loop.build_model(parts["model"], device)
        outputs = Outputs(launch.output)
        try:
            data = loop.rank_data(parts["data"], launch, device, model)
            outputs.into_file(launch.out_file if STATE.placement.local else "", data.n, data.first)
            step_fn, ignore = parts["step_fn"], ignored_keys(model.module)  # the default step keeps HF's predictions
            t_loop = time.perf_counter()  # before: arguments unpacked, model built, data made; then the batches
            done = loop.run_batches(model, data, launch, step_fn, device, lambda out, batch, rows: outputs.add(
                out if step_fn is not None else predictions(out, ignore), rows))
        finally:
            outputs.close()
            loop.close_loaders()
            loop.release(model)
        holds = model.holds_outputs  # a pipeline's first stages, tp ranks > 0: nothing to send
        del model, parts
    result = PredictResult(STATE.placement.rank, "completed" if done else "interrupted", data.first,
                           data.samples if holds else 0, data.stride, data.n is None)
    result.timings["predict_s"] = time.perf_counter() - t0
    result.timings["setup_s"] = t_loop - t0
    if done and holds:
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
        result.timings["pack_s"] = time.perf_counter() - t1 + outputs.write_s  # the writes into the shared file too
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
    """This rank's block through the model and the metrics; one rank returns the exact values over every rank."""
    return run_task(_evaluate, parcel, launch)


def _evaluate(parcel: shipping.Parcel, launch: PredictLaunch) -> PredictResult:
    from nbddp.worker.inference import evaluation
    from nbddp.worker.inference import predict_loop as loop

    rank = STATE.placement.rank
    with user_task(launch.generation, "call"), stop_on_sigint():
        device = torch.device(STATE.placement.device)
        error: BaseException | None = None
        done, built = False, None  # built: the model, for the finally clause to release, once it is
        try:
            parts = shipping.unpack(parcel)
            model = built = loop.build_model(parts["model"], device)
            scores = evaluation.Scores(parts["metrics"], parts["loss_fn"], device, parts["target_fn"],
                                       evaluation.outputs_group(model.part))
            data = loop.rank_data(parts["data"], launch, device, model)
            done = loop.run_batches(model, data, launch, parts["step_fn"], device, scores.add_batch)
        except Exception as exc:  # noqa: BLE001 - told to the peers first, then raised
            error = exc
        finally:
            loop.close_loaders()
            if built is not None:
                loop.release(built)
        failed, stopped = evaluation.agree(error is not None, not done and error is None, device)
        if error is not None:  # else the try block ran to its end: model, scores and data are set
            raise error
        if failed:
            from nbddp.worker.data.batch_agreement import PeerFailed

            raise PeerFailed("another rank failed during nbddp.evaluate")
        values = None if stopped else scores.reduced(device, model.holds_outputs)
    result = PredictResult(rank, "interrupted" if stopped else "completed", data.first, data.samples, data.stride)
    # one rank sends the values: rank 0, or under model parallelism the first copy's rank that holds the outputs
    sends = rank == 0 if model.part is None else model.part.holds_outputs and model.part.dp_rank == 0
    if values is not None and sends:
        result.values = shipping.pack(values, what="the metric values", local=False)
    return result


def kept_kind(name: str, generation: int) -> dict[str, Any]:
    """What this rank holds under ``name`` (``keep=``): its kind, the fit's precision, ranks per model copy
    (``worker/inference/kept.py``)."""
    from nbddp.worker.engine.rank_state import check_generation
    from nbddp.worker.inference.kept import describe

    check_generation(generation)
    return describe(name, STATE.namespace, STATE.kept_by)


def kept_models(generation: int) -> list[dict[str, Any]]:
    """Every model ``dist_fit(keep=...)`` left bound on this rank: name, kind, precision, ranks per copy, and the
    parameters this rank holds (``nbddp.kept()``); a name since rebound to something else is not listed."""
    from nbddp.worker.engine.rank_state import check_generation
    from nbddp.worker.inference.kept import describe

    check_generation(generation)
    out = []
    for name in sorted(STATE.kept_by):
        held = describe(name, STATE.namespace, STATE.kept_by)
        fitted = STATE.kept_by[name]
        if held["kind"] == fitted.kind:  # still the module that fit bound
            module = STATE.namespace[name]
            out.append({"name": name, **held, "local_params": sum(p.numel() for p in module.parameters())})
    return out
