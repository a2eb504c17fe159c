"""The GPU path, measured: nbddp ``dist_fit`` vs a plain loop vs torchrun vs ``nn.DataParallel``.

On the same GPUs (all visible ones; one is fine), the same two workloads,
each in precision ``32``, ``bf16`` and ``16-mixed``:

* ``conv``: a small ResNet (3 stages of BasicBlocks with BatchNorm) on
  synthetic 3x32x32 images, 256 per GPU per step;
* ``transformer``: 4 pre-norm encoder layers, d=256, sequence 128, synthetic
  tokens, mean-pooled classification, 64 sequences per GPU per step.

Competitors (``benchmarks/torchrun_gpu.py`` holds the models, the data and
the ONE loop the three baselines share):

* ``nbddp``: ``dist_fit(precision=...)`` on ``nbddp.start(n=gpus)`` (nccl),
  workers started once for the whole benchmark;
* ``plain``: the loop in this process on ``cuda:0``, no wrapper;
* ``dataparallel``: the loop over ``nn.DataParallel`` (all GPUs, the batch of
  all of them together; with one GPU it does not replicate);
* ``torchrun``: a fresh ``torchrun`` DDP job, one process per GPU, only for
  ``32`` and ``bf16`` (each job costs several seconds of start-up).

Every competitor runs ``warmup`` steps, then ``steps`` timed ones, with the
same per-GPU batch, the same seeded initial weights and the same data.
samples/s covers the timed steps only: the baselines synchronise CUDA (and a
barrier) at both ends; for nbddp it is read from ``history.steps`` (records
carry ``step`` and ``time``, taken after a reduction that synchronises the
device): from the first record at or after the warm-up to the last one.
Peak CUDA memory per rank is ``torch.cuda.max_memory_allocated`` (reset
before each run; on nbddp's workers through ``nbddp.run``, and also
``history.ranks`` when this nbddp has it). Also measured for nbddp: the
weights' round trip FROM CUDA (a model living on ``cuda:0`` in the kernel,
shipped, trained, loaded back: ``timings['ship_s']`` / ``['return_s']`` and a
check that the weights are on the model's own device again), and
``prefetch=0`` vs ``prefetch=1`` (recorded as not supported when this
nbddp's ``dist_fit`` rejects the option).

Without CUDA a tiny CPU version of the same comparison runs instead (2 CPU
workers with gloo for nbddp and torchrun, ``32`` and ``bf16``, a few steps,
small models) and the result lists what it ``skipped`` and why.

    python benchmarks/bench_gpu.py [--quick] [--out PATH]   # -> benchmarks/results/<YYYY-MM-DD>_gpu.json

One H200: about 2-3 minutes (budget 4); CPU here: about a minute.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import functools
import os
import platform
import shlex
import shutil
import subprocess
import sys as _sys
import time
from pathlib import Path as _Path
from typing import Any, Callable

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from benchmarks import torchrun_gpu as tg  # noqa: E402

NAME = "gpu"
WORKLOADS = ("conv", "transformer")
COMPETITORS = ("nbddp", "plain", "dataparallel", "torchrun")
TORCHRUN_PRECISIONS = ("32", "bf16")  # the torchrun jobs are kept to 4: fp32 and bf16 of each workload
TORCHRUN_SCRIPT = common.BENCH_DIR / "torchrun_gpu.py"
MiB = 1 << 20


# --------------------------------------------------------------------------
# plan and environment
# --------------------------------------------------------------------------


def plan(quick: bool, n_gpu: int) -> dict[str, Any]:
    """What to run on this machine: GPU sizes with CUDA, a tiny CPU stand-in without."""
    if n_gpu:
        warmup, steps, log_every = (5, 20, 5) if quick else (30, 100, 10)
        return {"mode": "gpu", "size": "gpu", "world_size": n_gpu, "backend": "nccl", "device": "cuda:0",
                "precisions": ["32", "bf16", "16-mixed"], "torchrun_precisions": list(TORCHRUN_PRECISIONS),
                "warmup": warmup, "steps": steps, "log_every": log_every,
                "prefetch": {"workload": "conv", "precision": "bf16"},
                "roundtrip_steps": 5, "predict_samples": 65536, "budget_s": 120 if quick else 230}
    warmup, steps, log_every = (2, 4, 2) if quick else (3, 9, 3)
    return {"mode": "cpu", "size": "cpu", "world_size": 2, "backend": "gloo", "device": "cpu",
            "precisions": ["32", "bf16"], "torchrun_precisions": ["32"],
            "warmup": warmup, "steps": steps, "log_every": log_every,
            "prefetch": {"workload": "conv", "precision": "32"},
            "roundtrip_steps": 2, "predict_samples": 2048, "budget_s": 150}


def cpu_skips() -> list[dict[str, str]]:
    """The GPU parts a CPU-only run leaves out, each with its reason."""
    skips = [
        {"part": "gpu", "reason": "no CUDA GPU visible: ran the tiny CPU version (2 gloo CPU workers, small models)"},
        {"part": "dataparallel", "reason": "nn.DataParallel splits a batch over CUDA GPUs; there are none"},
        {"part": "precision 16-mixed", "reason": "fp16 with a GradScaler needs CUDA (nbddp refuses it on CPU)"},
        {"part": "nccl", "reason": "no CUDA: nbddp and torchrun use gloo on CPU"},
        {"part": "cuda_roundtrip", "reason": "no CUDA: a model cannot live on cuda in the kernel"},
        {"part": "peak_cuda_memory", "reason": "no CUDA: torch.cuda.max_memory_allocated has nothing to measure"},
        {"part": "torchrun bf16", "reason": "CPU run: torchrun for fp32 only (each job costs 6-30 s on 2 busy cores)"},
    ]
    return skips


def _nvidia_smi(*args: str) -> str | None:
    try:
        proc = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def gpu_environment() -> dict[str, Any]:
    """Date, host, GPUs, torch / CUDA / cuDNN / NCCL / driver versions, nbddp's version."""
    import torch

    info: dict[str, Any] = {
        "date": _dt.date.today().isoformat(),
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": common.cuda_count(),
        "gpus": [],
        "cudnn": None,
        "nccl": None,
        "driver": None,
        "nvidia_smi_L": _nvidia_smi("-L"),
        "tf32": {"cudnn": torch.backends.cudnn.allow_tf32, "matmul": torch.backends.cuda.matmul.allow_tf32},
        "cpu_count": os.cpu_count(),
        "dev_shm_bytes": None,
    }
    with contextlib.suppress(OSError):
        info["dev_shm_bytes"] = shutil.disk_usage("/dev/shm").total
    if info["gpu_count"]:
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(info["gpu_count"])]
        info["cudnn"] = torch.backends.cudnn.version()
        with contextlib.suppress(Exception):
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        driver = _nvidia_smi("--query-gpu=driver_version", "--format=csv,noheader")
        info["driver"] = driver.splitlines()[0].strip() if driver else None
    with contextlib.suppress(Exception):
        import nbddp

        info["nbddp"] = getattr(nbddp, "__version__", "?")
    return info


