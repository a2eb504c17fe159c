"""Elastic fits (issue 33): what snapshots cost, how long a recovery takes, how many steps are lost.

One run measures three things on the MLP workload, 2 ranks:

* **snapshot cost**: the same fit without snapshots (``max_restarts=0``) and
  with them, alternating: at the default interval (``snapshot_every="auto"``,
  30 s or more) and at a dense one (every ``DENSE`` steps) that gives the
  cost of one snapshot; reported as ``timings['snapshot_s'] / train_s``, the
  paired throughput ratio, and the share one snapshot would take of the
  default interval;
  The dense mode runs twice, alternating: as built (the step copies the
  state into host buffers, a thread writes it) and with the write on the
  training thread (``NBDDP_SNAPSHOT_INLINE=1`` on the workers, how snapshots
  were written before): ``one_snapshot_s`` against ``one_snapshot_inline_s``
  is the step's wait, same run; ``one_write_s`` is the write the thread took
  off the step; ``one_copy_s`` the step's own part, the copy into host
  buffers, which is all it waits when the previous write has ended (at the
  default interval it always has; every ``DENSE`` steps of a few ms it may
  not, and ``one_snapshot_s`` includes waiting for it);
* **recovery time**: a fit whose rank 1 SIGKILLs itself at step ``KILL_AT``
  (writing the time first), split into *noticing* (the kill to the kernel
  seeing the failure), *replacing* (the supervisor's heal: the survivors
  answering a ping, the warm spare engine taken, engines started afresh,
  if any, and the group formed again, from ``Supervisor.last_heal``) and
  *restoring* (the relaunch, set-up and the snapshot loaded, to the moment
  it is ready to train). The recovery fit starts once the session's spare
  engine is warm, as it is for any fit that has trained longer than the
  spare's warm-up (``spare_warm_s``; a rank lost before that waits for the
  rest of it);
* **steps lost**: ``step_lost_at - step_resumed_from``, at most the interval.
"""

from __future__ import annotations

import os
import signal
import sys as _sys
import shutil
import tempfile
import time
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import cloudpickle  # noqa: E402

from benchmarks import common  # noqa: E402

cloudpickle.register_pickle_by_value(_sys.modules[__name__])  # the step_fn travels to the engines by value

NAME = "elastic"
DENSE = 5  # steps between snapshots in the dense mode
KILL_AT = 35  # rank 1's step that it does not finish (3/4 of the fit when it is shorter)


class KillOnce:
    """``step_fn``: cross-entropy; rank 1 writes the time to ``marker`` and SIGKILLs itself at call ``at``, once."""

    def __init__(self, marker: str = "", at: int = 0):
        self.marker, self.at, self.calls = marker, at, 0

    def __call__(self, model: Any, batch: Any) -> Any:
        import torch.distributed as dist
        import torch.nn.functional as F

        x, y = batch
        loss = F.cross_entropy(model(x), y)
        self.calls += 1
        if self.marker and self.calls == self.at and dist.get_rank() == 1 and os.path.exists(self.marker):
            with open(self.marker, "w") as f:
                f.write(f"{time.time()!r} {self.calls}")
            os.rename(self.marker, self.marker + ".fired")
            os.kill(os.getpid(), signal.SIGKILL)
        return loss


def _fit(model_seed: int, data: Any, cfg: dict[str, Any], **extra: Any) -> Any:
    import nbddp
    import torch

    model = common.make_model("mlp", seed=model_seed)
    return nbddp.dist_fit(model, data, epochs=cfg["epochs"], batch_size=cfg["batch_size"], optimizer=torch.optim.SGD,
                          lr=cfg["lr"], live=False, log_every=cfg.get("log_every", 20), **extra)


def _set_inline(on: bool) -> None:
    """On a worker: its next fits write snapshots on the training thread (``checkpoints/background.py``)."""
    from nbddp.worker.checkpoints.background import INLINE_ENV

    if on:
        os.environ[INLINE_ENV] = "1"
    else:
        os.environ.pop(INLINE_ENV, None)


