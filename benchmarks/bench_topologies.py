"""DDP, FSDP, pipeline and tensor parallelism on one model: memory per rank, throughput, a pipeline's idle time.

One ``nn.Sequential`` of MLP blocks (``fc1``: width -> 4 x width, GELU,
``fc2`` back, with residuals; about 34M fp32 parameters at full size), AdamW,
on 2 ranks (CPU workers with gloo and 1 thread each here; GPUs when visible),
at the same *global* batch for every strategy: DDP and FSDP read ``B / 2``
rows per rank, a 2-stage pipeline (1F1B, 4 micro-batches) and 2-way tensor
parallelism read ``B`` rows per model copy. Measured in one run, alternating:

* **memory per rank**: private (anonymous) resident memory added during the
  fit, sampled every 20 ms (``bench_fsdp.PeakSampler``), on fresh workers
  for each strategy (``nbddp.restart()`` and a tiny fit of it first) started
  with ``MALLOC_MMAP_THRESHOLD_=65536``, so that resident memory follows the
  live tensors and one strategy's freed memory is not reused by the next, as
  ``bench_fsdp.py`` measures; and the parameter bytes each rank holds
  (``History.ranks[i]["param_bytes"]``);
* **throughput**: samples/s over the timed fit's ``train_s``;
* **a pipeline's idle share**: for GPipe with ``m`` = 2, 4, 8 micro-batches,
  the time each stage waits in the schedule's sends and receives (torch's
  ``_wait_batch_p2p``, timed on the workers) over its training time, against
  the schedule's theory for ``p`` stages, ``(p - 1) / (m + p - 1)``. The
  first stage's is the one to compare: it waits for the whole drain of the
  pipeline inside the schedule, while the last stage's tail of idle time
  falls after the schedule (in the next step's first receive or the metrics'
  reduction) and is not counted. The measured share also holds the
  transfers themselves and each micro-batch's fixed costs.

    python benchmarks/bench_topologies.py [--quick]     # -> benchmarks/results/<date>_topologies.json
"""

from __future__ import annotations

import os
import sys as _sys
import time
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks.bench_fsdp import PeakSampler  # noqa: E402

NAME = "topologies"
STAGES = 2


def make_model(width: int, blocks: int):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = nn.Linear(width, 4 * width)
            self.fc2 = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.fc2(F.gelu(self.fc1(x)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(blocks)], nn.Linear(width, 16))


def strategies() -> dict[str, tuple[Any, int]]:
    """name -> (strategy, data-parallel ranks)."""
    import nbddp

    return {"ddp": ("ddp", 2), "fsdp": ("fsdp", 2),
            "pipeline": (nbddp.Pipeline(stages=STAGES, microbatches=4, schedule="1f1b"), 1),
            "tensor": (nbddp.TensorParallel(), 1)}


def one_fit(strategy: Any, dp: int, width: int, blocks: int, batch: int, steps: int) -> dict[str, Any]:
    import nbddp
    import torch
    import torch.nn.functional as F

    model = make_model(width, blocks)
    g = torch.Generator().manual_seed(0)
    n = batch * steps
    data = (torch.randn(n, width, generator=g), torch.randint(0, 16, (n,), generator=g))
    pids = [r["pid"] for r in nbddp.status()["ranks"]]
    with PeakSampler(pids) as sampler:
        h = nbddp.dist_fit(model, data, strategy=strategy, epochs=1, batch_size=batch // dp,
                           optimizer=torch.optim.AdamW, lr=1e-4, loss_fn=F.cross_entropy, shuffle=False, log_every=1,
                           live=False)
    return {"params": sum(p.numel() for p in model.parameters()), "steps": h.steps[-1]["step"],
            "train_s": h.timings["train_s"], "samples_per_s": batch * h.steps[-1]["step"] / h.timings["train_s"],
            "private_added_bytes": sampler.added(), "param_bytes": [r["param_bytes"] for r in h.ranks],
            "cuda_peak": [r.get("cuda_peak") for r in h.ranks]}


def _time_waits() -> None:
    """On a worker: count the seconds the pipeline schedules spend in their p2p waits."""
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules, "_bench_wait_s"):
        inner = schedules._wait_batch_p2p

        def timed(work):
            t0 = time.perf_counter()
            try:
                return inner(work)
            finally:
                schedules._bench_wait_s += time.perf_counter() - t0

        schedules._wait_batch_p2p = timed
    schedules._bench_wait_s = 0.0


def _waited() -> float:
    from torch.distributed.pipelining import schedules

    return schedules._bench_wait_s


