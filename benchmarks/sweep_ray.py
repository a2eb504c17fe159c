"""The Ray Tune side of ``bench_sweep``: the same 8 trials with ``tune.Tuner`` on 2 CPUs, when Ray is importable.

Ray is no dependency of nbddp; install it beside the project to compare, e.g.
``pip install --target /tmp/raytune 'ray[tune]' -c constraints-dev.txt`` and run
``PYTHONPATH=.:/tmp/raytune .venv/bin/python benchmarks/bench_sweep.py``.
Where Ray is absent the side is skipped and the reason printed and recorded.

The trial is the fit ``dist_fit`` runs on one worker, written out as a plain
loop: the same MLP, data, batch size, epochs, AdamW at the same learning
rate, cross-entropy, a validation after each epoch reported to Tune. One torch
thread per trial and ``{"cpu": 1}`` per trial on ``ray.init(num_cpus=2)``, so
two trials run at once, as the sweep's two workers do. The data go to Ray's
object store once (``tune.with_parameters``), as the sweep ships them once.

Timed apart: ``ray.init`` (the start-up: GCS, raylet, the first workers),
then each ``Tuner.fit`` of the 8 trials. The first fit starts the trial
processes, which import torch; later fits in the same Ray session find them
when Tune reuses its actors. ``ray.shutdown`` is timed too but counted in
neither. Each fit's time is also broken down per trial (``breakdown``): from
the trials' own moments (process start, entry, first step, last
validation, time inside ``tune.report``), Ray's ``time_total_s``, and the
fit's wall, what lies outside the trainables (actor start-up, scheduling,
results, teardown).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

REPO = str(Path(__file__).resolve().parent.parent)


def available() -> str | None:
    """None when Ray Tune imports here, else why the Ray side is skipped."""
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure to import means no Ray side
        return (f"Ray Tune is not importable here ({type(exc).__name__}: {exc}); install it beside the project, e.g. "
                "pip install --target /tmp/raytune 'ray[tune]' -c constraints-dev.txt, and add /tmp/raytune to "
                "PYTHONPATH")
    return None


def trial(config: dict[str, Any], train: Any, val: Any, epochs: int, batch_size: int, seed: int) -> None:
    """One trial as ``dist_fit`` runs it on one worker: AdamW, cross-entropy, a validation per epoch.

    Each report also carries this trial's own moments (wall clock, one host): its process's start, the
    trainable's entry, the first and the last step's end, and the seconds spent inside ``tune.report``
    so far, for ``breakdown``."""
    entered = time.time()
    import torch
    import torch.nn.functional as F
    from ray import tune
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.bench_sweep import make_mlp

    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = make_mlp(config["width"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    loader = DataLoader(TensorDataset(*train), batch_size=batch_size, shuffle=True)
    moments = {"t_process_start": process_start(), "t_entry": entered, "t_first_step": time.time(), "report_s": 0.0}
    for epoch in range(epochs):
        model.train()
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            val_loss = F.cross_entropy(model(val[0]), val[1]).item()
        moments["t_train_end"] = time.time()
        t0 = time.perf_counter()
        tune.report({"val_loss": val_loss, "epoch": epoch, **moments})
        moments["report_s"] += time.perf_counter() - t0


def process_start() -> float:
    """This process's start, wall clock (Linux ``/proc``; 0.0 elsewhere): a Ray worker may be older than its trial."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks since boot
        with open("/proc/stat") as f:
            boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


