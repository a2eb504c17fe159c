"""Per-call overhead: warm calls against bare ipyparallel, and three fits in a row against launchers.

First (``warm_calls.py``): a warm ``run``, a warm one-step fit, a ``%%ddp``
cell and a ``push``, each next to the same work done with bare ipyparallel
on the same engines (its floor), and what giving memory back costs on the
workers after each (and after a larger fit). Goal: each within 2x of its
floor.

Then three fits in a row of the same small job, from one process.

Competitors (alternating; each turn makes 3 calls in a row):

* ``nbddp_warm``: ``nbddp.dist_fit`` on workers started once beforehand (plus
  one untimed fit right after start, reported as ``first_fit_after_start``).
* ``accelerate``: ``accelerate.notebook_launcher(fn, num_processes=2)``, which
  forks fresh processes on every call; ``fn`` runs the same DDP loop as
  torchrun_train.py (``run_ddp``) and rank 0 writes its results to a file.
* ``torchrun``: a new ``python -m torch.distributed.run`` job per call.

Overhead of a call = its wall time in this process - the training-loop time
measured inside the workers (torchrun_train's ``loop_s`` /
``hist.timings['train_s']``).

``epoch_round_trip`` (``epoch_round_trip.py``): what a synchronous
``on_epoch_end`` callback adds per epoch, the ranks waiting for the kernel.

``time_split_cost``: what the always-on time split (issue 35) adds to a
step, in this process, and its share of this benchmark's step.

``output`` (``output_cost.py``): what showing the ranks' output costs a
``%%ddp`` call since issue 46 (every message taken in order, bars drawn in
place, displays republished), against main's reader, on the same workers in
turns: a quiet cell and a cell with a 200-step tqdm bar; the ratio new /
main, and the kernel's time per message.

``source_shipping``: what carrying the person's source lines costs a call
(``nbddp.shipping.source_lines``), in this process: packing a model whose class comes from
a 200-line notebook cell, with cloudpickle alone and with nbddp's pickler,
and the per-worker ``SourceLedger.attach`` on the first call (the lines
travel) and on later ones (only the cell's name).
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common, epoch_round_trip, output_cost, torchrun_train, warm_calls  # noqa: E402

NAME = "latency"
CALLS = 3  # fits in a row per turn (1 with --quick: each torchrun or accelerate call is a new job of seconds)


def _accelerate_worker(cfg: dict, result_path: str) -> None:
    """Runs in each process notebook_launcher forks (env:// vars are set)."""
    res = torchrun_train.run_ddp(cfg)
    if res["rank"] == 0:
        with open(result_path, "w") as f:
            json.dump(res, f)


def accelerate_fit(cfg: dict, nproc: int = 2) -> dict:
    from accelerate import notebook_launcher

    fd, path = tempfile.mkstemp(prefix="nbddp_bench_acc_", suffix=".json")
    os.close(fd)
    try:
        old = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(common.CPU_THREADS_PER_RANK)
        t0 = time.perf_counter()
        try:
            notebook_launcher(_accelerate_worker, args=(cfg, path), num_processes=nproc,
                              use_port=str(common.free_port()), master_addr="127.0.0.1")
        finally:
            wall = time.perf_counter() - t0
            if old is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = old
        with open(path) as f:
            res = json.load(f)
    finally:
        os.unlink(path)
    res["wall_s"] = wall
    res["overhead_s"] = wall - res["loop_s"]
    return res


def accelerate_in_a_row(cfg: dict, nproc: int = 2, calls: int = CALLS) -> dict:
    """``calls`` notebook_launcher calls in a row in a fresh Python process, as an accelerate user's kernel.

    notebook_launcher forks the calling process. Forking this benchmark process,
    which also holds nbddp's client threads (ipyparallel's IO thread, the fit
    watcher), can deadlock the children on a lock some thread held at fork time
    (seen here: both forks hung). A kernel that only uses accelerate has no
    such threads, so the competitor runs in a clean process; each call's wall
    time is still measured around the notebook_launcher call itself.
    """
    root = str(_Path(__file__).resolve().parent.parent)
    proc = subprocess.run(
        [_sys.executable, "-m", "benchmarks.bench_latency", "--accelerate-child", json.dumps(cfg), str(nproc),
         str(calls)],
        cwd=root, capture_output=True, text=True, timeout=900,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"accelerate child failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    calls = common.parse_bench_json(proc.stdout)["calls"]
    return {"calls": calls, "overhead_s": [c.get("overhead_s") for c in calls],
            "wall_s": [c.get("wall_s") for c in calls]}


CELL_LINES = 200


def source_shipping(reps: int = 200) -> dict:
    """Microseconds per call of shipping a notebook class's source (see the module docstring)."""
    import linecache
    import pickle
    from types import SimpleNamespace

    import cloudpickle
    import torch

    from nbddp.shipping import pickling as shipping
    from nbddp.session.source_ledger import SourceLedger

    name = "/tmp/ipykernel_0/bench-cell.py"
    filler = "".join(f"# line {i} of the cell\n" for i in range(CELL_LINES - 8))
    text = filler + ("class Net(torch.nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                     "        self.a = torch.nn.Linear(16, 16)\n        self.b = torch.nn.Linear(16, 4)\n"
                     "    def forward(self, x):\n        return self.b(torch.relu(self.a(x)))\n")
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    ns = {"__name__": "__main__", "torch": torch}
    exec(compile(text, name, "exec"), ns)  # noqa: S102 - a stand-in for a notebook cell
    model = ns["Net"]()

    def per_call_us(fn) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6

    parcel = shipping.pack(model, local=True)
    parcel.discard()
    ledger, worker = SourceLedger(), SimpleNamespace(host="bench", pid=0)
    first = ledger.attach(parcel, worker)
    return {
        "cell_lines": CELL_LINES,
        "pack_us_cloudpickle": per_call_us(lambda: cloudpickle.dumps(model, protocol=5)),
        "pack_us_nbddp": per_call_us(lambda: shipping.pack(model, local=True).discard()),
        "attach_us_first": per_call_us(lambda: SourceLedger().attach(parcel, worker)),
        "attach_us_warm": per_call_us(lambda: ledger.attach(parcel, worker)),
        "bytes_first_call": len(pickle.dumps(first)),
        "bytes_warm_call": len(pickle.dumps(ledger.attach(parcel, worker))),
    }


SPLIT_MARKS = ("data", "forward", "backward", "optimizer", "optimizer", "collective")  # one step's marks


def time_split_cost(reps: int = 20000, step_s: float | None = None) -> dict:
    """What the always-on time split adds to a training step, measured in this process.

    A step marks its phases about six times (``SPLIT_MARKS``); with the split
    on, each mark also adds the seconds of the phase it closes. ``added_us``
    is the least of nine runs timed minus the least of nine untimed (the runs
    interleaved), per step; ``sync_us`` what
    packing the seconds costs once per record (at most once a second). The
    share is taken of ``step_s`` (the benchmark fit's step) and of a 1 ms step.
    """
    from nbddp.protocol.messages import timed_phases
    from nbddp.worker.engine.heartbeat import Heartbeat

    def per_step_us(beat: Heartbeat) -> float:
        t0 = time.perf_counter()
        for _ in range(reps):
            for phase in SPLIT_MARKS:
                beat.mark(phase)
        return (time.perf_counter() - t0) / reps * 1e6

    untimed, timed = Heartbeat(), Heartbeat()
    timed.time_phases("data")
    rounds = [(per_step_us(untimed), per_step_us(timed)) for _ in range(9)]  # interleaved: the same load on both
    off, on = min(r[0] for r in rounds), min(r[1] for r in rounds)
    t0 = time.perf_counter()
    for _ in range(reps // 10):
        timed_phases(timed.phase_seconds())
    sync_us = (time.perf_counter() - t0) / (reps // 10) * 1e6
    added = max(0.0, on - off)
    out = {"marks_us_untimed": off, "marks_us_timed": on, "added_us": added, "sync_us": sync_us,
           "share_of_1ms_step": added / 1000}
    if step_s:
        out["step_s"] = step_s
        out["share_of_step"] = added / (step_s * 1e6)
    return out


def _in_a_row(call, n: int = CALLS) -> dict:
    """``n`` calls in a row: their results, overheads and wall times."""
    calls = [call() for _ in range(n)]
    return {"calls": calls, "overhead_s": [c.get("overhead_s") for c in calls],
            "wall_s": [c.get("wall_s") for c in calls]}


def main(quick: bool = False, reps: int | None = None) -> dict:
    reps = reps or (1 if quick else 3)
    n_calls = 1 if quick else CALLS
    out_sources = source_shipping(50 if quick else 200)
    common.log("source shipping, us per call: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}"
                                                             for k, v in out_sources.items()))
    n_cuda = common.cuda_count()
    world = min(2, n_cuda) if n_cuda else 2
    # --quick: bench_throughput's quick MLP job exactly, so the smoke run launches that torchrun job once
    cfg = common.workload_cfg("mlp", True) if quick else common.workload_cfg("mlp", False, n_samples=2048, epochs=1)
    data = common.make_data("mlp", cfg["n_samples"], seed=cfg["seed"])
    out: dict = {"cfg": cfg, "reps": reps, "calls_per_turn": n_calls, "world_size": world,
                 "source_shipping": out_sources}

    comps = {}
    ok, reason = common.nbddp_status()
    out["nbddp"] = reason
    started = False
    if ok:
        try:
            out["nbddp_start_s"] = common.nbddp_start(world)
            started = True
            model = common.make_model("mlp", seed=cfg["seed"])
            out["first_fit_after_start"] = first = common.nbddp_fit(model, data, cfg, world=world)
            steps = first["samples"] / (world * cfg["batch_size"])
            out["time_split_cost"] = cost = time_split_cost(
                step_s=first["train_s"] / steps if steps and first.get("train_s") else None)
            common.log(f"time split: +{cost['added_us']:.2f} us a step ({cost.get('share_of_step', 0):.4%} of this "
                       f"fit's step, {cost['share_of_1ms_step']:.3%} of a 1 ms step), {cost['sync_us']:.1f} us a record")
            out["warm"] = warm_calls.measure(reps=6 if quick else 30, big_layers=2 if quick else 24)
            print_warm(out["warm"])
            out["output"] = shown = output_cost.measure(reps=3 if quick else 15)
            common.log(f"the ranks' output: x{shown['ratio_new_over_main']['quiet']:.3f} (quiet cell), "
                       f"x{shown['ratio_new_over_main']['bar']:.3f} (200-step bar) of main's reader; "
                       f"{shown['tick_us_per_message']:.1f} us of the kernel's time a message")
            out["epoch_round_trip"] = rt = epoch_round_trip.measure(reps=2 if quick else 7, epochs=5 if quick else 20)
            common.log(f"synchronous on_epoch_end: {rt['round_trip_ms']:.1f} ms a round trip per epoch (median of "
                       f"{rt['reps']} paired fits of {rt['epochs']} epochs; an epoch without it "
                       f"{rt['epoch_ms_free']:.1f} ms)")
        except Exception as exc:
            ok = False
            out["nbddp"] = f"nbddp start/first fit failed: {type(exc).__name__}: {exc}"
    if ok:
        comps["nbddp_warm"] = lambda: _in_a_row(
            lambda: common.nbddp_fit(common.make_model("mlp", seed=cfg["seed"]), data, cfg, world=world), n_calls)
    else:
        common.log(f"nbddp side skipped: {out['nbddp']}")
    try:
        import accelerate  # noqa: F401

        comps["accelerate"] = lambda: accelerate_in_a_row(cfg, nproc=world, calls=n_calls)
    except ImportError:
        out["accelerate"] = "not installed (pip install accelerate -c constraints-dev.txt)"
    comps["torchrun"] = lambda: _in_a_row(lambda: common.run_torchrun(cfg, nproc=world), n_calls)

    try:
        raw = common.alternate(comps, reps=reps, label="latency")
    finally:
        if started:
            common.nbddp_stop()

    summary = {}
    for name, turns in raw.items():
        good = [t for t in turns if "error" not in t]
        per_call = [common.summarize(t["overhead_s"][i] for t in good) for i in range(n_calls)]
        summary[name] = {
            "overhead_s": common.summarize(v for t in good for v in t["overhead_s"]),
            "overhead_s_by_call": per_call,
            "wall_s": common.summarize(v for t in good for v in t["wall_s"]),
            "loop_s": common.summarize(c.get("loop_s", c.get("train_s")) for t in good for c in t["calls"]),
            "errors": common.errors_of(turns),
        }
    base = summary.get("nbddp_warm", {}).get("overhead_s", {}).get("median")
    out["summary"] = summary
    out["ratios"] = {f"{n}/nbddp_warm": common.ratio(s["overhead_s"]["median"], base) for n, s in summary.items() if n != "nbddp_warm"}
    out["raw"] = raw
    rows = [
        {
            "competitor": n,
            "overhead s (median)": s["overhead_s"]["median"],
            **{f"call{i + 1}": c["median"] for i, c in enumerate(s["overhead_s_by_call"])},
            "wall s": s["wall_s"]["median"],
            "loop s": s["loop_s"]["median"],
            "x nbddp": common.ratio(s["overhead_s"]["median"], base),
            "errors": len(s["errors"]),
        }
        for n, s in summary.items()
    ]
    common.print_table(rows, title=f"\n== latency: per-call overhead, {n_calls} fits in a row "
                                   f"({cfg['n_samples']} samples mlp) ==")
    return out


def print_warm(warm: dict) -> None:
    rows = [{"call": name, "nbddp s": f["nbddp_s"], "floor s": f["floor_s"], "x floor": f["x_floor"],
             "x bare apply": f["x_apply_floor"]} for name, f in warm["figures"].items()]
    common.print_table(rows, title=f"\n== latency: warm calls against bare ipyparallel on the same engines "
                                   f"(bare apply {warm['apply_floor_s'] * 1e3:.1f} ms; medians of {warm['reps']}) ==")
    rows = [{"after": name, **{k: v * 1e3 for k, v in cost.items() if k.endswith("_s")}}
            for name, cost in warm["release"].items()]
    common.print_table(rows, title="== giving memory back on the workers, ms (slowest rank) ==")


def summary_rows(res: dict) -> list[dict]:
    base = res.get("summary", {}).get("nbddp_warm", {}).get("overhead_s", {}).get("median")
    warm = warm_calls.rows(res["warm"]) if "warm" in res else []
    warm += epoch_round_trip.rows(res["epoch_round_trip"]) if "epoch_round_trip" in res else []
    warm += output_cost.rows(res["output"]) if "output" in res else []
    return warm + [
        {"bench": "latency", "competitor": n, "metric": "overhead s/call",
         "median": s["overhead_s"]["median"], "ratio": common.ratio(s["overhead_s"]["median"], base),
         "ratio_of": "x nbddp_warm"}
        for n, s in res.get("summary", {}).items()
    ]


if __name__ == "__main__":
    if len(_sys.argv) > 1 and _sys.argv[1] == "--accelerate-child":
        child_cfg, child_nproc, child_calls = json.loads(_sys.argv[2]), int(_sys.argv[3]), int(_sys.argv[4])
        result = {"calls": [accelerate_fit(child_cfg, nproc=child_nproc) for _ in range(child_calls)]}
        print(common.JSON_MARKER + json.dumps(result), flush=True)
    else:
        common.cli(main, NAME)
