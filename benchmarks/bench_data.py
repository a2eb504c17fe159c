"""Loader worker processes inside the engines: ``num_workers`` 0 against 2 on slow data, in one run.

Each sample costs 2 ms to produce (``time.sleep(0.002)``, standing for
decoding an image or reading a file), and the model is one small Linear
layer, so the data pipeline sets the pace. Two forms of the same data:

* **map**: a map-style ``Dataset`` whose ``__getitem__`` takes 2 ms
  (``DistributedSampler`` shards it);
* **stream**: an ``IterableDataset`` whose ``__iter__`` takes 2 ms per
  sample; it shards itself (``shards_itself = True``) by rank and loader
  worker, so that each reader produces only its own samples. (Under nbddp's
  default rank-strided split every reader reads the whole stream and keeps
  its part: right for cheap reads, no help for an expensive one.)

Each competitor is one ``dist_fit`` on 2 ranks (CPU workers with gloo here),
alternating, on warm workers. samples/s = samples trained /
``timings['train_s']``: the loop time on the workers, the loader workers'
start included (they are started once per fit and persist across epochs).
The ratio is ``num_workers=2`` over ``num_workers=0``; with 2 ms of waiting
per sample, two loader workers should come close to 2x.

    python benchmarks/bench_data.py [--quick]     # -> benchmarks/results/<date>_data.json
"""

from __future__ import annotations

import sys as _sys
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "data"
DELAY_S = 0.002
WIDTH = 16


def make_data(form: str, n: int) -> Any:
    """The slow data, built here (classes local to a function travel to the engines by value)."""
    import time

    import torch
    from torch.utils.data import Dataset, IterableDataset

    def item(i: int) -> tuple[Any, Any]:
        time.sleep(DELAY_S)
        g = torch.Generator().manual_seed(i)
        return torch.randn(WIDTH, generator=g), torch.tensor(i % 4)

    class SlowMap(Dataset):
        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int) -> tuple[Any, Any]:
            return item(i)

    class SlowStream(IterableDataset):
        shards_itself = True  # reads only its own samples: a strided split would make every reader pay for all

        def __iter__(self):
            import os

            from torch.utils.data import get_worker_info

            info = get_worker_info()  # RANK and WORLD_SIZE: every engine's, inherited by its loader workers
            workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
            parts = int(os.environ["WORLD_SIZE"]) * workers
            for i in range(int(os.environ["RANK"]) * workers + worker, n, parts):
                yield item(i)

    return SlowMap() if form == "map" else SlowStream()


def one_fit(form: str, workers: int, n: int, batch: int) -> dict:
    import nbddp
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    torch.manual_seed(0)
    h = nbddp.dist_fit(nn.Linear(WIDTH, 4), make_data(form, n), epochs=2, batch_size=batch, num_workers=workers,
                       loss_fn=F.cross_entropy, optimizer=torch.optim.SGD, lr=0.01, shuffle=False, live=False)
    samples = sum(r["samples"] for r in h.ranks)
    return {"form": form, "num_workers": workers, "steps": h.steps[-1]["step"], "samples": samples,
            "train_s": h.timings["train_s"], "samples_per_s": samples / h.timings["train_s"]}


def main(quick: bool = False) -> dict:
    n, batch, reps = (128, 16, 1) if quick else (1280, 32, 3)
    ok, reason = common.nbddp_status()
    out: dict[str, Any] = {"samples": n, "batch_size": batch, "delay_s": DELAY_S, "reps": reps, "nbddp": reason}
    if not ok:
        out["skipped"] = reason
        return out
    out["nbddp_start_s"] = common.nbddp_start(2)
    try:
        one_fit("map", 2, 64, 16)  # warm-up: the first fit's imports, the first loader workers
        comps = {f"{form} nw={w}": (lambda form=form, w=w: one_fit(form, w, n, batch))
                 for form in ("map", "stream") for w in (0, 2)}
        raw = common.alternate(comps, reps=reps, label=NAME)
    finally:
        common.nbddp_stop()
    out["raw"] = raw
    out["summary"] = {
        form: {
            "samples_per_s": {w: common.summarize(common.field_values(raw[f"{form} nw={w}"], "samples_per_s"))
                              for w in (0, 2)},
            "ratio_nw2_over_nw0": common.paired_ratios(raw[f"{form} nw=2"], raw[f"{form} nw=0"], "samples_per_s"),
            "errors": common.errors_of(raw[f"{form} nw=0"]) + common.errors_of(raw[f"{form} nw=2"]),
        }
        for form in ("map", "stream")
    }
    rows = [{"form": form, "nw=0 samples/s": s["samples_per_s"][0]["median"],
             "nw=2 samples/s": s["samples_per_s"][2]["median"], "ratio": s["ratio_nw2_over_nw0"]["median"]}
            for form, s in out["summary"].items()]
    common.print_table(rows, title=f"\n== data: num_workers 0 vs 2, {DELAY_S * 1e3:g} ms per sample, 2 ranks ==")
    return out


def summary_rows(res: dict) -> list[dict]:
    s = res.get("summary")
    if not s:
        return [{"bench": NAME, "competitor": "-", "metric": "skipped", "median": None, "ratio_of": res.get("skipped")}]
    return [{"bench": f"{NAME}/{form}", "competitor": f"num_workers={w}", "metric": "samples/s",
             "median": f["samples_per_s"][w]["median"],
             "ratio": f["ratio_nw2_over_nw0"]["median"] if w == 2 else 1.0, "ratio_of": "num_workers=0"}
            for form, f in s.items() for w in (0, 2)]


if __name__ == "__main__":
    common.cli(main, NAME)
