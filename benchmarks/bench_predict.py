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
* ``call_vs_worker_loop``: the same, with the script's loop run inside the
  warm workers (``nbddp.run``) right after each call: the same processes
  under the same load, so the ratio moves less with the machine's load than
  ``call_vs_loop``, whose torchrun job starts fresh processes;
* ``return_gbps``: output bytes / (the slowest rank's writing or packing of
  its outputs + the kernel's loading), i.e. how fast the outputs come back:
  on one host the ranks write each batch into the call's shared file inside
  their loop (``pack_s`` sums those writes), and the kernel maps the file.

An A/B of a change to this path: ``python benchmarks/ab_trees.py OLD_TREE NEW_TREE``
(this benchmark from each tree in turn).

In ``benchmarks/run_all.py``. ``--quick``: 2,048 samples, one turn. The
suite's smoke run (``run_all.run(reuse_workers=True)``) leaves the torchrun
side out: one more torchrun launch (two processes importing torch) costs
more than the rest of this benchmark there, and the smoke run keeps one
launch per competitor path; the figures come from a full run.

Run: ``python benchmarks/bench_predict.py [--quick] [--out PATH]`` (JSON in ``benchmarks/results/``).
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

NAME = "predict"
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


def block_loop(n: int) -> tuple:
    """The script's inference loop on this rank's block, barrier to barrier: ``(outputs, seconds)``.

    Run by each torchrun rank, and by the warm workers themselves
    (``worker_loop_once``): the same loop in nbddp's own processes.
    """
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader

    rank, world = dist.get_rank(), dist.get_world_size()
    model, ds = make_model().eval(), make_data(n)
    loader = DataLoader(ds, batch_size=BATCH, sampler=range(rank * n // world, (rank + 1) * n // world))
    dist.barrier()
    t0 = time.perf_counter()
    with torch.inference_mode():
        part = torch.cat([model(x) for (x,) in loader])
    dist.barrier()
    return part, time.perf_counter() - t0


def worker_loop_once(n: int) -> dict:
    """The script's loop run on the warm workers (``nbddp.run``): the same processes, the same load as the call."""
    import nbddp

    return {"loop_s": max(nbddp.run(lambda: block_loop(n)[1]))}


def script(n: int, out_path: str) -> None:
    """The torchrun side: one rank's block, its file, rank 0 joins them; prints one JSON line."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    part, loop_s = block_loop(n)
    t0 = time.perf_counter() - loop_s
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
    from benchmarks import common

    n = 2048 if quick else 65536
    smoke = quick and common.REUSE_TORCHRUN is not None  # the suite's smoke run: see the module docstring
    common.nbddp_start(2)  # 1 torch thread per CPU rank, as the torchrun side (OMP_NUM_THREADS=1)
    try:
        nbddp_once(256)  # warm: the first call imports on the workers
        rows: dict[str, list] = {"nbddp": [], "worker_loop": [], "torchrun": []}
        for _ in range(1 if quick else reps):  # alternating
            rows["nbddp"].append(nbddp_once(n))
            rows["worker_loop"].append(worker_loop_once(n))
            if not smoke:
                rows["torchrun"].append(torchrun_once(n))
    finally:
        common.nbddp_stop()
    best = min(rows["nbddp"], key=lambda r: r["call_s"])
    loop = min((r["loop_s"] for r in rows["torchrun"]), default=None)
    return {"n": n, "out_bytes": best["bytes"], "raw": rows, "torchrun_skipped": smoke,
            "call_vs_loop": loop / best["call_s"] if loop is not None else None,
            "call_vs_worker_loop": min(r["loop_s"] for r in rows["worker_loop"]) / best["call_s"],
            "return_gbps": max(r["return_gbps"] for r in rows["nbddp"])}


def summary_rows(res: dict) -> list[dict]:
    """nbddp's whole call against the script's inference loop (best turns); how fast outputs come back."""
    call = min(r["call_s"] for r in res["raw"]["nbddp"])
    rows = [{"bench": NAME, "competitor": "nbddp", "metric": "whole call s", "median": call,
             "ratio": res["call_vs_loop"], "ratio_of": "torchrun loop s / nbddp call s (goal >= 0.95)"},
            {"bench": NAME, "competitor": "nbddp", "metric": "outputs back GB/s", "median": res["return_gbps"],
             "ratio": None, "ratio_of": "goal >= 1"},
            {"bench": NAME, "competitor": "nbddp", "metric": "whole call s, against the loop in the workers",
             "median": call, "ratio": res.get("call_vs_worker_loop"),
             "ratio_of": "the script's loop run in the warm workers s / nbddp call s"}]
    if res["raw"]["torchrun"]:
        loop = min(r["loop_s"] for r in res["raw"]["torchrun"])
        rows.append({"bench": NAME, "competitor": "torchrun", "metric": "inference loop s", "median": loop,
                     "ratio": None, "ratio_of": "-"})
    return rows


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
        from benchmarks import common

        result = main(args.quick)
        print(json.dumps(result, indent=1))
        common.write_json({NAME: result}, name=NAME, path=args.out or None)
