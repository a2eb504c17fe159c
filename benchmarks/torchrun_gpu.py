"""The GPU benchmark's workloads and baseline loop; run as a script, its torchrun job.

``bench_gpu.py`` compares four ways of training the same model on the same
data: nbddp's ``dist_fit``, a plain single-process loop, ``nn.DataParallel``
and a torchrun DDP job. The three baselines share ONE loop, ``train_steps``,
defined here, so they differ only in how the model is wrapped and launched:

* plain: this loop in one process on one device (``bench_gpu`` calls it);
* DataParallel: the same loop over ``nn.DataParallel(model)`` with the batch
  of all visible GPUs together;
* torchrun: this file's ``main`` under ``python -m torch.distributed.run``,
  one process per GPU, the model wrapped in DDP, a ``DistributedSampler``.

The loop mirrors nbddp's worker loop (``nbddp/worker/training/loop.py``): ``(x, y)``
batches moved with ``non_blocking`` on CUDA, forward and cross-entropy inside
``torch.autocast`` for ``bf16`` / ``16-mixed``, a ``torch.amp.GradScaler`` for
``16-mixed``, SGD, ``zero_grad(set_to_none=True)``, the loss summed on the
device and read back every ``log_every`` steps. It runs ``warmup`` steps,
synchronises (CUDA + a barrier under DDP), then times ``steps`` more.

Start the torchrun job by hand with::

    python -m torch.distributed.run --nproc_per_node=1 --master_addr 127.0.0.1 --master_port 29513 \\
        benchmarks/torchrun_gpu.py --workload conv --precision bf16 --warmup 30 --steps 100

Rank 0 prints one line ``BENCH_JSON {...}`` (``loop_s`` = the timed window)
that ``benchmarks.common.run_torchrun`` parses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from typing import Any

_T_IMPORT0 = time.perf_counter()

import sys as _sys
from pathlib import Path as _Path

if __package__ in (None, ""):  # run as a file by torchrun: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import common  # noqa: E402

PRECISIONS = ("32", "bf16", "16-mixed")

# Model and data sizes per workload: "gpu" for the H200 run, "cpu" for the CPU stand-in.
SIZES: dict[str, dict[str, dict[str, Any]]] = {
    # a small ResNet: stem + 3 stages (width, 2x, 4x) of 2 BasicBlocks with BatchNorm, 3x32x32 inputs
    "conv": {
        "gpu": {"width": 64, "blocks": 2, "batch_size": 256, "lr": 0.05},
        "cpu": {"width": 8, "blocks": 1, "batch_size": 16, "lr": 0.05},
    },
    # a pre-norm transformer encoder over token ids, mean-pooled, 10 classes
    "transformer": {
        "gpu": {"d_model": 256, "layers": 4, "heads": 4, "seq": 128, "vocab": 1024, "batch_size": 64, "lr": 0.05},
        "cpu": {"d_model": 32, "layers": 2, "heads": 2, "seq": 32, "vocab": 256, "batch_size": 8, "lr": 0.05},
    },
}
CLASSES = 10


# --------------------------------------------------------------------------
# workloads
# --------------------------------------------------------------------------


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with BatchNorm and a residual connection (ResNet's basic block)."""
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    """A small ResNet for 3x32x32 images: stem, 3 stages (width, 2x, 4x; stride 2 between), pool, linear."""
    def __init__(self, width: int = 64, blocks: int = 2, classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        layers, cin = [], width
        for i, cout in enumerate((width, 2 * width, 4 * width)):
            for b in range(blocks):
                layers.append(BasicBlock(cin, cout, 2 if (i > 0 and b == 0) else 1))
                cin = cout
        self.stages = nn.Sequential(*layers)
        self.head = nn.Linear(cin, classes)

    def forward(self, x):
        h = self.stages(self.stem(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(h, 1), 1))


class TinyTransformer(nn.Module):
    """Token ids -> embedding + learned positions -> pre-norm encoder layers -> mean pool -> classes."""
    def __init__(self, vocab: int = 1024, d_model: int = 256, layers: int = 4, heads: int = 4,
                 seq: int = 128, classes: int = CLASSES):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, classes)

    def forward(self, x):
        h = self.encoder(self.embed(x) + self.pos[:, : x.shape[1]])
        return self.head(self.norm(h).mean(dim=1))


