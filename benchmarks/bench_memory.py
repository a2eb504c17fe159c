"""Workers that stay light: memory given back, each fit's own peak, FSDP against DDP with defaults, a 50-task soak.

1. **Fits of a 100M-parameter model** (96 x ``nn.Linear(1024, 1024)``, built
   by a factory, AdamW, 3 steps of 32 rows per rank) on 2 workers, nothing
   set but the strategy, in both orders on fresh workers: DDP then FSDP, and
   (after ``nbddp.restart()``) FSDP then DDP. For each fit: every worker's
   resident memory before and after (read in a task of its own), and what
   ``History.ranks`` says: ``peak_mem`` and ``base_mem``. Goals: after each
   fit a worker is back within max(64 MiB, 10 %) of where it was; FSDP's
   ``peak_mem`` per rank is at most 0.6x DDP's; each strategy reads the same
   figures (within 10 %) in either order. (The suite's smoke run, which keeps its
   workers, restarts them for the second order only.)
2. **Soak**: 50 mixed tasks on the same workers, 5 rounds of DDP and FSDP
   fits of a 9.4M-parameter stack, a ``%%ddp`` cell, a call, a push, a pull,
   a failing fit, a fit whose loss turns NaN, an interrupted cell and a
   stopped fit. After every task: each worker's resident memory, open file
   descriptors, threads and ``/dev/shm`` files. Goal: flat, RSS within
   64 MiB of its level after the first round.

    python benchmarks/bench_memory.py [--quick]     # -> benchmarks/results/<date>_memory.json
"""

from __future__ import annotations

import os
import signal
import sys as _sys
import threading
import time
from pathlib import Path as _Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "memory"
MiB = 1 << 20


def resources() -> dict[str, int]:
    """This worker now: resident bytes, open fds, threads, its /dev/shm files."""
    from nbddp.protocol.notes import shm_dir
    from nbddp.worker.engine.rank_state import STATE
    from nbddp.worker.memory.usage import rss_bytes

    prefix = STATE.file_prefix
    shm = [f for f in os.listdir(shm_dir()) if prefix and f.startswith(prefix)]
    return {"rss": rss_bytes(), "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "shm": len(shm)}


def stack(width: int, layers: int) -> Callable[[], Any]:
    def build():
        import torch.nn as nn

        return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])

    return build


def one_fit(strategy: str, width: int, layers: int, rows: int, steps: int, **extra: Any) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import nbddp

    g = torch.Generator().manual_seed(0)
    n = rows * 2 * steps
    x, y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    before = [r["rss"] for r in nbddp.run(resources)]
    t0 = time.perf_counter()
    h = nbddp.dist_fit(stack(width, layers), (x, y), strategy=strategy, max_steps=steps, batch_size=rows,
                       loss_fn=F.mse_loss, live=False, return_weights=False, **extra)
    wall = time.perf_counter() - t0
    after = [r["rss"] for r in nbddp.run(resources)]
    return {"strategy": strategy, "wall_s": wall, "rss_before": before, "rss_after": after,
            "peak_mem": [r["peak_mem"] for r in h.ranks], "base_mem": [r.get("base_mem") for r in h.ranks],
            "param_bytes": [r["param_bytes"] for r in h.ranks], "samples_per_s": h.steps[-1]["samples_per_s"]}


def orders(width: int, layers: int, rows: int, steps: int) -> dict[str, list[dict]]:
    import nbddp

    out = {}
    for i, order in enumerate((("ddp", "fsdp"), ("fsdp", "ddp"))):
        if i or not common.REUSE_WORKERS:  # fresh workers for each order (the smoke run: for the second)
            nbddp.restart()
        one_fit(order[0], 64, 2, 4, 1)  # a tiny fit first: what a worker's first fit imports is not the model's
        one_fit(order[1], 64, 2, 4, 1)
        out[" then ".join(order)] = [one_fit(s, width, layers, rows, steps) for s in order]
    return out


