"""GPU scaling: samples/s at 1, 2, 4, 8 GPUs (those available), torchrun vs nbddp.

GPU only: without CUDA it prints a message and returns ``{"skipped": ...}``.

Workload: the CNN of bench_throughput with batch 256 per rank on a fixed
dataset (65536 samples, 8192 with --quick), 1 epoch, nccl. For each GPU count
torchrun (fresh job) and nbddp (workers restarted with ``start(n=k)``)
alternate. Efficiency = samples/s at k GPUs / (k * samples/s at 1 GPU).
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "scaling"


def main(quick: bool = False, reps: int | None = None) -> dict:
    n_gpu = common.cuda_count()
    if not n_gpu:
        msg = "no CUDA GPUs: bench_scaling runs only on GPU machines"
        print(f"[scaling] skipped: {msg}", flush=True)
        return {"skipped": msg}
    reps = reps or (1 if quick else 3)
    counts = [k for k in (1, 2, 4, 8) if k <= n_gpu]
    cfg = common.workload_cfg("cnn", quick, n_samples=8192 if quick else 65536, batch_size=256, epochs=1)
    data = common.make_data("cnn", cfg["n_samples"], seed=cfg["seed"])
    ok, reason = common.nbddp_status()
    out: dict = {"gpus": n_gpu, "counts": counts, "cfg": cfg, "reps": reps, "nbddp": reason, "by_count": {}}
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
            raw = common.alternate(comps, reps=reps, warmup=0 if quick else 1, label=f"scaling/{k}gpu")
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
        for k in counts:
            s = out["by_count"][k].get(name)
            if not s:
                continue
            m = s["samples_per_s"]["median"]
            s["efficiency"] = common.ratio(m, k * base) if base and m else None
            tr = out["by_count"][k].get("torchrun", {}).get("samples_per_s", {}).get("median")
            rows.append({"competitor": name, "gpus": k, "samples/s": m, "efficiency": s["efficiency"],
                         "vs torchrun": common.ratio(m, tr), "errors": len(s["errors"])})
    common.print_table(rows, title="\n== scaling: CNN samples/s by GPU count ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    if "skipped" in res:
        return [{"bench": "scaling", "competitor": "-", "metric": "skipped (no GPU)", "median": None}]
    rows = []
    for k, byc in res["by_count"].items():
        tr = byc.get("torchrun", {}).get("samples_per_s", {}).get("median")
        for name in ("torchrun", "nbddp"):
            if name in byc:
                m = byc[name]["samples_per_s"]["median"]
                rows.append({"bench": f"scaling/{k}gpu", "competitor": name, "metric": "samples/s", "median": m,
                             "ratio": common.ratio(m, tr), "ratio_of": "x torchrun"})
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