def _cost_run(data: Any, cfg: dict[str, Any], inline: bool = False, **extra: Any) -> dict[str, Any]:
    import nbddp

    if inline:
        nbddp.run(_set_inline, True)
    try:
        h = _fit(cfg["seed"], data, cfg, step_fn=KillOnce(), **extra)
    finally:
        if inline:
            nbddp.run(_set_inline, False)
    t = h.timings
    samples = len(data[0]) // 2 // cfg["batch_size"] * cfg["batch_size"] * 2 * cfg["epochs"]
    return {"train_s": t["train_s"], "samples_per_s": samples / t["train_s"], "snapshots": t.get("snapshots", 0),
            "snapshot_s": t.get("snapshot_s", 0.0), "share": t.get("snapshot_s", 0.0) / t["train_s"],
            "snapshot_write_s": t.get("snapshot_write_s", 0.0), "snapshot_wait_s": t.get("snapshot_wait_s", 0.0),
            "snapshot_copy_s": t.get("snapshot_s", 0.0) - t.get("snapshot_wait_s", 0.0),
            "steps": h.last_step}


def big_state(mb: int, reps: int) -> dict[str, Any]:
    """The step's wait for one snapshot of a larger state (``mb`` MB of weights and as much optimizer state), in
    this process: the copy into host buffers then the write handed to the thread, against the write on the step
    (``files.save``, as inline), alternating. The fits above train a 1.6 MB model, whose write is a few ms."""
    import torch

    from nbddp.worker.checkpoints import background, files

    n = mb * (1 << 20) // 4 // 2
    state = {"model": {"w": torch.randn(n)}, "optimizer": {"state": {0: {"momentum_buffer": torch.randn(n)}}}}
    folder = tempfile.mkdtemp(prefix="nbddp-bench-elastic-big-")
    writer = background.Writer(torch.device("cpu"))
    times: dict[str, list[float]] = {"background": [], "inline": []}
    try:
        for step in range(1, 2 * reps + 1):
            writer.wait()  # the previous write ended: what a step sees at the default interval
            t0 = time.perf_counter()
            if step % 2:
                staged = writer.stage(state)
                writer.submit(lambda staged=staged, step=step: files.save(folder, step, staged, keep=2, private=True))
                times["background"].append(time.perf_counter() - t0)
            else:
                files.save(folder, step, state, keep=2, private=True)
                times["inline"].append(time.perf_counter() - t0)
        writer.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    bg, inline = common.median(times["background"]), common.median(times["inline"])
    return {"state_mb": 2 * mb, "step_wait_background_s": bg, "step_wait_inline_s": inline,
            "background/inline": bg / inline if bg and inline else None, "write_in_thread_s": writer.write_s / reps}


