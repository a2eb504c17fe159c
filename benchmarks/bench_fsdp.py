"""Sharded (FSDP2) against replicated (DDP) training: memory per rank, throughput, weights back.

A stack of MLP blocks (Linear(d, 4d), GELU, Linear(4d, d), with residuals) of
about 100M fp32 parameters, AdamW, on 2 ranks (CPU workers with gloo here;
GPUs with nccl when visible). Measured, for the same model, data and steps:

* **memory per rank**: each engine's private (anonymous) resident memory,
  sampled every 20 ms from this process (``/proc/<pid>/status`` ``RssAnon``)
  during the fit, minus what it held just before, on freshly started
  workers (``nbddp.restart()`` and one tiny fit before each such fit: a
  worker's first fit imports modules of its own) started with
  ``MALLOC_MMAP_THRESHOLD_=65536``, so that glibc returns freed tensors to
  the system at once and the resident memory follows the live tensors. (With
  nbddp's default allocator setting, which keeps freed buffers for the next
  step, the resident memory also counts what the allocator keeps: measured
  too, on the throughput runs, as ``kept_buffers_memory_per_rank``.) Private memory is what a
  rank adds: the shipped model reaches the ranks as a shared file mapping,
  which ``peak_mem``'s peak RSS would count once per rank. On GPUs the CUDA
  peak (``History.ranks[i]["cuda_peak"]``) is reported too. Goal: FSDP at
  most 0.6x DDP.
* **throughput**: samples/s of the timed steps (after a warm-up fit).
* **weights back**: ``History.timings["return_s"]``, from rank 0's last step
  to the weights in the notebook's model (FSDP gathers the full state dict to
  rank 0 first).
* **activation checkpointing**: the same private-memory peak with
  ``activation_checkpointing=True`` against without, DDP and FSDP alike, on a
  narrower stack (width 256, 12 blocks) with a large batch (4096 rows per
  rank), where activations, not weights, fill the memory.

    python benchmarks/bench_fsdp.py [--quick]     # -> benchmarks/results/<date>_fsdp.json
"""

from __future__ import annotations

import os
import sys as _sys
import threading
import time
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "fsdp"


