"""Training throughput: plain torchrun DDP vs nbddp.dist_fit (live off / on).

Same workload for every competitor (benchmarks.common.make_model/make_data:
an MLP on 16k x 256 random samples and a small CNN on 8k 1x28x28 images, 10
classes, batch 64 per rank, SGD, no shuffle), 2 ranks, gloo + 1 thread per rank
on CPU (nccl, cuda:LOCAL_RANK on GPUs). The competitors alternate in one run.

Throughput = samples trained / training-loop seconds measured on the workers
(torchrun_train.py's own clock; nbddp's ``hist.timings['train_s']``).
Reported: medians, and nbddp / torchrun ratios (1.0 = as fast as torchrun).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "throughput"


def world_size() -> int:
    n = common.cuda_count()
    return min(2, n) if n else 2


def main(quick: bool = False, kinds: tuple[str, ...] = ("mlp", "cnn"), reps: int | None = None) -> dict:
    reps = reps or (1 if quick else 5)
    world = world_size()
    ok, reason = common.nbddp_status()
    out: dict = {"world_size": world, "reps": reps, "nbddp": reason, "workloads": {}}
    started = False
    if ok:
        try:
            out["nbddp_start_s"] = common.nbddp_start(world)
            started = True
        except Exception as exc:
            ok, reason = False, f"nbddp.start failed: {type(exc).__name__}: {exc}"
            out["nbddp"] = reason
    if not ok:
        common.log(f"nbddp side skipped: {reason}")
    try:
        for kind in kinds:
            cfg = common.workload_cfg(kind, quick)
            data = common.make_data(kind, cfg["n_samples"], seed=cfg["seed"])

            def nb(live: bool, kind=kind, cfg=cfg, data=data):
                model = common.make_model(kind, seed=cfg["seed"])
                return common.nbddp_fit(model, data, cfg, live=live, world=world)

            comps = {"torchrun": lambda cfg=cfg: common.run_torchrun(cfg, nproc=world)}
            if ok:
                comps["nbddp_live_off"] = lambda: nb(False)
                comps["nbddp_live_on"] = lambda: nb(True)
            if ok:  # the first dist_fit after start pays seconds of worker set-up: keep it out
                common.log(f"throughput/{kind}: untimed nbddp warm-up fit")
                nb(False)
            raw = common.alternate(comps, reps=reps, label=f"throughput/{kind}")

            summary = {}
            for name, results in raw.items():
                loop_key = "loop_s" if name == "torchrun" else "train_s"
                summary[name] = {
                    "samples_per_s": common.summarize(common.field_values(results, "samples_per_s")),
                    "loop_s": common.summarize(common.field_values(results, loop_key)),
                    "wall_s": common.summarize(common.field_values(results, "wall_s")),
                    "errors": common.errors_of(results),
                }
            tr = summary["torchrun"]["samples_per_s"]["median"]
            ratios = {}
            for name in ("nbddp_live_off", "nbddp_live_on"):
                if name in summary:
                    ratios[f"{name}/torchrun"] = common.ratio(summary[name]["samples_per_s"]["median"], tr)
                    ratios[f"{name}/torchrun_paired"] = common.paired_ratios(raw[name], raw["torchrun"], "samples_per_s")
            out["workloads"][kind] = {"cfg": cfg, "summary": summary, "ratios": ratios, "raw": raw}
            rows = [
                {
                    "competitor": n,
                    "samples/s (median)": s["samples_per_s"]["median"],
                    "min": s["samples_per_s"]["min"],
                    "max": s["samples_per_s"]["max"],
                    "loop s": s["loop_s"]["median"],
                    "call wall s": s["wall_s"]["median"],
                    "vs torchrun": common.ratio(s["samples_per_s"]["median"], tr),
                    "paired ratio (median)": ratios.get(f"{n}/torchrun_paired", {}).get("median", 1.0 if n == "torchrun" else None),
                    "errors": len(s["errors"]),
                }
                for n, s in summary.items()
            ]
            common.print_table(rows, title=f"\n== throughput: {kind} ({cfg['n_samples']} samples x {cfg['epochs']} epochs, world {world}) ==")
    finally:
        if started:
            common.nbddp_stop()
    return out


def summary_rows(res: dict) -> list[dict]:
    rows = []
    for kind, w in res.get("workloads", {}).items():
        for name, s in w["summary"].items():
            rows.append({
                "bench": f"throughput/{kind}",
                "competitor": name,
                "metric": "samples/s",
                "median": s["samples_per_s"]["median"],
                "ratio": w["ratios"].get(f"{name}/torchrun", 1.0 if name == "torchrun" else None),
                "ratio_of": "x torchrun",
            })
            if name != "torchrun" and f"{name}/torchrun_paired" in w["ratios"]:
                rows.append({"bench": f"throughput/{kind}", "competitor": name, "metric": "paired ratio",
                             "median": w["ratios"][f"{name}/torchrun_paired"]["median"], "ratio_of": "median of per-rep x torchrun"})
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
