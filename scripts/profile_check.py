"""gpu_check.sh's profile step: a merged profiler trace of a few steps on the GPUs, its breakdown, the time split.

On the GPU machine it shows what the CPU suite cannot: CUDA kernels in every
rank's lane, NCCL kernels (with 2 GPUs or more) and the breakdown read from
the kernels (``nbddp.profiling.trace_analysis``). With one GPU it starts 2
ranks sharing it under gloo, so that there is communication to see. Where
Holistic Trace Analysis (``hta``) imports, the profile's summary carries its
temporal breakdown, overlap and idle time by cause of the same traces
(``History.profile["hta"]``, ``nbddp.profiling.hta_analysis``) next to
nbddp's. Without CUDA it runs the same on 2 CPU workers and says so.

    python scripts/profile_check.py [--out DIR] [--steps 3]   # DIR gets the trace and profile.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def start_workers() -> str:
    """Start the workers this machine allows; say which."""
    import torch

    import nbddp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus >= 2:
        nbddp.start()
        return f"{gpus} GPUs, nccl, one rank per GPU"
    nbddp.start(n=2, backend="gloo")
    return "1 GPU shared by 2 ranks under gloo" if gpus == 1 else "no GPU: 2 CPU workers, gloo"


def profiled_fit(steps: int, folder: str) -> Any:
    """A small MLP fit with the profiler over ``steps`` steps after 2 untraced ones."""
    import torch
    import torch.nn as nn

    import nbddp

    width = 1024 if torch.cuda.is_available() else 256  # on 2 CPU cores a 1024-wide step takes a second
    model = nn.Sequential(nn.Linear(width, 4 * width), nn.ReLU(), nn.Linear(4 * width, width))
    n = 64 * 2 * (steps + 6)
    data = (torch.randn(n, width), torch.randn(n, width))
    return nbddp.dist_fit(model, data, epochs=1, max_steps=steps + 4, batch_size=64, lr=0.01,
                          loss_fn=nn.functional.mse_loss, live=False,
                          profile={"wait": 1, "warmup": 1, "active": steps, "dir": folder})


def kernel_counts(path: str) -> dict[int, dict[str, int]]:
    """Per rank: GPU kernels, of which NCCL ones, in the merged trace."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    counts: dict[int, dict[str, int]] = {}
    for e in events:
        if e.get("cat") == "kernel" and isinstance(e.get("pid"), int):
            c = counts.setdefault(e["pid"], {"kernels": 0, "nccl_kernels": 0})
            c["kernels"] += 1
            c["nccl_kernels"] += "nccl" in e.get("name", "").lower()
    return counts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="folder for the trace and profile.json (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=3, help="steps traced")
    args = parser.parse_args()
    import nbddp
    from nbddp.profiling.time_split import summary

    folder = args.out or tempfile.mkdtemp(prefix="nbddp-profile-check-")
    t0 = time.time()
    where = start_workers()
    try:
        print(f"profile check: {where}")
        history = profiled_fit(args.steps, folder)
    finally:
        nbddp.stop()
    # from History.ranks, not History.time_split(): the GPU machine's python may lack pandas
    splits = [r["time_split"] for r in history.ranks]
    for r, split in enumerate(splits):
        print(f"rank {r} time split (s): " + ", ".join(f"{p} {s:.4f}" for p, s in split.items()))
    sentence = summary(splits)
    print("time split:", sentence)
    print(history.profile["summary"])
    kernels = kernel_counts(history.profile["path"]) if history.profile["path"] else {}
    print("GPU kernels per rank:", kernels or "none (a CPU trace)")
    hta = history.profile["hta"]  # HTA's figures where it imports and the ranks ran GPU kernels, else why not
    result = {"where": where, "status": history.status, "time_split": splits,
              "time_split_summary": sentence, "trace": history.profile["path"],
              "breakdown": history.profile["breakdown"], "kernels": kernels, "hta": hta, "wall_s": time.time() - t0}
    with open(os.path.join(folder, "profile.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"profile check: wrote {os.path.join(folder, 'profile.json')} in {result['wall_s']:.0f} s")
    ok = history.status == "completed" and len(history.profile["breakdown"]) == len(history.ranks)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
