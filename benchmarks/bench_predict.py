"""``nbddp.predict`` on 2 warm workers against a torchrun inference script doing the same work.

The work: an MLP (``IN -> HIDDEN -> OUT``, seeded) over ``N`` fixed random
samples (seeded, built on each rank: nothing large is shipped), batches of
``BATCH``, under ``torch.inference_mode()``, float32 outputs of ``N x OUT``.

* ``nbddp``: ``nbddp.predict(model, data_factory, batch_size=BATCH)`` on
  workers started once beforehand; the whole call as the notebook sees it,
  outputs in a tensor in this process.
* ``torchrun``: this same file run as a fresh ``torch.distributed.run`` job
  (``--script``): each rank predicts its contiguous block, writes it to a
  file, and rank 0 joins the blocks into one ``torch.save`` file. Its
  ``loop_s`` is the inference loop alone (barrier to barrier), its
  ``write_s`` the writing.

The two alternate in one run. Figures:

* ``call_vs_loop``: the script's inference loop / nbddp's whole call (1.0:
  the call costs no more than the loop it runs; the goal is 0.95 or more);
* ``return_gbps``: output bytes / (the ranks' packing + the kernel's loading),
  i.e. how fast the outputs come back once predicted.

Run: ``python benchmarks/bench_predict.py [--quick]`` (results on stdout as JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

IN, HIDDEN, OUT, BATCH = 256, 1024, 1024, 512


def make_model():
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


def make_data(n: int):
    import torch
    from torch.utils.data import TensorDataset

    return TensorDataset(torch.randn(n, IN, generator=torch.Generator().manual_seed(1)))


def script(n: int, out_path: str) -> None:
    """The torchrun side: one rank's block, its file, rank 0 joins them; prints one JSON line."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model, ds = make_model().eval(), make_data(n)
    block = range(rank * n // world, (rank + 1) * n // world)
    loader = DataLoader(ds, batch_size=BATCH, sampler=block)
    dist.barrier()
    t0 = time.perf_counter()
    with torch.inference_mode():
        part = torch.cat([model(x) for (x,) in loader])
    dist.barrier()
    loop_s = time.perf_counter() - t0
    torch.save(part, f"{out_path}.{rank}")
    dist.barrier()
    if rank == 0:
        torch.save(torch.cat([torch.load(f"{out_path}.{r}") for r in range(world)]), out_path)
        for r in range(world):
            os.unlink(f"{out_path}.{r}")
        print("BENCH_JSON " + json.dumps({"loop_s": loop_s, "write_s": time.perf_counter() - t0 - loop_s}))
    dist.destroy_process_group()


def torchrun_once(n: int) -> dict:
    from benchmarks import common

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "outputs.pt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr", "127.0.0.1",
               "--master_port", str(common.free_port()), __file__, "--script", "--samples", str(n), "--out", out]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                              timeout=600, cwd=str(ROOT))
        wall = time.perf_counter() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH_JSON ")), None)
        if line is None:
            raise RuntimeError(f"torchrun failed ({proc.returncode}): {proc.stderr[-2000:]}")
        return {**json.loads(line.split(" ", 1)[1]), "wall_s": wall}


def nbddp_once(n: int) -> dict:
    import nbddp

    t0 = time.perf_counter()
    handle = nbddp.predict(make_model(), lambda: make_data(n), batch_size=BATCH, live=False, block=False)
    out = handle.wait()
    wall = time.perf_counter() - t0
    t = handle.timings
    nbytes = out.numel() * out.element_size()
    return {"call_s": wall, "bytes": nbytes, **t, "return_gbps": nbytes / 1e9 / (t["pack_s"] + t["load_s"])}


def main(quick: bool = False, reps: int = 3) -> dict:
    import nbddp

    n = 8192 if quick else 65536
    if not nbddp.status()["running"]:
        nbddp.start(n=2, backend="gloo")
    nbddp_once(min(n, 1024))  # warm: the first call imports on the workers
    rows: dict[str, list] = {"nbddp": [], "torchrun": []}
    for _ in range(1 if quick else reps):  # alternating
        rows["nbddp"].append(nbddp_once(n))
        rows["torchrun"].append(torchrun_once(n))
    best = {k: min(v, key=lambda r: r.get("call_s", r.get("loop_s"))) for k, v in rows.items()}
    return {"n": n, "out_bytes": best["nbddp"]["bytes"], "raw": rows,
            "call_vs_loop": best["torchrun"]["loop_s"] / best["nbddp"]["call_s"],
            "return_gbps": max(r["return_gbps"] for r in rows["nbddp"])}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--script", action="store_true")
    ap.add_argument("--samples", type=int, default=0)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.script:
        script(args.samples, args.out)
    else:
        print(json.dumps(main(args.quick), indent=1))
