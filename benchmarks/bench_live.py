"""Cost of the live dashboard: dist_fit(live=True) vs live=False on the MLP.

Modes: ``live_off`` (live=False), ``live_on`` (live=True: outside Jupyter this
is nbddp's text view) and ``live_widget`` (live="widget": the Jupyter
dashboard's code path, widgets + figure, forced in this plain process).

Alternating fits of the same MLP workload as bench_throughput. For each fit:

* ``samples_per_s`` from ``hist.timings['train_s']`` (worker loop time);
* ``wall_s`` of the call;
* ``kernel_cpu_s``: CPU seconds of this (kernel) process during the call, all
  threads, from ``time.process_time()``;
* per-thread CPU from psutil, sampled every 0.2 s by a monitor thread, split
  into the calling (main) thread, threads that already existed, and threads
  born during the call (a live/poller thread shows up there). The monitor's
  own thread is excluded; it runs in both modes alike;
* ``publish_share``: rank 0's ``timings['publish_s']`` / ``train_s``, the
  time the loop spends streaming records to the kernel. Workers stream the
  same way whether ``live`` is on or off (``History`` is built from those
  records), so this is everything the live view can cost the workers; the
  rest of its cost is the kernel CPU above.

Reported: medians, live/off ratios and live - off CPU seconds, also per second
of training.
"""

from __future__ import annotations

import sys as _sys
import threading
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "live"


class ThreadCPU:
    """Per-thread CPU seconds of this process over a window (psutil)."""

    def __init__(self, interval: float = 0.2):
        import psutil

        self._proc = psutil.Process()
        self.interval = interval
        self.first: dict[int, float] = {}
        self.last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-cpu-monitor", daemon=True)
        self._monitor_tid: int | None = None
        self.main_tid = threading.get_native_id()
        self._started = False  # True only for the baseline sample in __enter__

    def _sample(self) -> None:
        for t in self._proc.threads():
            cpu = t.user_time + t.system_time
            self.first.setdefault(t.id, cpu if self._started else 0.0)
            self.last[t.id] = cpu

    def __enter__(self):
        self._started = True
        self._sample()  # baseline of the threads alive now
        self._started = False  # threads first seen later started during the window: baseline 0
        self._thread.start()
        return self

    def _run(self) -> None:
        self._monitor_tid = threading.get_native_id()
        while not self._stop.wait(self.interval):
            self._sample()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def result(self, baseline_tids: set[int]) -> dict:
        deltas = {tid: self.last[tid] - self.first.get(tid, 0.0) for tid in self.last if tid != self._monitor_tid}
        main = deltas.get(self.main_tid, 0.0)
        new = {tid: d for tid, d in deltas.items() if tid not in baseline_tids}
        old_other = sum(d for tid, d in deltas.items() if tid in baseline_tids and tid != self.main_tid)
        return {
            "main_thread_cpu_s": main,
            "other_existing_threads_cpu_s": old_other,
            "new_threads_cpu_s": sum(new.values()),
            "new_threads": len(new),
            "busiest_thread_cpu_s": max(deltas.values()) if deltas else 0.0,
        }


def fit_measured(kind: str, data, cfg: dict, live, world: int) -> dict:
    import psutil

    model = common.make_model(kind, seed=cfg["seed"])
    baseline = {t.id for t in psutil.Process().threads()}
    with ThreadCPU() as mon:
        res = common.nbddp_fit(model, data, cfg, live=live, world=world)
    res.update(mon.result(baseline))
    res["kernel_cpu_per_train_s"] = res["kernel_cpu_s"] / res["train_s"] if res.get("train_s") else None
    # rank 0's time streaming records to the kernel, as a share of its loop: the workers do this whether
    # live is on or off (History needs the records), so it is the whole worker-side cost of streaming
    publish = res["timings"].get("publish_s")
    res["publish_share"] = publish / res["train_s"] if publish is not None and res.get("train_s") else None
    return res


KEYS = ("samples_per_s", "wall_s", "train_s", "kernel_cpu_s", "kernel_cpu_per_train_s", "publish_share",
        "main_thread_cpu_s", "other_existing_threads_cpu_s", "new_threads_cpu_s", "new_threads")


