"""Attaching to a detached session against starting cold (issue 43).

A first "kernel" (a Python process, as a Jupyter kernel would be) starts 2
workers with ``detach=True``, trains a model of about 100M parameters for one
step with ``keep="big"`` on a dataset passed by value (so the ranks keep the
model and the dataset), and exits without stopping anything. Then, 5 times
(1 with ``--quick``), a new process imports nbddp and times
``nbddp.attach()``: connecting to the controller, reading the session's
record, and taking the workers, their group, the kept model and the
resident dataset up as they are. Against it, the cold way back to the same
state: ``nbddp.start(n=2)`` plus the same fit with the model and data
shipped again (``keep="big"``), 5 times (1 with ``--quick``), in this
process. The goal (issue 43): attach in 2 s or less.

Each attaching process also checks what came back (``nbddp.kept()`` lists
the model with its strategy; a second fit on the same data ships only the
dataset's key); the last one stops the session. ``--quick``: a model of
about 1M parameters, one repetition each: the suite's smoke size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys as _sys
import tempfile
import time
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "attach"

SETUP = """
import torch
from benchmarks import common
torch.manual_seed(0)
MODEL = common.make_big_model({params})
X = torch.randn(256, 1024); Y = torch.randn(256, 1024)
FIT = dict(max_steps=1, batch_size=8, keep="big", live=False, seed=0, loss_fn=torch.nn.functional.mse_loss)
"""

FIRST = SETUP + """
import nbddp
nbddp.start(2, threads=1, detach=True, keep_alive="30m")
nbddp.dist_fit(MODEL, (X, Y), **FIT)
print("BENCH-OUT", json.dumps({{"sessions": nbddp.sessions()}}))
"""

ATTACH = SETUP + """
import time, nbddp
from nbddp.session.session import get_session
t0 = time.perf_counter()
nbddp.attach()
attach_s = time.perf_counter() - t0
t1 = time.perf_counter()
kept = nbddp.kept()
kept_s = time.perf_counter() - t1
resident = list(get_session().resident.keys())
if {last}:
    t2 = time.perf_counter()
    history = nbddp.dist_fit(MODEL, (X, Y), **FIT)
    refit = {{"fit_s": time.perf_counter() - t2, "shipped_bytes": history.transfers["shipped_bytes"]}}
    nbddp.stop()
else:
    refit = None
print("BENCH-OUT", json.dumps({{"attach_s": attach_s, "kept_s": kept_s, "kept": kept, "resident": resident,
                                "refit": refit}}))
"""


def _python(code: str, env: dict[str, str], timeout: float = 900) -> dict:
    """Run ``code`` in a new process (a kernel of its own); the JSON of its ``BENCH-OUT`` line."""
    done = subprocess.run([_sys.executable, "-c", "import json\n" + code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(common.REPO_ROOT))
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH-OUT")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the process failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def attach_runs(params: int, reps: int) -> dict:
    """The detached session set up once, then ``reps`` processes that each attach (the last one stops it)."""
    runtime = tempfile.mkdtemp(prefix="nbddp-bench-runtime-")
    env = common.worker_env({"NBDDP_RUNTIME_DIR": runtime})
    first = _python(FIRST.format(params=params), env)
    runs = [_python(ATTACH.format(params=params, last=i == reps - 1), env) for i in range(reps)]
    os.rmdir(runtime)  # empty: the last run's stop() removed the record
    return {"session": first["sessions"], "runs": runs}


def cold_run(params: int) -> dict:
    """``nbddp.start(n=2)`` and the same fit, model and data shipped again: the way back without detach."""
    import torch

    import nbddp

    torch.manual_seed(0)
    model = common.make_big_model(params)
    x, y = torch.randn(256, 1024), torch.randn(256, 1024)
    common.nbddp_stop(fresh=True)
    t0 = time.perf_counter()
    start_s = common.nbddp_start(2, fresh=True)
    t1 = time.perf_counter()
    nbddp.dist_fit(model, (x, y), max_steps=1, batch_size=8, keep="big", live=False, seed=0,
                   loss_fn=torch.nn.functional.mse_loss)
    out = {"start_s": start_s, "fit_s": time.perf_counter() - t1, "total_s": time.perf_counter() - t0}
    common.nbddp_stop(fresh=True)
    return out


def main(quick: bool = False, reps: int | None = None) -> dict:
    reps = reps or (1 if quick else 5)
    params = 1_000_000 if quick else 100_000_000
    load_before = os.getloadavg()
    was_running = common.REUSE_WORKERS and __import__("nbddp").status()["running"]
    attached = attach_runs(params, reps)
    cold = [cold_run(params) for _ in range(reps)]
    if was_running:  # the smoke run: leave 2 workers running for the benchmarks after this one
        common.nbddp_start(2, fresh=True)
    attach_s = [r["attach_s"] for r in attached["runs"]]
    summary = {"attach_s": common.summarize(attach_s),
               "cold_total_s": common.summarize([c["total_s"] for c in cold]),
               "cold_start_s": common.summarize([c["start_s"] for c in cold]),
               "cold_fit_s": common.summarize([c["fit_s"] for c in cold])}
    ratio = common.ratio(summary["cold_total_s"]["median"], summary["attach_s"]["median"])
    out = {"params": params, "reps": reps, "load_before": load_before, "load_after": os.getloadavg(),
           "summary": summary, "cold_over_attach": ratio, "goal_attach_s": 2.0,
           "kept": attached["runs"][-1]["kept"], "resident": attached["runs"][-1]["resident"],
           "refit_after_attach": attached["runs"][-1]["refit"], "attach_runs": attached["runs"], "cold_runs": cold}
    common.print_table([{"way back": "attach()", "median s": summary["attach_s"]["median"],
                         "min": summary["attach_s"]["min"], "max": summary["attach_s"]["max"]},
                        {"way back": "start() + fit again", "median s": summary["cold_total_s"]["median"],
                         "min": summary["cold_total_s"]["min"], "max": summary["cold_total_s"]["max"]}],
                       title=f"\n== attach: 2 workers, a kept {params / 1e6:.0f}M-parameter model and a resident "
                             "dataset ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    s = res["summary"]
    return [{"bench": "attach", "competitor": "nbddp.attach", "metric": "s", "median": s["attach_s"]["median"],
             "ratio": None},
            {"bench": "attach", "competitor": "start+fit again", "metric": "s", "median": s["cold_total_s"]["median"],
             "ratio": res["cold_over_attach"], "ratio_of": "cold / attach"}]


if __name__ == "__main__":
    common.cli(main, NAME)