class AutocastForward(nn.Module):
    """``inner`` run under ``torch.autocast("cuda", dtype)`` inside ``forward``.

    ``nn.DataParallel`` runs its replicas in threads and re-enters autocast there
    with ``enabled`` only, not the dtype (``torch/nn/parallel/parallel_apply.py``),
    so a bf16 autocast around the call becomes fp16 in the replicas. Setting the
    dtype inside forward keeps each replica in the precision asked for.
    """

    def __init__(self, inner: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.inner = inner
        self.dtype = dtype

    def forward(self, x):
        with torch.autocast("cuda", dtype=self.dtype):
            return self.inner(x)


def workload_cfg(workload: str, size: str, **over: Any) -> dict[str, Any]:
    """One workload's settings (model sizes, per-rank batch, lr) for ``size`` "gpu" or "cpu"."""
    cfg: dict[str, Any] = {"workload": workload, "seed": 0}
    cfg.update(SIZES[workload][size])
    cfg.update(over)
    return cfg


def make_model(cfg: dict[str, Any]):
    """The seeded model of ``cfg``: the same initial weights for every competitor."""
    torch.manual_seed(int(cfg.get("seed", 0)))
    if cfg["workload"] == "conv":
        return ConvNet(width=int(cfg["width"]), blocks=int(cfg["blocks"]))
    if cfg["workload"] == "transformer":
        return TinyTransformer(vocab=int(cfg["vocab"]), d_model=int(cfg["d_model"]), layers=int(cfg["layers"]),
                               heads=int(cfg["heads"]), seq=int(cfg["seq"]))
    raise ValueError(f"unknown workload {cfg['workload']!r}")


def make_data(cfg: dict[str, Any], n_samples: int):
    """Fixed synthetic ``(x, y)``: conv -> float (n, 3, 32, 32); transformer -> token ids (n, seq)."""
    g = torch.Generator().manual_seed(int(cfg.get("seed", 0)) + 1)
    if cfg["workload"] == "conv":
        x = torch.randn((n_samples, 3, 32, 32), generator=g)
        y = torch.randint(0, CLASSES, (n_samples,), generator=g)
    else:
        x = torch.randint(0, int(cfg["vocab"]), (n_samples, int(cfg["seq"])), generator=g)
        y = x[:, 0] % CLASSES  # learnable: the class is the first token's residue
    return x, y


def loader_kwargs(use_cuda: bool) -> dict[str, Any]:
    """nbddp's DataLoader defaults (``nbddp/worker/data/datasets.py``): 2 workers + pinned memory on GPU, none on CPU."""
    return {"num_workers": 2, "pin_memory": True} if use_cuda else {"num_workers": 0, "pin_memory": False}


def precision_tools(precision: str, device):
    """(autocast context factory, GradScaler or None), as nbddp's loop does."""
    if precision == "bf16":
        return (lambda: torch.autocast(device.type, dtype=torch.bfloat16)), None
    if precision == "16-mixed":
        if device.type != "cuda":
            raise RuntimeError("precision '16-mixed' needs CUDA")
        return (lambda: torch.autocast("cuda", dtype=torch.float16)), torch.amp.GradScaler("cuda")
    if precision != "32":
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return contextlib.nullcontext, None


def train_steps(model, loader, device, precision: str, warmup: int, steps: int, lr: float,
                log_every: int = 10, barrier=None) -> dict[str, Any]:
    """``warmup`` untimed steps, then ``steps`` timed ones; returns the timed window's numbers.

    ``samples`` counts the timed window on THIS process (the caller scales by
    the world size). ``barrier`` (DDP) is called at both ends of the window.
    """
    autocast, scaler = precision_tools(precision, device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    non_blocking = device.type == "cuda"
    acc = torch.zeros((), device=device, dtype=torch.float64)
    total = warmup + steps
    samples = 0
    t0 = None
    last_loss = None
    it = iter(loader)
    model.train()
    for step in range(total):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
        try:
            xb, yb = next(it)
        except StopIteration as exc:
            raise RuntimeError(f"the loader ran out after {step} of {total} steps: give it more samples") from exc
        xb = xb.to(device, non_blocking=non_blocking)
        yb = yb.to(device, non_blocking=non_blocking)
        with autocast():
            loss = F.cross_entropy(model(xb), yb)
        scaled = loss.float()
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        acc.add_(loss.detach())
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
        if t0 is not None:
            samples += int(xb.shape[0])
        if (step + 1) % log_every == 0 or step + 1 == total:
            last_loss = acc.item() / ((step % log_every) + 1)
            acc.zero_()
    if t0 is None:  # steps == 0
        t0 = time.perf_counter()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if barrier is not None:
        barrier()
    loop_s = time.perf_counter() - t0
    return {"loop_s": loop_s, "timed_steps": steps, "warmup_steps": warmup, "samples_local": samples,
            "final_loss": last_loss}


def cuda_memory(reset: bool = False) -> dict[str, Any]:
    """This process's CUDA memory on its current device (then reset the peak when ``reset``).

    Also called on nbddp's workers through ``nbddp.run``.
    """
    if not torch.cuda.is_available():
        return {"device": "cpu"}
    torch.cuda.init()  # the allocator's stats functions fail on a process that has not initialised CUDA yet
    dev = torch.cuda.current_device()
    out = {"device": f"cuda:{dev}", "cuda_peak": int(torch.cuda.max_memory_allocated(dev)),
           "cuda_allocated": int(torch.cuda.memory_allocated(dev)), "cuda_reserved": int(torch.cuda.memory_reserved(dev))}
    if reset:
        torch.cuda.reset_peak_memory_stats(dev)
    return out


# --------------------------------------------------------------------------
# the torchrun job
# --------------------------------------------------------------------------


def run_ddp(cfg: dict[str, Any]) -> dict[str, Any]:
    """One DDP job in this process (env:// rendezvous); every rank returns its numbers."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    t_setup0 = time.perf_counter()
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    use_cuda = torch.cuda.is_available() and cfg.get("backend", "auto") in ("auto", "nccl")
    backend = cfg.get("backend", "auto")
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(int(cfg.get("threads") or common.CPU_THREADS_PER_RANK))
    dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world)
    t_init = time.perf_counter()

    batch = int(cfg["batch_size"])
    total = int(cfg["warmup"]) + int(cfg["steps"])
    model = make_model(cfg).to(device)
    ddp = DDP(model, device_ids=[local_rank] if use_cuda else None)
    x, y = make_data(cfg, world * batch * total)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=False)
    loader = DataLoader(ds, batch_size=batch, sampler=sampler, **loader_kwargs(use_cuda))
    dist.barrier()
    t_loop = time.perf_counter()
    res = train_steps(ddp, loader, device, cfg["precision"], int(cfg["warmup"]), int(cfg["steps"]),
                      float(cfg["lr"]), int(cfg.get("log_every") or 10), barrier=dist.barrier)
    mem = cuda_memory() if use_cuda else {"device": "cpu"}
    mem["rank"] = rank
    mems: list[Any] = [None] * world
    dist.all_gather_object(mems, mem)
    total_samples = torch.tensor([res["samples_local"]], dtype=torch.long, device=device)
    dist.all_reduce(total_samples)
    samples = int(total_samples.item())
    res.update({
        "rank": rank,
        "world_size": world,
        "backend": backend,
        "device": str(device),
        "samples": samples,
        "samples_per_s": samples / res["loop_s"] if res["loop_s"] > 0 else None,
        "ranks": mems,
        "init_s": t_init - t_setup0,
        "setup_s": t_loop - t_setup0,
        "cfg": cfg,
    })
    return res


def parse_args(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, choices=sorted(SIZES))
    ap.add_argument("--precision", default="32", choices=PRECISIONS)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--batch-size", type=int, default=None, help="per rank")
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--size", default=None, choices=["gpu", "cpu"], help="model sizes (default: gpu with CUDA)")
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    ap.add_argument("--threads", type=int, default=common.CPU_THREADS_PER_RANK, help="torch threads per CPU rank")
    # the model sizes may be given one by one (bench_gpu passes its whole cfg)
    for name in ("width", "blocks", "d-model", "layers", "heads", "seq", "vocab"):
        ap.add_argument(f"--{name}", type=int, default=None)
    args = dict(vars(ap.parse_args(argv)))
    size = args.pop("size") or ("gpu" if torch.cuda.is_available() else "cpu")
    cfg = workload_cfg(args.pop("workload"), size)
    cfg.update({k: v for k, v in args.items() if v is not None})
    return cfg


def main(argv=None) -> None:
    import torch.distributed as dist

    cfg = parse_args(argv)
    res = run_ddp(cfg)
    res["import_s"] = time.perf_counter() - _T_IMPORT0
    if res["rank"] == 0:  # before the teardown: a crash there must not lose a finished measurement
        print(common.JSON_MARKER + json.dumps(res), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
