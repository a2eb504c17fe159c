"""Weight shipping: models of 1M, 25M and 100M fp32 parameters through dist_fit.

Each fit is ``max_steps=1`` with ``lr=0`` on a tiny batch (so the training loop
is negligible and the weights come back unchanged, which we check). The model
is a stack of Linear(1024, 1024) layers.

GB/s each way = model bytes / ``hist.timings['ship_s']`` (kernel -> workers)
and / ``hist.timings['return_s']`` (workers -> kernel) when nbddp reports those
keys. Note nbddp's ``return_s`` is kernel-side only (unpack + load_state_dict);
the workers' packing of the weights and the reply message land in no key and
are reported as ``unattributed_s`` = total_s - (ship+setup+train+return).
Without those keys only the round trip can be measured: ``(wall - train_s)`` holds
both directions (plus setup), and we report ``bytes / ((wall - train_s) / 2)``
as ``each_way_gbps_est``. Sizes alternate in one run.
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "weights"
WIDTH = 1024


def _fit_once(n_params: int, world: int) -> dict:
    import torch

    torch.manual_seed(0)
    model = common.make_big_model(n_params, width=WIDTH)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    probe_before = next(model.parameters()).detach().flatten()[:64].clone()
    g = torch.Generator().manual_seed(0)
    n = 8 * world
    data = (torch.randn(n, WIDTH, generator=g), torch.randint(0, 10, (n,), generator=g))
    cfg = {"epochs": 1, "batch_size": 8, "lr": 0.0, "log_every": 1}
    res = common.nbddp_fit(model, data, cfg, world=world, max_steps=1)
    t = res["timings"]
    res["n_params"] = common.n_params(model)
    res["bytes"] = nbytes
    res["weights_unchanged"] = bool(torch.equal(next(model.parameters()).detach().flatten()[:64], probe_before))
    gb = nbytes / 1e9
    res["ship_gbps"] = gb / t["ship_s"] if t.get("ship_s") else None
    res["return_gbps"] = gb / t["return_s"] if t.get("return_s") else None
    # what no timing key covers: worker-side packing of the returned weights, messages, waits
    known = sum(t.get(k) or 0.0 for k in ("ship_s", "setup_s", "train_s", "return_s"))
    res["unattributed_s"] = t["total_s"] - known if t.get("total_s") is not None else None
    non_train = res["wall_s"] - (res["train_s"] or 0.0)
    res["non_train_s"] = non_train
    res["each_way_gbps_est"] = gb / (non_train / 2) if non_train > 0 else None
    return res


def main(quick: bool = False, sizes: tuple[int, ...] | None = None, reps: int | None = None) -> dict:
    sizes = sizes or ((1_000_000, 4_000_000) if quick else (1_000_000, 25_000_000, 100_000_000))
    reps = reps or (1 if quick else 3)
    n_cuda = common.cuda_count()
    world = min(2, n_cuda) if n_cuda else 2
    ok, reason = common.nbddp_status()
    out: dict = {"sizes": list(sizes), "reps": reps, "world_size": world, "nbddp": reason}
    if not ok:
        common.log(f"skipped: {reason}")
        out["skipped"] = reason
        return out
    out["nbddp_start_s"] = common.nbddp_start(world)
    try:
        # one small untimed fit so first-call costs do not land on the first size
        _fit_once(sizes[0], world)
        comps = {f"{s / 1e6:g}M": (lambda s=s: _fit_once(s, world)) for s in sizes}
        raw = common.alternate(comps, reps=reps, label="weights")
    finally:
        common.nbddp_stop()

    summary = {}
    for name, results in raw.items():
        good = [r for r in results if "error" not in r]
        summary[name] = {
            "n_params": good[0]["n_params"] if good else None,
            "bytes": good[0]["bytes"] if good else None,
            **{k: common.summarize(common.field_values(results, k)) for k in
               ("ship_gbps", "return_gbps", "each_way_gbps_est", "wall_s", "train_s", "non_train_s", "unattributed_s")},
            "setup_s": common.summarize(r["timings"].get("setup_s") for r in good),
            "ship_s": common.summarize(r["timings"].get("ship_s") for r in good),
            "return_s": common.summarize(r["timings"].get("return_s") for r in good),
            "weights_unchanged": all(r.get("weights_unchanged") for r in good) if good else None,
            "timing_keys": sorted(good[0]["timings"]) if good else [],
            "errors": common.errors_of(results),
        }
    out["summary"] = summary
    out["raw"] = raw
    rows = [
        {
            "model": n,
            "MB": (s["bytes"] or 0) / 1e6,
            "ship s": s["ship_s"]["median"],
            "ship GB/s": s["ship_gbps"]["median"],
            "return s": s["return_s"]["median"],
            "return GB/s": s["return_gbps"]["median"],
            "wall s": s["wall_s"]["median"],
            "setup s": s["setup_s"]["median"],
            "train s": s["train_s"]["median"],
            "unattributed s": s["unattributed_s"]["median"],
            "est GB/s each way": s["each_way_gbps_est"]["median"],
            "unchanged": s["weights_unchanged"],
            "errors": len(s["errors"]),
        }
        for n, s in summary.items()
    ]
    common.print_table(rows, title=f"\n== weights: ship/return through dist_fit (max_steps=1, lr=0, world {world}) ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    rows = []
    for n, s in res.get("summary", {}).items():
        for metric, key in (("ship GB/s", "ship_gbps"), ("return GB/s", "return_gbps"), ("est GB/s each way", "each_way_gbps_est")):
            if s[key]["median"] is not None:
                rows.append({"bench": f"weights/{n}", "competitor": "nbddp", "metric": metric, "median": s[key]["median"]})
    if "skipped" in res:
        rows.append({"bench": "weights", "competitor": "nbddp", "metric": "skipped", "median": None})
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
