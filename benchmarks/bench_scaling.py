"""Scaling: samples/s at 1, 2, 4, 8 GPUs (those available), torchrun vs nbddp.

Workload: the CNN of bench_throughput with batch 256 per rank on a fixed
dataset (65536 samples, 8192 with --quick), 1 epoch, nccl. For each GPU count
torchrun (fresh job) and nbddp (workers restarted with ``start(n=k)``)
alternate. Efficiency = samples/s at k workers / (k * samples/s at 1 worker).

Without CUDA the same code runs on CPU workers instead (gloo, one thread per
rank, 1 and 2 workers up to the machine's cores, 16384 samples; with --quick
bench_throughput's quick CNN job, 1024 samples of batch 64), so every part of
it but nccl runs wherever the suite runs; the rows then say ``cpu`` and
measure CPU scaling, which is not the GPU figure.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "scaling"


def plan(n_gpu: int, cores: int, quick: bool) -> tuple[str, list[int], dict]:
    """(unit, worker counts, workload cfg) for this machine."""
    # largest first: a run that kept the workers of the benchmark before (2 of them) starts with those
    if n_gpu:
        counts = [k for k in (8, 4, 2, 1) if k <= n_gpu]
        cfg = common.workload_cfg("cnn", quick, n_samples=8192 if quick else 65536, batch_size=256, epochs=1)
        return "gpu", counts, cfg
    counts = [k for k in (2, 1) if k <= max(1, cores)]
    # --quick on CPU: bench_throughput's quick CNN job exactly, so the smoke run launches that torchrun job once
    cfg = common.workload_cfg("cnn", True) if quick else common.workload_cfg("cnn", False, n_samples=16384,
                                                                              batch_size=256, epochs=1)
    return "cpu", counts, cfg


def main(quick: bool = False, reps: int | None = None) -> dict:
    import os

    n_gpu = common.cuda_count()
    unit, counts, cfg = plan(n_gpu, os.cpu_count() or 1, quick)
    if not n_gpu:
        print("[scaling] no CUDA GPUs: measuring CPU workers (gloo) instead; not the GPU figure", flush=True)
    reps = reps or (1 if quick else 3)
    data = common.make_data("cnn", cfg["n_samples"], seed=cfg["seed"])
    ok, reason = common.nbddp_status()
    out: dict = {"unit": unit, "gpus": n_gpu, "counts": counts, "cfg": cfg, "reps": reps, "nbddp": reason, "by_count": {}}
    for k in counts:
        comps = {"torchrun": lambda k=k: common.run_torchrun(cfg, nproc=k)}
        started = False
        if ok:
            try:
                common.nbddp_start(k)
                started = True
                comps["nbddp"] = lambda k=k: common.nbddp_fit(common.make_model("cnn", seed=cfg["seed"]), data, cfg, world=k)
            except Exception as exc:
                out["by_count"].setdefault(k, {})["nbddp_start_error"] = f"{type(exc).__name__}: {exc}"
        try:
            raw = common.alternate(comps, reps=reps, warmup=0 if quick else 1, label=f"scaling/{k}{unit}")
        finally:
            if started:
                common.nbddp_stop()
        out["by_count"].setdefault(k, {}).update({
            name: {"samples_per_s": common.summarize(common.field_values(r, "samples_per_s")),
                   "errors": common.errors_of(r)}
            for name, r in raw.items()
        })
        out["by_count"][k]["raw"] = raw
    rows = []
    for name in ("torchrun", "nbddp"):
        base = out["by_count"].get(1, {}).get(name, {}).get("samples_per_s", {}).get("median")
        for k in sorted(counts):
            s = out["by_count"][k].get(name)
            if not s:
                continue
            m = s["samples_per_s"]["median"]
            s["efficiency"] = common.ratio(m, k * base) if base and m else None
            tr = out["by_count"][k].get("torchrun", {}).get("samples_per_s", {}).get("median")
            rows.append({"competitor": name, unit + "s": k, "samples/s": m, "efficiency": s["efficiency"],
                         "vs torchrun": common.ratio(m, tr), "errors": len(s["errors"])})
    common.print_table(rows, title=f"\n== scaling: CNN samples/s by {unit.upper()} worker count ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    if "skipped" in res:  # results written before CPU workers were measured
        return [{"bench": "scaling", "competitor": "-", "metric": "skipped (no GPU)", "median": None}]
    unit = res.get("unit", "gpu")
    rows = []
    for k, byc in sorted(res["by_count"].items(), key=lambda item: int(item[0])):
        tr = byc.get("torchrun", {}).get("samples_per_s", {}).get("median")
        for name in ("torchrun", "nbddp"):
            if name in byc:
                m = byc[name]["samples_per_s"]["median"]
                rows.append({"bench": f"scaling/{k}{unit}", "competitor": name, "metric": "samples/s", "median": m,
                             "ratio": common.ratio(m, tr), "ratio_of": "x torchrun"})
                if byc[name].get("efficiency") is not None:
                    rows.append({"bench": f"scaling/{k}{unit}", "competitor": name, "metric": "efficiency",
                                 "median": byc[name]["efficiency"], "ratio_of": f"samples/s / ({k} x 1 {unit})"})
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
