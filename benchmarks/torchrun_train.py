"""Plain PyTorch DDP training script: the baseline nbddp is compared against.

Start it with torchrun::

    python -m torch.distributed.run --nproc_per_node=2 --master_addr 127.0.0.1 \\
        --master_port 29512 benchmarks/torchrun_train.py --model mlp --n-samples 16384

Each rank builds the same model (seeded) and the same fixed random data, wraps
the model in DDP, and trains with a DataLoader over a DistributedSampler
(shuffle=False), SGD and cross-entropy, calling ``loss.item()`` every
``log_every`` steps (as nbddp does to log). Backend: nccl with
``cuda:LOCAL_RANK`` when CUDA is available, else gloo on CPU.

The training loop is timed on the workers: barrier, start clock, all epochs,
(cuda synchronize), barrier, stop clock. Rank 0 prints one line
``BENCH_JSON {...}`` with ``loop_s``, ``samples_per_s`` and the setup times.

``run_ddp(cfg)`` is the whole job as a function; bench_latency reuses it inside
``accelerate.notebook_launcher`` so both launchers run the identical loop.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

_T_IMPORT0 = time.perf_counter()

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file by torchrun: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402


def run_ddp(cfg: dict, destroy: bool = True) -> dict:
    """One DDP training job in this process (env:// rendezvous). Returns results.

    ``destroy=False`` leaves the process group up, so the caller can report
    the results before tearing it down (see ``main``).
    """
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    t_setup0 = time.perf_counter()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = cfg.get("backend") or "auto"
    use_cuda = torch.cuda.is_available() and backend in ("auto", "nccl")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(cfg.get("threads") or common.CPU_THREADS_PER_RANK))

    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world)
    t_init = time.perf_counter()

    model = common.make_model(cfg["model"], seed=int(cfg.get("seed", 0))).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    x, y = common.make_data(cfg["model"], int(cfg["n_samples"]), seed=int(cfg.get("seed", 0)))
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    batch = int(cfg["batch_size"])
    # Loader settings mirror nbddp's defaults (2 workers + pinned memory on GPU,
    # none on CPU) so the comparison is about the launcher, not the loader.
    nw = cfg.get("num_workers")
    nw = (2 if use_cuda else 0) if nw is None else int(nw)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, pin_memory=use_cuda, num_workers=nw)
    opt = torch.optim.SGD(ddp.parameters(), lr=float(cfg.get("lr", 0.01)))
    epochs = int(cfg.get("epochs", 1))
    max_steps = int(cfg["max_steps"]) if cfg.get("max_steps") else None
    log_every = int(cfg.get("log_every") or 0)

    dist.barrier()
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    step = 0
    samples = 0
    first_step_s = None
    last_loss = None
    done = False
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            xb = xb.to(device, non_blocking=True)
            yb = yb.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            samples += xb.shape[0]
            if step == 1:
                first_step_s = time.perf_counter() - t0
            if log_every and step % log_every == 0:
                last_loss = loss.item()
            if max_steps and step >= max_steps:
                done = True
                break
        if done:
            break
    if use_cuda:
        torch.cuda.synchronize()
    dist.barrier()
    loop_s = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_SELF)

    total_samples = torch.tensor([samples], dtype=torch.long, device=device)
    dist.all_reduce(total_samples)
    total = int(total_samples.item())
    res = {
        "rank": rank,
        "world_size": world,
        "backend": backend,
        "device": str(device),
        "steps": step,
        "samples": total,
        "loop_s": loop_s,
        # diagnostic: this rank's CPU seconds, page faults and context switches during the loop
        "loop_ru": {k: round(getattr(ru1, f) - getattr(ru0, f), 4) for k, f in
                    (("ut", "ru_utime"), ("st", "ru_stime"), ("minflt", "ru_minflt"),
                     ("nvcsw", "ru_nvcsw"), ("nivcsw", "ru_nivcsw"))},
        "samples_per_s": total / loop_s if loop_s > 0 else None,
        "first_step_s": first_step_s,  # diagnostic: a fresh process's first step (also inside loop_s)
        "init_s": t_init - t_setup0,
        "setup_s": t0 - t_setup0,
        "final_loss": loss.item() if step else None,
        "logged_loss": last_loss,
        "cfg": cfg,
    }
    if destroy:
        dist.destroy_process_group()
    return res


def parse_args(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    ap.add_argument("--n-samples", type=int, default=16384)
    ap.add_argument("--batch-size", type=int, default=64, help="per rank")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max-steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-every", type=int, default=common.LOG_EVERY)
    ap.add_argument("--num-workers", type=int, default=None, help="DataLoader workers (default: 2 on GPU, 0 on CPU)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--threads", type=int, default=common.CPU_THREADS_PER_RANK, help="torch threads per CPU rank")
    return vars(ap.parse_args(argv))


def main(argv=None) -> None:
    import torch.distributed as dist

    cfg = parse_args(argv)
    res = run_ddp(cfg, destroy=False)
    res["import_s"] = time.perf_counter() - _T_IMPORT0
    if res["rank"] == 0:  # before the teardown: a crash there must not lose a finished measurement
        print(common.JSON_MARKER + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