def make_model(width: int, blocks: int):
    import torch.nn as nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(width, 4 * width)
            self.down = nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(F.gelu(self.up(x)))

    class MLPStack(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
            self.head = nn.Linear(width, 16)

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return MLPStack()


def _private_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


class PeakSampler:
    """The peak of each pid's private memory above where it started, sampled from a thread."""

    def __init__(self, pids: list[int], every_s: float = 0.02):
        self.pids, self.every_s = pids, every_s
        self.base = {p: _private_bytes(p) for p in pids}
        self.peak = dict(self.base)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for p in self.pids:
                self.peak[p] = max(self.peak[p], _private_bytes(p))

    def __enter__(self) -> "PeakSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def added(self) -> list[int]:
        return [self.peak[p] - self.base[p] for p in self.pids]


def one_fit(strategy: str, width: int, blocks: int, rows: int, steps: int, checkpointing: bool = False) -> dict:
    import gc

    import nbddp
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = make_model(width, blocks)
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    n = rows * 2 * steps
    data = (torch.randn(n, width, generator=g), torch.randint(0, 16, (n,), generator=g))
    pids = [r["pid"] for r in nbddp.status()["ranks"]]
    gc.collect()
    t0 = time.perf_counter()
    with PeakSampler(pids) as sampler:
        h = nbddp.dist_fit(model, data, strategy=strategy, epochs=1, batch_size=rows, optimizer=torch.optim.AdamW,
                           lr=1e-4, loss_fn=F.cross_entropy, shuffle=False, log_every=1, live=False,
                           activation_checkpointing=checkpointing)
    wall = time.perf_counter() - t0
    train_s = h.timings["train_s"]
    return {"strategy": strategy, "params": params, "activation_checkpointing": checkpointing, "rows": rows,
            "steps": h.steps[-1]["step"], "wall_s": wall, "train_s": train_s,
            "samples_per_s": rows * 2 * h.steps[-1]["step"] / train_s, "return_s": h.timings["return_s"],
            "private_added_bytes": sampler.added(), "peak_rss_bytes": [r["peak_mem"] for r in h.ranks],
            "param_bytes": [r["param_bytes"] for r in h.ranks], "cuda_peak": [r.get("cuda_peak") for r in h.ranks]}


def main(quick: bool = False) -> dict:
    width, blocks = (256, 4) if quick else (1024, 12)  # 12 x 8.4M + head: 100.8M parameters
    rows, steps, ac_rows = (8, 2, 64) if quick else (32, 4, 4096)
    ac_width = 64 if quick else 256
    n_cuda = common.cuda_count()
    world = min(2, n_cuda) if n_cuda else 2
    ok, reason = common.nbddp_status()
    out: dict[str, Any] = {"world_size": world, "width": width, "blocks": blocks, "nbddp": reason}
    if not ok:
        out["skipped"] = reason
        return out
    out["nbddp_start_s"] = common.nbddp_start(world)
    try:
        one_fit("fsdp", width, blocks, rows, 1)  # warm-up: imports, first collectives
        runs: dict[str, list[dict]] = {}
        for strategy in ("ddp", "fsdp", "ddp", "fsdp"):  # throughput on warm workers, alternating, twice
            runs.setdefault(strategy, []).append(one_fit(strategy, width, blocks, rows, steps))
        memory: dict[str, dict] = {}
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # inherited by the engines restart() starts
        for strategy in ("ddp", "fsdp"):  # memory on fresh workers, with and without checkpointing
            for width_, rows_, ac in ((width, rows, False), (ac_width, ac_rows, False), (ac_width, ac_rows, True)):
                import nbddp

                if not quick:  # fresh workers (7 s each); the smoke run only checks that the code works
                    nbddp.restart()
                    one_fit(strategy, 64, 2, 4, 1, ac)  # a tiny fit first: what the first fit imports is not the model's
                label = f"{strategy}{' +AC' if ac else ''}{'' if rows_ == rows else f' x{ac_rows}'}"
                memory[label] = one_fit(strategy, width_, blocks, rows_, 1 if rows_ != rows else steps, ac)
    finally:
        os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        common.nbddp_stop()
    out["runs"] = runs
    out["memory_runs"] = memory
    out["summary"] = summarize(runs, memory, ac_rows)
    return out


def summarize(runs: dict[str, list[dict]], memory: dict[str, dict], ac_rows: int) -> dict[str, Any]:
    def med(strategy: str, key: str) -> float | None:
        return common.median(v for r in runs[strategy] for v in (r[key] if isinstance(r[key], list) else [r[key]]))

    mem = {s: max(memory[s]["private_added_bytes"]) for s in ("ddp", "fsdp")}
    kept = {s: med(s, "private_added_bytes") for s in runs}
    speed = {s: med(s, "samples_per_s") for s in runs}
    back = {s: med(s, "return_s") for s in runs}
    ac = {s: (max(memory[f"{s} x{ac_rows}"]["private_added_bytes"]),
              max(memory[f"{s} +AC x{ac_rows}"]["private_added_bytes"])) for s in ("ddp", "fsdp")}
    return {
        "params": runs["ddp"][0]["params"],
        "private_memory_per_rank": mem,
        "memory_ratio_fsdp_over_ddp": common.ratio(mem["fsdp"], mem["ddp"]),
        "kept_buffers_memory_per_rank": kept,
        "samples_per_s": speed,
        "throughput_ratio_fsdp_over_ddp": common.ratio(speed["fsdp"], speed["ddp"]),
        "return_s": back,
        "param_bytes_per_rank": {s: runs[s][0]["param_bytes"] for s in runs},
        "activation_checkpointing_peak": {s: {"without": a, "with": b} for s, (a, b) in ac.items()},
        "activation_checkpointing_ratio": {s: common.ratio(b, a) for s, (a, b) in ac.items()},
    }


def summary_rows(res: dict) -> list[dict]:
    s = res.get("summary")
    if not s:
        return [{"bench": NAME, "competitor": "-", "metric": "skipped", "median": None, "ratio_of": res.get("skipped")}]
    mb = 1 << 20
    rows = [{"bench": NAME, "competitor": k, "metric": "private MiB / rank", "median": v / mb,
             "ratio": s["memory_ratio_fsdp_over_ddp"] if k == "fsdp" else 1.0, "ratio_of": "ddp"}
            for k, v in s["private_memory_per_rank"].items()]
    rows += [{"bench": NAME, "competitor": k, "metric": "samples/s", "median": v,
              "ratio": s["throughput_ratio_fsdp_over_ddp"] if k == "fsdp" else 1.0, "ratio_of": "ddp"}
             for k, v in s["samples_per_s"].items()]
    rows += [{"bench": NAME, "competitor": k, "metric": "weights back s", "median": v, "ratio": None, "ratio_of": "-"}
             for k, v in s["return_s"].items()]
    rows += [{"bench": NAME, "competitor": f"{k} +AC", "metric": "activation peak MiB", "median": None,
              "ratio": v, "ratio_of": k} for k, v in s["activation_checkpointing_ratio"].items()]
    return rows


if __name__ == "__main__":
    common.cli(main, NAME)