def main(quick: bool = False, reps: int | None = None) -> dict:
    reps = reps or (1 if quick else 5)
    n_cuda = common.cuda_count()
    world = min(2, n_cuda) if n_cuda else 2
    ok, reason = common.nbddp_status()
    cfg = common.workload_cfg("mlp", quick)
    out: dict = {"cfg": cfg, "reps": reps, "world_size": world, "nbddp": reason}
    if not ok:
        common.log(f"skipped: {reason}")
        out["skipped"] = reason
        return out
    data = common.make_data("mlp", cfg["n_samples"], seed=cfg["seed"])
    out["nbddp_start_s"] = common.nbddp_start(world)
    try:
        # untimed first fit: the first dist_fit after start pays seconds of worker set-up
        fit_measured("mlp", data, cfg, False, world)
        raw = common.alternate(
            {"live_off": lambda: fit_measured("mlp", data, cfg, False, world),
             "live_on": lambda: fit_measured("mlp", data, cfg, True, world),
             # the Jupyter dashboard's code path (widgets + matplotlib figure), forced outside Jupyter
             "live_widget": lambda: fit_measured("mlp", data, cfg, "widget", world)},
            reps=reps, label="live")
    finally:
        common.nbddp_stop()
    summary = {name: {k: common.summarize(common.field_values(r, k)) for k in KEYS} | {"errors": common.errors_of(r)}
               for name, r in raw.items()}
    on, off = summary["live_on"], summary["live_off"]
    wid = summary["live_widget"]

    def med(s, k):
        return s[k]["median"]

    cmp = {
        "throughput_on/off": common.ratio(med(on, "samples_per_s"), med(off, "samples_per_s")),
        "wall_on/off": common.ratio(med(on, "wall_s"), med(off, "wall_s")),
        "kernel_cpu_on/off": common.ratio(med(on, "kernel_cpu_s"), med(off, "kernel_cpu_s")),
        "kernel_cpu_extra_s": (med(on, "kernel_cpu_s") - med(off, "kernel_cpu_s"))
        if med(on, "kernel_cpu_s") is not None and med(off, "kernel_cpu_s") is not None else None,
        "kernel_cpu_extra_per_train_s": (med(on, "kernel_cpu_per_train_s") - med(off, "kernel_cpu_per_train_s"))
        if med(on, "kernel_cpu_per_train_s") is not None and med(off, "kernel_cpu_per_train_s") is not None else None,
        "widget_throughput_/off": common.ratio(med(wid, "samples_per_s"), med(off, "samples_per_s")),
        "widget_kernel_cpu_extra_s": (med(wid, "kernel_cpu_s") - med(off, "kernel_cpu_s"))
        if med(wid, "kernel_cpu_s") is not None and med(off, "kernel_cpu_s") is not None else None,
    }
    cmp["throughput_on/off_paired"] = common.paired_ratios(raw["live_on"], raw["live_off"], "samples_per_s")["median"]
    cmp["widget_throughput_/off_paired"] = common.paired_ratios(raw["live_widget"], raw["live_off"], "samples_per_s")["median"]
    cmp["kernel_cpu_on/off_paired"] = common.paired_ratios(raw["live_on"], raw["live_off"], "kernel_cpu_s")["median"]
    cmp["widget_kernel_cpu_/off_paired"] = common.paired_ratios(raw["live_widget"], raw["live_off"], "kernel_cpu_s")["median"]
    out.update(summary=summary, comparison=cmp, raw=raw)
    rows = [
        {
            "mode": name,
            "samples/s": med(s, "samples_per_s"),
            "wall s": med(s, "wall_s"),
            "train s": med(s, "train_s"),
            "kernel CPU s": med(s, "kernel_cpu_s"),
            "CPU s / train s": med(s, "kernel_cpu_per_train_s"),
            "main thr CPU": med(s, "main_thread_cpu_s"),
            "new thr CPU": med(s, "new_threads_cpu_s"),
            "old thr CPU": med(s, "other_existing_threads_cpu_s"),
            "publish/train": med(s, "publish_share"),
            "errors": len(s["errors"]),
        }
        for name, s in summary.items()
    ]
    common.print_table(rows, title=f"\n== live: dashboard cost on mlp ({cfg['n_samples']} x {cfg['epochs']} epochs) ==")
    print("  " + ", ".join(f"{k}={common.fmt(v)}" for k, v in cmp.items()), flush=True)
    return out


def summary_rows(res: dict) -> list[dict]:
    if "skipped" in res:
        return [{"bench": "live", "competitor": "nbddp", "metric": "skipped", "median": None}]
    s, c = res["summary"], res["comparison"]
    return [
        {"bench": "live", "competitor": "live_off", "metric": "samples/s", "median": s["live_off"]["samples_per_s"]["median"]},
        {"bench": "live", "competitor": "live_on", "metric": "samples/s", "median": s["live_on"]["samples_per_s"]["median"],
         "ratio": c["throughput_on/off_paired"], "ratio_of": "x live_off (paired)"},
        {"bench": "live", "competitor": "live_off", "metric": "kernel CPU s", "median": s["live_off"]["kernel_cpu_s"]["median"]},
        {"bench": "live", "competitor": "live_on", "metric": "kernel CPU s", "median": s["live_on"]["kernel_cpu_s"]["median"],
         "ratio": c["kernel_cpu_on/off_paired"], "ratio_of": "x live_off (paired)"},
        {"bench": "live", "competitor": "live_widget", "metric": "samples/s", "median": s["live_widget"]["samples_per_s"]["median"],
         "ratio": c["widget_throughput_/off_paired"], "ratio_of": "x live_off (paired)"},
        {"bench": "live", "competitor": "live_widget", "metric": "kernel CPU s", "median": s["live_widget"]["kernel_cpu_s"]["median"],
         "ratio": c["widget_kernel_cpu_/off_paired"], "ratio_of": "x live_off (paired)"},
        {"bench": "live", "competitor": "all modes", "metric": "rank 0 publish / loop time",
         "median": common.median(r.get("publish_share") for n in res["raw"] for r in res["raw"][n] if isinstance(r, dict))},
    ]


if __name__ == "__main__":
    common.cli(main, NAME)