# --------------------------------------------------------------------------
# competitors
# --------------------------------------------------------------------------


def _cell_cfg(p: dict[str, Any], workload: str, precision: str) -> dict[str, Any]:
    return tg.workload_cfg(workload, p["size"], precision=precision, warmup=p["warmup"], steps=p["steps"],
                           log_every=p["log_every"])


def _n_samples(p: dict[str, Any], cfg: dict[str, Any], world: int) -> int:
    """Exactly one epoch of ``warmup + steps`` full batches on each of ``world`` ranks."""
    return world * int(cfg["batch_size"]) * (p["warmup"] + p["steps"])


@contextlib.contextmanager
def _cpu_threads(n: int | None):
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _release_cuda() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_plain(p: dict[str, Any], cfg: dict[str, Any], data: tuple, wrap: str | None = None) -> dict[str, Any]:
    """The shared loop in this process: on one device (``wrap=None``) or over ``nn.DataParallel``."""
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    use_cuda = p["mode"] == "gpu"
    device = torch.device(p["device"])
    n_dev = p["world_size"] if wrap == "dataparallel" else 1
    batch = int(cfg["batch_size"]) * n_dev  # DataParallel: the per-GPU batch on every GPU
    if use_cuda:
        torch.cuda.init()  # reset_peak_memory_stats fails before CUDA is initialised in this process
        for i in range(n_dev):
            torch.cuda.reset_peak_memory_stats(i)
    model = tg.make_model(cfg).to(device)
    autocast_inside = wrap == "dataparallel" and n_dev > 1 and cfg["precision"] != "32"
    if autocast_inside:  # DataParallel's replica threads would drop autocast's dtype (bf16 -> fp16)
        model = tg.AutocastForward(model, torch.bfloat16 if cfg["precision"] == "bf16" else torch.float16)
    if wrap == "dataparallel":
        model = torch.nn.DataParallel(model, device_ids=list(range(n_dev)))
    loader = DataLoader(TensorDataset(*data), batch_size=batch, shuffle=False, **tg.loader_kwargs(use_cuda))
    try:
        with _cpu_threads(None if use_cuda else common.CPU_THREADS_PER_RANK):  # one CPU rank's threads
            res = tg.train_steps(model, loader, device, cfg["precision"], p["warmup"], p["steps"], float(cfg["lr"]),
                                 p["log_every"])
        peaks = [int(torch.cuda.max_memory_allocated(i)) for i in range(n_dev)] if use_cuda else None
    finally:
        del model, loader
        _release_cuda()
    return {"world_size": n_dev, "samples_per_s": res["samples_local"] / res["loop_s"], "window_s": res["loop_s"],
            "timed_steps": res["timed_steps"], "batch_per_step": batch, "final_loss": res["final_loss"],
            "peak_mem_per_rank": peaks, **({"autocast_inside_forward": True} if autocast_inside else {})}