def summarize_fits(runs: dict[str, list[dict]]) -> dict[str, Any]:
    by = {(order, r["strategy"]): r for order, fits in runs.items() for r in fits}
    ratio = {order: [f / d for f, d in zip(by[(order, "fsdp")]["peak_mem"], by[(order, "ddp")]["peak_mem"])]
             for order in runs}
    orders_ = list(runs)
    spread = {s: max(abs(a - b) / min(a, b) for a, b in zip(by[(orders_[0], s)]["peak_mem"], by[(orders_[1], s)]["peak_mem"]))
              for s in ("ddp", "fsdp")}
    back = {f"{o}: {r['strategy']}": max(a - b for a, b in zip(r["rss_after"], r["rss_before"]))
            for o, fits in runs.items() for r in fits}
    within = all(a <= b + max(64 * MiB, 0.1 * b) for r in by.values() for a, b in zip(r["rss_after"], r["rss_before"]))
    return {"fsdp_over_ddp_peak": ratio, "order_spread": spread, "rss_added_after_fit": back,
            "given_back": within, "goal_ratio_met": all(v <= 0.6 for vs in ratio.values() for v in vs),
            "goal_order_met": all(v <= 0.1 for v in spread.values())}


# ---- the soak ------------------------------------------------------------------------------------


def _interrupted_cell(folder: str) -> None:
    import nbddp

    started = [os.path.join(folder, f"started-{r}") for r in range(2)]
    for path in started:
        if os.path.exists(path):
            os.unlink(path)
    main = threading.main_thread().ident

    def fire() -> None:
        deadline = time.monotonic() + 60
        while not all(map(os.path.exists, started)) and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.pthread_kill(main, signal.SIGINT)

    thread = threading.Thread(target=fire, daemon=True)
    thread.start()
    try:
        nbddp.run_cell(f"import os, time\nopen(os.path.join({folder!r}, f'started-{{rank}}'), 'w').close()\n"
                       "while True:\n    time.sleep(0.01)")
    except KeyboardInterrupt:
        pass
    thread.join()


def _stopped_fit(width: int, layers: int) -> None:
    import torch
    import torch.nn.functional as F

    import nbddp

    x, y = torch.randn(512, width), torch.randn(512, width)
    handle = nbddp.dist_fit(stack(width, layers), (x, y), epochs=50, batch_size=8, loss_fn=F.mse_loss, live=False,
                            block=False, return_weights=False)
    deadline = time.monotonic() + 60
    while not handle.history.steps and not handle.done() and time.monotonic() < deadline:
        time.sleep(0.02)
    handle.stop()


def _expect_failure(call: Callable[[], Any]) -> None:
    import nbddp

    try:
        call()
    except nbddp.WorkerError:
        return
    raise AssertionError("the task was meant to fail")


def soak_round(width: int, layers: int, folder: str) -> list[tuple[str, Callable[[], Any]]]:
    import torch
    import torch.nn.functional as F

    import nbddp

    x, y = torch.randn(64, width), torch.randn(64, width)
    fit = dict(max_steps=2, batch_size=8, loss_fn=F.mse_loss, live=False, return_weights=False)
    return [
        ("ddp fit", lambda: nbddp.dist_fit(stack(width, layers), (x, y), **fit)),
        ("fsdp fit", lambda: nbddp.dist_fit(stack(width, layers), (x, y), strategy="fsdp", **fit)),
        ("cell", lambda: nbddp.run_cell("x = [t * 2 for t in range(10_000)]")),
        ("call", lambda: nbddp.run(sum, [1, 2, 3])),
        ("push", lambda: nbddp.push(blob=torch.zeros(1 << 22))),
        ("pull", lambda: nbddp.pull("blob")),
        ("failing fit", lambda: _expect_failure(lambda: nbddp.dist_fit(stack(width, layers), (x, y), **{
            **fit, "loss_fn": lambda o, t: (o - t) ** 2}))),
        ("nan fit", lambda: _expect_failure(lambda: nbddp.dist_fit(stack(width, layers), (x * float("nan"), y), **fit))),
        ("interrupted cell", lambda: _interrupted_cell(folder)),
        ("stopped fit", lambda: _stopped_fit(width, layers)),
    ]