def recovery(data: Any, cfg: dict[str, Any]) -> dict[str, Any]:
    """One fit that loses rank 1 at ``KILL_AT``: the time split and the steps lost."""
    folder = tempfile.mkdtemp(prefix="nbddp-bench-elastic-")
    marker = os.path.join(folder, "kill")
    try:  # the folder goes with the measurement, whatever happens
        open(marker, "w").close()
        spare_warm_s = _warm_spare().warm_s  # (read now: once the fit resumed, the next spare starts)
        steps = len(data[0]) // 2 // cfg["batch_size"] * cfg["epochs"]
        kill_at = min(KILL_AT, steps * 3 // 4)  # the quick workload has 16 steps
        h = _fit(cfg["seed"], data, cfg, step_fn=KillOnce(marker, kill_at), max_restarts=1, snapshot_every=DENSE)
        with open(marker + ".fired") as f:
            killed_at, call = f.read().split()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    killed_at, done = float(killed_at), int(call) - 1  # the steps rank 1 finished before it died
    (event,) = h.restarts
    heal = _session().supervisor.last_heal
    return {"noticing_s": event["time"] - killed_at, "replacing_s": event["replace_s"],
            **{f"heal_{k}": heal.get(k) for k in ("ping_s", "spare_s", "start_s", "group_s", "started")},
            "spare_warm_s": spare_warm_s,
            "restoring_s": event["seconds"] - event["replace_s"], "recovery_s": event["seconds"],
            "from_death_s": event["time"] - killed_at + event["seconds"],
            "steps_lost": done - event["step_resumed_from"], "interval_steps": DENSE,
            "status": h.status, "event": event}


def _device() -> str:
    """What the ranks train on: ``cpu``, or ``cuda xN`` (a snapshot is then a device-to-host copy)."""
    if not common.cuda_available():
        return "cpu"
    import torch

    return f"cuda x{torch.cuda.device_count()}"


def _session() -> Any:
    from nbddp.session.session import get_session

    return get_session()


def _warm_spare() -> Any:
    """The session's spare engine, ready (the cost runs' elastic fits started it)."""
    from nbddp.elastic.spare import keep_spare

    spare = keep_spare(_session())
    spare.wait()
    return spare


def main(quick: bool = False, reps: int | None = None) -> dict:
    reps = reps or (1 if quick else 3)
    cfg = common.workload_cfg("mlp", quick)
    ok, reason = common.nbddp_status()
    out: dict[str, Any] = {"name": NAME, "env": common.environment(), "cfg": cfg}
    if not ok:
        common.log(f"skipped: {reason}")
        return {**out, "skipped": reason}
    data = common.make_data("mlp", cfg["n_samples"], seed=cfg["seed"])
    out["device"] = _device()
    # one GPU (scripts/gpu_check.sh's machine): both ranks on it, over gloo (nccl takes one rank per GPU)
    out["nbddp_start_s"] = common.nbddp_start(2, **({"backend": "gloo"} if out["device"] == "cuda x1" else {}))
    try:
        raw = common.alternate({
            "plain": lambda: _cost_run(data, cfg),
            "snapshots_auto": lambda: _cost_run(data, cfg, max_restarts=1),
            "snapshots_dense": lambda: _cost_run(data, cfg, max_restarts=1, snapshot_every=DENSE),
            "snapshots_dense_inline": lambda: _cost_run(data, cfg, inline=True, max_restarts=1, snapshot_every=DENSE),
        }, reps=reps, warmup=0 if quick else 1, label=NAME)
        out["recovery"] = recovery(data, cfg)
        out["big_state"] = big_state(16 if quick else 64, reps=3 if quick else 5)
    finally:
        common.nbddp_stop()
    out["raw"] = raw
    out["summary"] = summary(raw)
    report(out)
    return out


def _per_snapshot(runs: list[Any], field: str) -> float | None:
    """The median over ``runs`` of ``field`` per snapshot (runs that failed or wrote none left out)."""
    done = [r for r in runs if isinstance(r, dict) and r.get("snapshots")]
    return common.median(r[field] / r["snapshots"] for r in done)


def summary(raw: dict[str, list[Any]]) -> dict[str, Any]:
    one = _per_snapshot(raw["snapshots_dense"], "snapshot_s")
    inline = _per_snapshot(raw.get("snapshots_dense_inline", []), "snapshot_s")
    return {
        "one_snapshot_inline_s": inline,  # the step's wait when the step writes the snapshot itself
        "one_write_s": _per_snapshot(raw["snapshots_dense"], "snapshot_write_s"),  # the thread's part
        # the step's own part, the copy: all it waits when the previous write has ended (the default interval)
        "one_copy_s": _per_snapshot(raw["snapshots_dense"], "snapshot_copy_s"),
        "copy/inline": (_per_snapshot(raw["snapshots_dense"], "snapshot_copy_s") or 0) / inline if inline else None,
        "step_wait_background/inline": (one / inline) if one and inline else None,
        "auto_share": common.median(common.field_values(raw["snapshots_auto"], "share")),
        "dense_share": common.median(common.field_values(raw["snapshots_dense"], "share")),
        "one_snapshot_s": one,
        "share_at_default_interval": (one / 30.0) if one is not None else None,
        "throughput_auto/plain_paired": common.paired_ratios(raw["snapshots_auto"], raw["plain"],
                                                             "samples_per_s")["median"],
        "throughput_dense/plain_paired": common.paired_ratios(raw["snapshots_dense"], raw["plain"],
                                                              "samples_per_s")["median"],
        "throughput_dense/dense_inline_paired": common.paired_ratios(
            raw["snapshots_dense"], raw.get("snapshots_dense_inline", []), "samples_per_s")["median"],
        "errors": {n: common.errors_of(r) for n, r in raw.items()},
    }


def report(out: dict[str, Any]) -> None:
    s, r = out["summary"], out["recovery"]
    print(f"\n== elastic: snapshots and recovery on mlp ({out['cfg']['n_samples']} x {out['cfg']['epochs']} epochs, "
          f"{out.get('device')}) ==")
    print("  " + ", ".join(f"{k}={common.fmt(v)}" for k, v in s.items() if k != "errors"), flush=True)
    print("  " + ", ".join(f"{k}={common.fmt(v)}" for k, v in r.items() if k != "event"), flush=True)
    print("  " + ", ".join(f"{k}={common.fmt(v)}" for k, v in out.get("big_state", {}).items()), flush=True)


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    result = main(quick=args.quick, reps=args.reps)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