@contextlib.contextmanager
def _torchrun_script(path: _Path):
    """``common.run_torchrun`` launches ``common.TORCHRUN_SCRIPT``: point it at ours for a while."""
    old = common.TORCHRUN_SCRIPT
    common.TORCHRUN_SCRIPT = path
    try:
        yield
    finally:
        common.TORCHRUN_SCRIPT = old


def run_torchrun(p: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """A fresh torchrun job of ``torchrun_gpu.py`` (via ``common.run_torchrun``: retries, JSON parsing)."""
    args = dict(cfg, size=p["size"], backend=p["backend"])
    with _torchrun_script(TORCHRUN_SCRIPT):
        res = common.run_torchrun(args, nproc=p["world_size"], timeout=300)
    ranks = res.get("ranks") or []
    peaks = [r.get("cuda_peak") for r in ranks] if p["mode"] == "gpu" else None
    out = {"world_size": res["world_size"], "samples_per_s": res["samples_per_s"], "window_s": res["loop_s"],
           "timed_steps": res["timed_steps"], "final_loss": res["final_loss"], "peak_mem_per_rank": peaks,
           "job_wall_s": res["wall_s"], "job_overhead_s": res["overhead_s"]}
    for key in ("teardown_error", "retried"):
        if key in res:
            out[key] = res[key]
    return out


def _records_window(steps: list[dict[str, Any]], warmup: int) -> tuple[int, float]:
    """(steps, seconds) from the first record at or after ``warmup`` to the last record."""
    recs = [r for r in steps if isinstance(r.get("step"), (int, float)) and isinstance(r.get("time"), (int, float))]
    if len(recs) < 2:
        raise RuntimeError(f"history.steps has {len(recs)} timed record(s); two are needed to time the window")
    last = recs[-1]
    first = next((r for r in recs[:-1] if r["step"] >= warmup), None)
    if first is None:
        raise RuntimeError(f"no record at or after step {warmup} before the last one (steps {[r['step'] for r in recs]})")
    return int(last["step"] - first["step"]), float(last["time"] - first["time"])


def _ranks_of(history: Any) -> list[dict[str, Any]] | None:
    """``history.ranks`` (being added to nbddp) as plain dicts, or None where this nbddp lacks it."""
    ranks = getattr(history, "ranks", None)
    if not ranks:
        return None
    keep = ("rank", "device", "peak_mem", "cuda_allocated", "cuda_reserved", "cuda_peak", "samples_per_s")
    return [{k: r.get(k) for k in keep if k in r} if isinstance(r, dict) else {"value": repr(r)} for r in ranks]


def run_nbddp(p: dict[str, Any], cfg: dict[str, Any], data: Any, model: Any = None, max_steps: int | None = None,
              **extra: Any) -> dict[str, Any]:
    """One ``dist_fit``; ``extra`` options are passed as they are (an unknown one raises TypeError)."""
    import nbddp
    import torch
    import torch.nn.functional as F

    use_cuda = p["mode"] == "gpu"
    if use_cuda:
        nbddp.run(tg.cuda_memory, reset=True)
    model = tg.make_model(cfg) if model is None else model
    total = max_steps or (p["warmup"] + p["steps"])
    t0 = time.perf_counter()
    hist = nbddp.dist_fit(model, data, epochs=1, max_steps=total, batch_size=int(cfg["batch_size"]),
                          loss_fn=F.cross_entropy, optimizer=torch.optim.SGD, lr=float(cfg["lr"]), shuffle=False,
                          precision=cfg["precision"], log_every=p["log_every"], live=False, **extra)
    wall = time.perf_counter() - t0
    if getattr(hist, "status", "completed") != "completed":
        raise RuntimeError(f"dist_fit ended with status {hist.status!r}")
    world = int(getattr(hist, "world_size", 0) or p["world_size"])
    timings = {k: v for k, v in (getattr(hist, "timings", {}) or {}).items() if isinstance(v, (int, float))}
    steps = list(getattr(hist, "steps", []) or [])
    out: dict[str, Any] = {"world_size": world, "call_wall_s": wall, "timings": timings,
                           "transfers": dict(getattr(hist, "transfers", {}) or {}),
                           "final_loss": steps[-1].get("loss") if steps else None}
    if max_steps is None:
        n_steps, secs = _records_window(steps, p["warmup"])
        out.update({"samples_per_s": n_steps * int(cfg["batch_size"]) * world / secs, "window_s": secs,
                    "timed_steps": n_steps})
        if timings.get("train_s"):
            out["whole_loop_samples_per_s"] = total * int(cfg["batch_size"]) * world / timings["train_s"]
    out["peak_mem_per_rank"] = [m.get("cuda_peak") for m in nbddp.run(tg.cuda_memory)] if use_cuda else None
    ranks = _ranks_of(hist)
    out["history_ranks"] = ranks if ranks is not None else "history.ranks: not in this nbddp"
    return out


def run_cuda_roundtrip(p: dict[str, Any], cfg: dict[str, Any], data: Any) -> dict[str, Any]:
    """A model living on cuda:0 in this process, shipped, trained a few steps, loaded back."""
    import torch

    model = tg.make_model(cfg).to(p["device"])
    home = {name: t.device for name, t in model.state_dict().items()}
    before = {name: t.detach().cpu().clone() for name, t in model.state_dict().items()}
    try:
        res = run_nbddp(p, cfg, data, model=model, max_steps=p["roundtrip_steps"])
        after = model.state_dict()
        res.update({
            "model_device": str(next(iter(home.values()))),
            "weights_on_home_device": all(after[n].device == d for n, d in home.items()),
            "weights_changed": any(not torch.equal(before[n], after[n].detach().cpu())
                                   for n in before if after[n].is_floating_point()),
            "weights_finite": all(bool(torch.isfinite(t).all()) for t in after.values() if t.is_floating_point()),
            "ship_s": res["timings"].get("ship_s"),
            "return_s": res["timings"].get("return_s"),
        })
    finally:
        del model
        _release_cuda()
    return res


def run_predict(p: dict[str, Any]) -> dict[str, Any]:
    """``nbddp.predict`` in bf16 on the workers' devices, outputs back in this process (issue 32 on the GPU).

    bench_predict's MLP (1024 outputs a sample) over ``predict_samples`` seeded samples built on each rank:
    the whole call, the ranks' loop, how fast the outputs came back (their writes + this process's load), and
    a check that they are in the dataset's order (the first and last 4 rows against the model run here).
    """
    import torch

    import nbddp
    from benchmarks import bench_predict as bp

    n = p["predict_samples"]
    t0 = time.perf_counter()
    handle = nbddp.predict(bp.make_model(), functools.partial(bp.make_data, n), batch_size=bp.BATCH,
                           precision="bf16", live=False, block=False)
    out = handle.wait()
    call_s = time.perf_counter() - t0
    t = dict(handle.timings)
    nbytes = out.numel() * out.element_size()
    x = bp.make_data(n).tensors[0]
    rows = torch.cat([x[:4], x[-4:]]).to(p["device"])
    with torch.inference_mode(), torch.autocast(torch.device(p["device"]).type, dtype=torch.bfloat16):
        ref = bp.make_model().to(p["device"]).eval()(rows).float().cpu()
    got = torch.cat([out[:4], out[-4:]]).float()
    return {"samples": n, "call_s": call_s, "bytes": nbytes, "dtype": str(out.dtype), "timings": t,
            "samples_per_s": n / call_s, "return_gbps": nbytes / 1e9 / (t["pack_s"] + t["load_s"]),
            "in_order": bool(torch.allclose(got, ref, rtol=0.05, atol=0.05)),
            "max_abs_diff": float((got - ref).abs().max())}


# --------------------------------------------------------------------------
# workers
# --------------------------------------------------------------------------


class _Workers:
    """nbddp's workers for the whole benchmark: reuse a running set that fits, else start one (and stop it)."""

    def __init__(self, p: dict[str, Any]):
        self.p = p
        self.started_here = False
        self.start_s: float | None = None
        self._old_path: str | None = None
        self._path_set = False

    def start(self) -> None:
        import nbddp

        st = nbddp.status()
        if st.get("running") and st.get("world_size") == self.p["world_size"] and st.get("backend") == self.p["backend"]:
            return  # e.g. the test suite's shared workers: left running at the end
        if st.get("running"):
            nbddp.stop()
        # the workers unpickle the models by reference (benchmarks.torchrun_gpu): they must import this repo,
        # and the same nbddp as this process (first on their path, whatever else PYTHONPATH holds)
        import nbddp

        self._old_path, self._path_set = os.environ.get("PYTHONPATH"), True
        nbddp_root = os.path.dirname(os.path.dirname(os.path.abspath(nbddp.__file__)))
        parts = [nbddp_root, str(common.REPO_ROOT), *(self._old_path or "").split(os.pathsep)]
        os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in parts if p))
        self.started_here = True
        self.start_s = common.nbddp_start(self.p["world_size"], backend=self.p["backend"])

    def stop(self) -> None:
        if self.started_here:
            common.nbddp_stop()
            self.started_here = False
        if self._path_set:
            if self._old_path is None:
                os.environ.pop("PYTHONPATH", None)
            else:
                os.environ["PYTHONPATH"] = self._old_path
            self._path_set = False