def idle_shares(width: int, blocks: int, batch: int, steps: int) -> list[dict[str, Any]]:
    import nbddp
    import torch
    import torch.nn.functional as F

    rows = []
    for m in (2, 4, 8):
        g = torch.Generator().manual_seed(0)
        data = (torch.randn(batch * steps, width, generator=g), torch.randint(0, 16, (batch * steps,), generator=g))
        nbddp.run(_time_waits)
        h = nbddp.dist_fit(make_model(width, blocks), data, strategy=nbddp.Pipeline(stages=STAGES, microbatches=m,
                                                                                     schedule="gpipe"),
                           batch_size=batch, optimizer=torch.optim.AdamW, lr=1e-4, loss_fn=F.cross_entropy,
                           shuffle=False, log_every=steps, live=False)
        waited = nbddp.run(_waited)
        train_s = h.timings["train_s"]
        rows.append({"microbatches": m, "theory": (STAGES - 1) / (m + STAGES - 1),
                     "per_stage": [w / train_s for w in waited], "train_s": train_s})
    return rows


def main(quick: bool = False) -> dict:
    width, blocks = (64, 4) if quick else (1024, 4)  # 4 x 8.4M + head
    batch, steps, reps = (16, 2, 1) if quick else (64, 6, 2)
    ok, reason = common.nbddp_status()
    out: dict[str, Any] = {"world_size": 2, "width": width, "blocks": blocks, "batch": batch, "nbddp": reason}
    if not ok:
        out["skipped"] = reason
        return out
    import cloudpickle

    cloudpickle.register_pickle_by_value(_sys.modules[__name__])  # _time_waits runs on the workers
    out["nbddp_start_s"] = common.nbddp_start(2)
    try:
        runs: dict[str, list[dict]] = {}
        for name, (strategy, dp) in strategies().items():  # warm-up: each strategy's first fit imports its modules
            one_fit(strategy, dp, 64, 2, 16, 1)
        for _ in range(reps):
            for name, (strategy, dp) in strategies().items():
                runs.setdefault(name, []).append(one_fit(strategy, dp, width, blocks, batch, steps))
        idle = idle_shares(width, blocks, batch, steps)
        memory = memory_runs(width, blocks, batch, quick)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        common.nbddp_stop()
    out["runs"] = runs
    out["idle"] = idle
    out["memory_runs"] = memory
    out["summary"] = summarize(runs, idle, memory)
    return out


def memory_runs(width: int, blocks: int, batch: int, quick: bool) -> dict[str, dict]:
    """Each strategy on fresh workers (the smoke run reuses the warm ones: it only checks that the code works)."""
    import nbddp

    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the engines restart() starts
    memory = {}
    for name, (strategy, dp) in strategies().items():
        if not quick:
            nbddp.restart()
            one_fit(strategy, dp, 64, 2, 16, 1)  # what a first fit imports is not the model's
        memory[name] = one_fit(strategy, dp, width, blocks, batch, 2)
    return memory


def summarize(runs: dict[str, list[dict]], idle: list[dict], memory: dict[str, dict]) -> dict[str, Any]:
    def med(name: str, key: str) -> float | None:
        return common.median(v for r in runs[name] for v in (r[key] if isinstance(r[key], list) else [r[key]]))

    speed = {s: med(s, "samples_per_s") for s in runs}
    return {
        "params": runs["ddp"][0]["params"],
        "private_memory_per_rank": {s: max(m["private_added_bytes"]) for s, m in memory.items()},
        "param_bytes_per_rank": {s: runs[s][0]["param_bytes"] for s in runs},
        "samples_per_s": speed,
        "throughput_ratio_over_ddp": {s: common.ratio(v, speed["ddp"]) for s, v in speed.items()},
        "pipeline_idle_share": {r["microbatches"]: {"theory": r["theory"], "measured": r["per_stage"][0],
                                                    "per_stage": r["per_stage"]} for r in idle},
    }


def summary_rows(res: dict) -> list[dict]:
    s = res.get("summary")
    if not s:
        return [{"bench": NAME, "competitor": "-", "metric": "skipped", "median": None, "ratio_of": res.get("skipped")}]
    mb = 1 << 20
    rows = [{"bench": NAME, "competitor": k, "metric": "private MiB / rank", "median": v / mb, "ratio": None,
             "ratio_of": "-"} for k, v in s["private_memory_per_rank"].items()]
    rows += [{"bench": NAME, "competitor": k, "metric": "param MiB / rank", "median": max(v) / mb, "ratio": None,
              "ratio_of": "-"} for k, v in s["param_bytes_per_rank"].items()]
    rows += [{"bench": NAME, "competitor": k, "metric": "samples/s", "median": v,
              "ratio": s["throughput_ratio_over_ddp"][k], "ratio_of": "ddp"} for k, v in s["samples_per_s"].items()]
    rows += [{"bench": NAME, "competitor": f"gpipe m={m}", "metric": "idle share", "median": v["measured"],
              "ratio": common.ratio(v["measured"], v["theory"]), "ratio_of": "theory"}
             for m, v in s["pipeline_idle_share"].items()]
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