def breakdown(metrics: list[dict[str, Any]], fit_start: float, fit_end: float, slots: int = 2) -> dict[str, Any]:
    """Where one ``Tuner.fit``'s time went, per trial (medians), from each trial's last report and the fit's ends.

    ``process_to_entry_s``: for a trial in a process started during the fit, from that process's start to the
    trainable's first line (Ray's worker boots, the actor is made, the trainable and its data are unpickled);
    ``setup_s``: torch, the model, the loader; ``train_s``: first step to the last validation (the reports inside);
    ``report_s``: inside ``tune.report``; ``outside_per_trial_s``: the fit's CPU slots (``slots`` x its wall) not
    spent inside a trainable, per trial: actor start-up, scheduling, result handling, teardown."""
    from benchmarks import common

    rows = [{"process_to_entry_s": m["t_entry"] - m["t_process_start"] if m["t_process_start"] >= fit_start else None,
             "setup_s": m["t_first_step"] - m["t_entry"], "train_s": m["t_train_end"] - m["t_first_step"],
             "report_s": m["report_s"], "new_process": m["t_process_start"] >= fit_start,
             "time_total_s": m.get("time_total_s")} for m in metrics]
    inside = sum(m["t_train_end"] - m["t_entry"] for m in metrics)
    out = {k: common.median(r[k] for r in rows if r[k] is not None)
           for k in ("process_to_entry_s", "setup_s", "train_s", "report_s")}
    out.update(new_processes=sum(r["new_process"] for r in rows), trials=len(rows),
               time_total_s=common.median(r["time_total_s"] for r in rows if r["time_total_s"] is not None),
               outside_per_trial_s=(slots * (fit_end - fit_start) - inside) / max(len(rows), 1))
    return out


@contextmanager
def _environment() -> Iterator[None]:
    """Ray's processes inherit this process's environment: the repo importable, one OpenMP thread."""
    saved = {k: os.environ.get(k) for k in ("PYTHONPATH", "OMP_NUM_THREADS")}
    os.environ["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [saved["PYTHONPATH"]])])
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run(train: Any, val: Any, cfg: dict[str, Any], lrs: list[float], widths: list[int], fits: int) -> dict[str, Any]:
    """``ray.init`` once, then ``fits`` times the 8 trials with ``tune.Tuner``; every second measured apart."""
    import ray
    from ray import tune

    temp = tempfile.mkdtemp(prefix="ray-")  # Ray's session files and Tune's results: removed at the end
    token = os.path.expanduser("~/.ray/auth_token")  # ray.init writes one when there is none: ours goes at the end
    had_token = os.path.exists(token)
    out: dict[str, Any] = {"fits_s": [], "states": []}
    try:
        with _environment():
            t0 = time.perf_counter()
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=temp,
                     object_store_memory=100 * 2**20)
            out["init_s"] = time.perf_counter() - t0
            trainable = tune.with_resources(
                tune.with_parameters(trial, train=train, val=val, epochs=cfg["epochs"], batch_size=cfg["batch_size"],
                                     seed=cfg["seed"]), {"cpu": 1})
            for i in range(fits):
                tuner = tune.Tuner(trainable,
                                   param_space={"lr": tune.grid_search(lrs), "width": tune.grid_search(widths)},
                                   tune_config=tune.TuneConfig(metric="val_loss", mode="min"),
                                   run_config=tune.RunConfig(storage_path=os.path.join(temp, "results"),
                                                             name=f"fit{i}", verbose=0))
                t0, wall0 = time.perf_counter(), time.time()
                grid = tuner.fit()
                out["fits_s"].append(time.perf_counter() - t0)
                out.setdefault("breakdown", []).append(breakdown([r.metrics for r in grid if not r.error], wall0,
                                                                 time.time()))
                out["states"].append(["failed" if r.error else "complete" for r in grid])
                out["best_value"] = grid.get_best_result().metrics["val_loss"]
    finally:
        t0 = time.perf_counter()
        ray.shutdown()
        out["shutdown_s"] = time.perf_counter() - t0
        shutil.rmtree(temp, ignore_errors=True)
        if not had_token and os.path.exists(token):
            os.unlink(token)
            with contextlib.suppress(OSError):  # the folder too, when ray.init made it for the token alone
                os.rmdir(os.path.dirname(token))
    return out