# --------------------------------------------------------------------------
# the benchmark
# --------------------------------------------------------------------------


def _err(exc: BaseException) -> dict[str, str]:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000]}


def _measure(label: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    common.log(label)
    try:
        return fn()
    except Exception as exc:  # one failed measurement must not stop the others
        res = _err(exc)
        common.log(f"{label} FAILED: {res['error'][:300]}")
        return res


def _mib(values: Any) -> str | None:
    if not values:
        return None
    vals = [v for v in values if isinstance(v, (int, float))]
    return "/".join(f"{v / MiB:.0f}" for v in vals) if vals else None


def table_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in res.get("rows", []):
        note = r.get("error") or r.get("skipped") or ""
        rows.append({"workload": r["workload"], "precision": r["precision"], "competitor": r["competitor"],
                     "world": r.get("world_size"), "samples/s": r.get("samples_per_s"),
                     "vs torchrun": r.get("vs_torchrun"), "peak MiB/rank": _mib(r.get("peak_mem_per_rank")),
                     "steps": r.get("timed_steps"), "note": note[:70]})
    return rows


def main(quick: bool = False, out: str | os.PathLike | None = None, command: str | None = None) -> dict[str, Any]:
    """Run the comparison; write ``out`` (JSON) after every cell when given; return the results."""
    t_begin = time.perf_counter()
    n_gpu = common.cuda_count()
    p = plan(quick, n_gpu)
    res: dict[str, Any] = {
        **gpu_environment(),
        "command": command or f"benchmarks.bench_gpu.main(quick={quick})",
        "mode": p["mode"],
        "quick": quick,
        "settings": {**p, "workloads": {w: tg.workload_cfg(w, p["size"]) for w in WORKLOADS},
                     "optimizer": "SGD", "loss": "cross_entropy", "shuffle": False,
                     "loader": tg.loader_kwargs(p["mode"] == "gpu"),
                     "torchrun_note": "torchrun runs only for precisions " + ", ".join(p["torchrun_precisions"])
                                      + ": each job starts fresh processes (several seconds each)",
                     "dataparallel_note": "DataParallel gets the per-GPU batch times the GPU count; with one GPU it does not replicate",
                     "plain_note": "plain trains on one device alone: with N GPUs its vs_torchrun is about 1/N at best",
                     "samples_per_s": "timed steps only (after warm-up); nbddp: from history.steps records"},
        "rows": [],
        "skipped": [] if n_gpu else cpu_skips(),
    }
    if not n_gpu:
        print("[gpu] no CUDA GPU visible: running the tiny CPU version; skipped: "
              + "; ".join(f"{s['part']} ({s['reason']})" for s in res["skipped"][1:]), flush=True)

    def save() -> None:
        res["wall_s"] = time.perf_counter() - t_begin
        if out is not None:
            common.write_json({NAME: res}, path=out)

    def over_budget(what: str) -> bool:
        if time.perf_counter() - t_begin > p["budget_s"]:
            res["skipped"].append({"part": what, "reason": f"time budget of {p['budget_s']} s spent"})
            common.log(f"skipping {what}: time budget spent")
            return True
        return False

    ok, reason = common.nbddp_status()
    res["nbddp"] = reason
    # the same seeded data everywhere: tensors here for plain / DataParallel; for nbddp a factory that builds
    # them on each worker (nothing to ship: a large dataset through a small /dev/shm would fail), torchrun builds its own
    sizes = {w: _n_samples(p, tg.workload_cfg(w, p["size"]), p["world_size"]) for w in WORKLOADS}
    datasets = {w: tg.make_data(tg.workload_cfg(w, p["size"]), sizes[w]) for w in WORKLOADS}
    factories = {w: functools.partial(tg.make_data, tg.workload_cfg(w, p["size"]), sizes[w]) for w in WORKLOADS}
    res["settings"]["n_samples"] = sizes
    workers = _Workers(p)
    try:
        if ok:
            try:
                workers.start()
                res["nbddp_start_s"] = workers.start_s
            except Exception as exc:
                ok, res["nbddp"] = False, f"nbddp.start failed: {type(exc).__name__}: {exc}"
                common.log(res["nbddp"])
        if ok:  # the first fit after start pays worker set-up (and ships the data, which then stays resident)
            for w in WORKLOADS:
                _measure(f"gpu: untimed nbddp warm-up fit ({w})",
                         lambda w=w: run_nbddp(p, _cell_cfg(p, w, "32"), factories[w], max_steps=2))
        # 1. the weights' round trip from a model living on CUDA in this process
        if n_gpu and ok:
            res["cuda_roundtrip"] = {w: _measure(f"gpu: cuda round trip ({w})",
                                                 lambda w=w: run_cuda_roundtrip(p, _cell_cfg(p, w, "32"), factories[w]))
                                     for w in WORKLOADS}
        # 1b. predict in bf16 on the workers' devices, outputs back here
        if ok and not over_budget("predict"):
            res["predict"] = _measure("gpu: nbddp.predict bf16", lambda: run_predict(p))
        save()
        # 2. the cells: workload x precision, competitors in an order rotated per cell
        cell = 0
        for w in WORKLOADS:
            for prec in p["precisions"]:
                cfg = _cell_cfg(p, w, prec)
                comps: dict[str, Callable[[], dict[str, Any]]] = {}
                skipped: dict[str, str] = {}
                if ok:
                    comps["nbddp"] = lambda cfg=cfg, w=w: run_nbddp(p, cfg, factories[w])
                else:
                    skipped["nbddp"] = res["nbddp"]
                comps["plain"] = lambda cfg=cfg, w=w: run_plain(p, cfg, datasets[w])
                if n_gpu:
                    comps["dataparallel"] = lambda cfg=cfg, w=w: run_plain(p, cfg, datasets[w], wrap="dataparallel")
                else:
                    skipped["dataparallel"] = "no CUDA: nn.DataParallel needs GPUs"
                if prec in p["torchrun_precisions"]:
                    comps["torchrun"] = lambda cfg=cfg: run_torchrun(p, cfg)
                else:
                    skipped["torchrun"] = f"torchrun runs only for {', '.join(p['torchrun_precisions'])} (job start-up costs)"
                names = list(comps)
                order = names[cell % len(names):] + names[:cell % len(names)]
                cell += 1
                got: dict[str, dict[str, Any]] = {}
                for name in order:
                    if over_budget(f"{w}/{prec}/{name}"):
                        got[name] = {"skipped": "time budget spent"}
                        continue
                    got[name] = _measure(f"gpu: {w} {prec} {name}", comps[name])
                tr = got.get("torchrun", {}).get("samples_per_s")
                for name in COMPETITORS:
                    row = {"workload": w, "precision": prec, "competitor": name}
                    if name in got:
                        row.update(got[name])
                        row["vs_torchrun"] = common.ratio(row.get("samples_per_s"), tr)
                    else:
                        row["skipped"] = skipped.get(name, "not run")
                    res["rows"].append(row)
                save()
        # 3. prefetch off vs on (an option being added to dist_fit)
        if ok and not over_budget("prefetch"):
            w, prec = p["prefetch"]["workload"], p["prefetch"]["precision"]
            cfg = _cell_cfg(p, w, prec)
            pref: dict[str, Any] = {"workload": w, "precision": prec}
            for value in (0, 1):
                try:
                    common.log(f"gpu: {w} {prec} nbddp prefetch={value}")
                    pref[f"prefetch={value}"] = run_nbddp(p, cfg, factories[w], prefetch=value)
                except TypeError as exc:
                    if "prefetch" not in str(exc):
                        pref[f"prefetch={value}"] = _err(exc)
                        continue
                    pref = {"workload": w, "precision": prec, "prefetch": "prefetch: not supported by this nbddp",
                            "detail": str(exc)[:300]}
                    common.log("prefetch: not supported by this nbddp")
                    break
                except Exception as exc:
                    pref[f"prefetch={value}"] = _err(exc)
            a, b = (pref.get(f"prefetch={v}", {}) for v in (0, 1))
            if isinstance(a, dict) and isinstance(b, dict):
                pref["on_vs_off"] = common.ratio(b.get("samples_per_s"), a.get("samples_per_s"))
            res["prefetch"] = pref
    finally:
        workers.stop()
    save()
    common.print_table(table_rows(res), title=f"\n== gpu path ({p['mode']}, world {p['world_size']}, "
                                              f"{p['warmup']} warm-up + {p['steps']} timed steps) ==")
    if "prefetch" in res:
        pf = res["prefetch"]
        print(pf.get("prefetch") or f"prefetch: on/off samples/s ratio {common.fmt(pf.get('on_vs_off'))}", flush=True)
    for w, rt in (res.get("cuda_roundtrip") or {}).items():
        print(f"cuda round trip ({w}):", rt.get("error") or
              f"ship {common.fmt(rt.get('ship_s'))} s, return {common.fmt(rt.get('return_s'))} s, "
              f"on {rt.get('model_device')} again: {rt.get('weights_on_home_device')}, changed: {rt.get('weights_changed')}",
              flush=True)
    pr = res.get("predict")
    if pr:
        print("predict (bf16):", pr.get("error") or
              f"{pr['samples']} samples in {common.fmt(pr['call_s'])} s, outputs back at "
              f"{common.fmt(pr['return_gbps'])} GB/s, in order: {pr['in_order']}", flush=True)
    if res["skipped"]:
        print("skipped:", "; ".join(f"{s['part']}: {s['reason']}" for s in res["skipped"]), flush=True)
    return res


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for r in res.get("rows", []):
        if r.get("samples_per_s") is not None:
            rows.append({"bench": f"gpu/{r['workload']}/{r['precision']}", "competitor": r["competitor"],
                         "metric": "samples/s", "median": r["samples_per_s"], "ratio": r.get("vs_torchrun"),
                         "ratio_of": "x torchrun"})
    pr = res.get("predict") or {}
    if pr.get("return_gbps") is not None:
        rows.append({"bench": "gpu/predict/bf16", "competitor": "nbddp", "metric": "outputs back GB/s",
                     "median": pr["return_gbps"], "ratio": None, "ratio_of": f"{pr['samples']} samples"})
    for s in res.get("skipped", []):
        rows.append({"bench": "gpu", "competitor": s["part"], "metric": "skipped", "median": None,
                     "ratio_of": s["reason"][:60]})
    return rows


def _cli(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<YYYY-MM-DD>_gpu.json)")
    args = ap.parse_args(argv)
    out = args.out or common.RESULTS_DIR / f"{_dt.date.today().isoformat()}_{NAME}.json"
    command = " ".join(shlex.quote(a) for a in [_sys.executable, *_sys.argv])
    main(quick=args.quick, out=out, command=command)
    return 0


if __name__ == "__main__":
    _sys.exit(_cli())