def soak(tasks: int, width: int, layers: int, folder: str) -> dict[str, Any]:
    import nbddp
    from nbddp.session.session import get_session

    session = get_session()
    tasks_round = soak_round(width, layers, folder)
    trace = []
    for i in range(tasks):
        name, call = tasks_round[i % len(tasks_round)]
        t0 = time.perf_counter()
        call()
        session.wait_healed(raise_error=True)
        trace.append({"task": name, "s": time.perf_counter() - t0, "workers": nbddp.run(resources)})
    per_round = len(tasks_round)
    first = trace[per_round - 1]["workers"]  # the level after the first round
    later = trace[per_round:] or trace[-1:]
    rounds = [trace[i:i + per_round] for i in range(0, len(trace), per_round)]
    peaks = [{k: [max(t["workers"][r][k] for t in rnd) for r in range(len(first))] for k in ("rss", "fds", "threads",
                                                                                             "shm")} for rnd in rounds]
    rss_above = [max(t["workers"][r]["rss"] for t in later) - first[r]["rss"] for r in range(len(first))]
    # fds and threads rise and fall with each rebuilt process group (a failure's): flat means the last round
    # reaches no higher than the second (the first round is where a worker's first rebuilds start threads)
    ref, last = peaks[min(1, len(peaks) - 1)], peaks[-1]
    grown = {k: [b - a for a, b in zip(ref[k], last[k])] for k in ("fds", "threads", "shm")}
    flat = all(v <= 64 * MiB for v in rss_above) and all(v <= 0 for k in ("threads", "shm") for v in grown[k]) \
        and all(v <= 4 for v in grown["fds"])
    return {"tasks": tasks, "trace": trace, "after_first_round": first, "round_peaks": peaks,
            "rss_above_first_round": rss_above, "last_round_above_second": grown, "flat": flat}


def main(quick: bool = False) -> dict:
    import tempfile

    width, layers, rows, steps = (256, 8, 8, 2) if quick else (1024, 96, 32, 3)
    ok, reason = common.nbddp_status()
    out: dict[str, Any] = {"model": {"width": width, "layers": layers, "rows": rows, "steps": steps}, "nbddp": reason}
    if not ok:
        out["skipped"] = reason
        return out
    common.nbddp_start(2)
    try:
        out["fits"] = orders(width, layers, rows, steps)
        out["fits_summary"] = summarize_fits(out["fits"])
        with tempfile.TemporaryDirectory(prefix="nbddp-soak-") as folder:
            out["soak"] = soak(12 if quick else 50, 768 if not quick else 128, 16 if not quick else 4, folder)
    finally:
        common.nbddp_stop()
    print_tables(out)
    return out


def print_tables(out: dict) -> None:
    rows = [{"order": o, "strategy": r["strategy"], "peak MiB": [p // MiB for p in r["peak_mem"]],
             "base MiB": [b // MiB if b else None for b in r["base_mem"]],
             "rss before": [b // MiB for b in r["rss_before"]], "rss after": [a // MiB for a in r["rss_after"]],
             "samples/s": r["samples_per_s"]} for o, fits in out["fits"].items() for r in fits]
    common.print_table(rows, title="\n== memory: fits of the model, in both orders on fresh workers ==")
    s = out["soak"]
    rows = [{"round": i + 1, **{f"{k} max": v if k != "rss" else [x // MiB for x in v] for k, v in peak.items()}}
            for i, peak in enumerate(s["round_peaks"])]
    common.print_table(rows, title=f"== soak, {s['tasks']} tasks: each round's highest level per worker (rss in MiB); "
                                   f"flat: {s['flat']} ==")


def summary_rows(res: dict) -> list[dict]:
    if "fits_summary" not in res:
        return [{"bench": NAME, "competitor": "-", "metric": "skipped", "median": None, "ratio_of": res.get("skipped")}]
    s, rows = res["fits_summary"], []
    for order, ratios in s["fsdp_over_ddp_peak"].items():
        rows.append({"bench": NAME, "competitor": f"fsdp ({order})", "metric": "peak_mem / DDP's",
                     "median": max(ratios), "ratio": max(ratios), "ratio_of": "ddp, worst rank (goal <= 0.6)"})
    for strategy, spread in s["order_spread"].items():
        rows.append({"bench": NAME, "competitor": strategy, "metric": "peak_mem order spread", "median": spread,
                     "ratio": None, "ratio_of": "goal <= 0.1"})
    soaked = res["soak"]
    rows.append({"bench": NAME, "competitor": f"soak ({soaked['tasks']} tasks)", "metric": "RSS MiB above round 1",
                 "median": max(soaked["rss_above_first_round"]) / MiB, "ratio": None, "ratio_of": "goal <= 64"})
    rows.append({"bench": NAME, "competitor": f"soak ({soaked['tasks']} tasks)", "metric": "fds, threads, shm: last "
                 "round above round 2", "median": max(max(v) for v in soaked["last_round_above_second"].values()),
                 "ratio": None, "ratio_of": f"flat: {soaked['flat']}"})
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
