"""Shared helpers for the nbddp benchmarks.

Everything that more than one ``bench_*.py`` needs lives here: free ports,
statistics, the alternating runner, the workloads (models + fixed random
data, identical for every competitor), launching ``torchrun_train.py`` and
calling ``nbddp.dist_fit``, tables and JSON result files.

Rules every benchmark follows:

* competitors run in ONE process run, alternating (the order rotates each
  repetition), so machine noise hits all of them alike;
* we report medians and ratios of medians, plus the raw values;
* a competitor that fails records ``{"error": ...}`` instead of aborting the
  whole benchmark.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import inspect
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
RESULTS_DIR = BENCH_DIR / "results"
TORCHRUN_SCRIPT = BENCH_DIR / "torchrun_train.py"
JSON_MARKER = "BENCH_JSON "

# Threads per rank on CPU: one, as torchrun does by default with >1 proc.
CPU_THREADS_PER_RANK = 1


# --------------------------------------------------------------------------
# small utilities
# --------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(values: Iterable[float]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def summarize(values: Iterable[float]) -> dict[str, Any]:
    """median / min / max / n / raw values of the non-None numbers."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0, "values": []}
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
    }


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


@contextlib.contextmanager
def timed(store: dict, key: str):
    """``with timed(d, "x"): ...`` puts the wall seconds into ``d["x"]``."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        store[key] = time.perf_counter() - t0


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # pragma: no cover
        return False


def cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # pragma: no cover
        return 0


def environment() -> dict[str, Any]:
    """What machine and versions produced a result."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "time": _dt.datetime.now().isoformat(timespec="seconds"),
    }
    for mod in ("torch", "ipyparallel", "accelerate", "nbddp"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except Exception:
            info[mod] = None
    info["cuda_devices"] = cuda_count()
    if info["cuda_devices"]:
        import torch

        info["cuda_name"] = torch.cuda.get_device_name(0)
    return info


# --------------------------------------------------------------------------
# alternating runner
# --------------------------------------------------------------------------


def alternate(
    competitors: dict[str, Callable[[], Any]],
    reps: int,
    warmup: int = 0,
    label: str = "",
) -> dict[str, list[Any]]:
    """Run every competitor ``reps`` times, interleaved.

    Repetition ``r`` runs the competitors in the order rotated by ``r``
    (A B C, B C A, C A B, ...) so none always goes first. ``warmup`` extra
    untimed rounds run first (results dropped). A competitor that raises gets
    ``{"error": "..."}`` for that repetition and stays in the rotation.
    """
    names = list(competitors)
    out: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(-warmup, reps):
        k = r % len(names) if names else 0
        order = names[k:] + names[:k]
        for name in order:
            tag = "warmup" if r < 0 else f"rep {r + 1}/{reps}"
            log(f"{label} {name} ({tag})")
            try:
                res = competitors[name]()
            except Exception as exc:  # keep going: one broken side must not hide the others
                res = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=8)}
                log(f"{label} {name} FAILED: {res['error']}")
            if r >= 0:
                out[name].append(res)
    return out


def field_values(results: list[Any], key: str) -> list[float]:
    """``[r[key] for r in results]`` skipping failed runs / missing keys."""
    vals = []
    for r in results:
        if isinstance(r, dict) and r.get(key) is not None and "error" not in r:
            vals.append(float(r[key]))
    return vals


def paired_ratios(num: list[Any], den: list[Any], key_num: str, key_den: str | None = None) -> dict[str, Any]:
    """Per-repetition ratios num[i][key] / den[i][key] (same rep = same machine state).

    On a noisy machine the median of these paired ratios is steadier than the
    ratio of the two medians; both are reported.
    """
    key_den = key_den or key_num
    vals = []
    for a, b in zip(num, den):
        if not (isinstance(a, dict) and isinstance(b, dict)) or "error" in a or "error" in b:
            continue
        r = ratio(a.get(key_num), b.get(key_den))
        if r is not None:
            vals.append(r)
    return summarize(vals)


def errors_of(results: list[Any]) -> list[str]:
    return [r["error"] for r in results if isinstance(r, dict) and "error" in r]


# --------------------------------------------------------------------------
# workloads (same model init + same data for every competitor)
# --------------------------------------------------------------------------

# Full / quick sizes. batch_size is PER RANK; steps per epoch =
# n_samples / (world_size * batch_size) (sizes are chosen to divide evenly).
WORKLOADS: dict[str, dict[str, dict[str, Any]]] = {
    "mlp": {
        "full": {"n_samples": 16384, "batch_size": 64, "epochs": 2, "lr": 0.01},
        "quick": {"n_samples": 2048, "batch_size": 64, "epochs": 1, "lr": 0.01},
    },
    "cnn": {
        "full": {"n_samples": 8192, "batch_size": 64, "epochs": 1, "lr": 0.01},
        "quick": {"n_samples": 1024, "batch_size": 64, "epochs": 1, "lr": 0.01},
    },
}
LOG_EVERY = 50


def workload_cfg(kind: str, quick: bool, **over: Any) -> dict[str, Any]:
    cfg = {"model": kind, "seed": 0, "log_every": LOG_EVERY}
    cfg.update(WORKLOADS[kind]["quick" if quick else "full"])
    cfg.update(over)
    return cfg


def make_model(kind: str, seed: int = 0):
    """Built from torch.nn classes only, so it pickles by reference anywhere."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(
            nn.Linear(256, 512), nn.ReLU(),
            nn.Linear(512, 512), nn.ReLU(),
            nn.Linear(512, 10),
        )
    if kind == "cnn":
        return nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(32 * 7 * 7, 64), nn.ReLU(),
            nn.Linear(64, 10),
        )
    raise ValueError(f"unknown model kind {kind!r}")


def make_data(kind: str, n_samples: int, seed: int = 0):
    """Fixed random (x, y): mlp -> (n, 256); cnn -> (n, 1, 28, 28); 10 classes."""
    import torch

    g = torch.Generator().manual_seed(seed + 1)
    shape = {"mlp": (256,), "cnn": (1, 28, 28)}[kind]
    x = torch.randn((n_samples, *shape), generator=g)
    y = torch.randint(0, 10, (n_samples,), generator=g)
    return x, y


def make_big_model(n_params: int, width: int = 1024):
    """A stack of Linear(width, width) layers with about ``n_params`` fp32 params."""
    from torch import nn

    per_layer = width * width + width
    layers = max(1, round(n_params / per_layer))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def samples_per_epoch(n_samples: int, world: int, batch: int) -> int:
    """Samples a DistributedSampler(drop_last=False) + DataLoader feeds per epoch, all ranks."""
    per_rank = -(-n_samples // world)
    return per_rank * world


# --------------------------------------------------------------------------
# torchrun side
# --------------------------------------------------------------------------


def worker_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(CPU_THREADS_PER_RANK)
    env.setdefault("MKL_NUM_THREADS", str(CPU_THREADS_PER_RANK))
    # torchrun_train imports benchmarks.common when run from the repo root
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    if extra:
        env.update(extra)
    return env


def cfg_to_args(cfg: dict[str, Any]) -> list[str]:
    args = []
    for k, v in cfg.items():
        if v is None:
            continue
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def parse_bench_json(text: str) -> dict[str, Any]:
    for line in reversed(text.splitlines()):
        if line.startswith(JSON_MARKER):
            return json.loads(line[len(JSON_MARKER):])
    raise RuntimeError("no BENCH_JSON line in output:\n" + text[-3000:])


# The smoke run (run_all.run(reuse_workers=True)) also launches each distinct torchrun job once: a
# benchmark that asks for a job with the same workload and world size as one already run gets that
# job's figures (a copy, marked ``reused``) instead of paying seconds for a new launch. Full runs
# never reuse: every repetition is a new job. None: off; a dict: on, keyed by the job's arguments.
REUSE_TORCHRUN: dict[tuple, dict[str, Any]] | None = None


def run_torchrun(cfg: dict[str, Any], nproc: int = 2, timeout: float = 900, retries: int = 1) -> dict[str, Any]:
    """Launch ``torchrun_train.py`` as a fresh job (or, in the smoke run, reuse an identical one's figures)."""
    if REUSE_TORCHRUN is None:
        return _launch_torchrun(cfg, nproc, timeout, retries)
    key = (nproc, tuple(cfg_to_args(cfg)))
    if key not in REUSE_TORCHRUN:
        REUSE_TORCHRUN[key] = _launch_torchrun(cfg, nproc, timeout, retries)
        return dict(REUSE_TORCHRUN[key])
    return {**REUSE_TORCHRUN[key], "reused": True}


def _launch_torchrun(cfg: dict[str, Any], nproc: int, timeout: float, retries: int) -> dict[str, Any]:
    """Launch ``torchrun_train.py`` as a fresh job; return its JSON + ``wall_s``.

    ``wall_s`` is the wall time of the whole ``python -m torch.distributed.run``
    subprocess as seen from here (interpreter start, imports, rendezvous,
    training, teardown).

    torch 2.13's gloo sometimes aborts a rank on this VM ("terminate called
    without an active exception": three of about a dozen jobs across two runs
    of the full test suite, none in a quiet loop of twelve). Rank 0
    prints its result before tearing the group down, so a crash after that
    still leaves a complete measurement (kept, with ``teardown_error``); a job
    that failed earlier is run again up to ``retries`` times, and the errors
    are kept in ``retried``. Nothing is hidden: both keys land in the JSON.
    """
    last_err = None
    retried: list[str] = []
    for _ in range(retries + 1):
        port = free_port()
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nproc_per_node={nproc}",
            "--nnodes=1",
            "--master_addr", "127.0.0.1",
            "--master_port", str(port),
            str(TORCHRUN_SCRIPT),
            *cfg_to_args(cfg),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(), timeout=timeout, cwd=str(REPO_ROOT))
        wall = time.perf_counter() - t0
        err = proc.stderr
        measured = JSON_MARKER in proc.stdout
        if proc.returncode == 0 or measured:
            res = parse_bench_json(proc.stdout)
            res["wall_s"] = wall
            res["overhead_s"] = wall - res["loop_s"]
            if proc.returncode != 0:
                res["teardown_error"] = f"exit {proc.returncode}: {err.strip().splitlines()[0] if err.strip() else ''}"
            if retried:
                res["retried"] = retried
            return res
        # the failing rank's own message comes first; torch elastic's summary of it comes last
        shown = err if len(err) <= 4000 else f"{err[:2500]}\n...\n{err[-1500:]}"
        last_err = f"torchrun exit {proc.returncode}: {shown}"
        retried.append(last_err[:300])
        log(f"torchrun job failed ({last_err.splitlines()[0][:160]}); running it again")
    raise RuntimeError(last_err)


# --------------------------------------------------------------------------
# nbddp side
# --------------------------------------------------------------------------


def nbddp_status() -> tuple[bool, str]:
    """(usable, reason): can we import nbddp and does it have dist_fit/start/stop?"""
    try:
        import nbddp

        for name in ("start", "stop", "dist_fit"):
            getattr(nbddp, name)
        return True, "ok"
    except Exception as exc:
        return False, f"nbddp not usable: {type(exc).__name__}: {exc}"


# The test suite's smoke run (run_all.run(reuse_workers=True)) lets every benchmark that does not
# measure start-up itself keep the workers that are running, as a person in one notebook would:
# starting 2 engines costs ~7 s, and a full run's figures come from fresh workers anyway.
REUSE_WORKERS = False


def nbddp_start(n: int = 2, fresh: bool = False, **kw: Any) -> float:
    """``nbddp.start(n)`` with 1 thread per CPU rank; returns seconds to ready.

    With ``REUSE_WORKERS`` (and not ``fresh``), running workers of the same world size are kept
    (0 s); other running workers are stopped first.
    """
    import nbddp

    if REUSE_WORKERS and not fresh:
        status = nbddp.status()
        if status["running"] and status["world_size"] == n and not kw:
            return 0.0
        nbddp_stop(fresh=True)
    os.environ["OMP_NUM_THREADS"] = str(CPU_THREADS_PER_RANK)  # inherited by engines we start
    if not cuda_available():
        kw.setdefault("threads", CPU_THREADS_PER_RANK)  # as torchrun_train.py: 1 torch thread per CPU rank
    t0 = time.perf_counter()
    nbddp.start(n=n, **kw)
    return time.perf_counter() - t0


def nbddp_stop(fresh: bool = False) -> float:
    """``nbddp.stop()``; with ``REUSE_WORKERS`` (and not ``fresh``) the workers stay for the next benchmark."""
    import nbddp

    if REUSE_WORKERS and not fresh:
        return 0.0
    t0 = time.perf_counter()
    with contextlib.suppress(Exception):
        nbddp.stop()
    return time.perf_counter() - t0


def dist_fit_params() -> set[str]:
    import nbddp

    try:
        return set(inspect.signature(nbddp.dist_fit).parameters)
    except (TypeError, ValueError):
        return set()


def nbddp_fit(model, data, cfg: dict[str, Any], live: bool = False, world: int = 2, **extra: Any) -> dict[str, Any]:
    """One ``nbddp.dist_fit`` call; returns its timings and derived numbers.

    ``samples_per_s`` = samples trained / ``timings['train_s']`` (the loop
    time measured on the workers). ``kernel_cpu_s`` is this process's CPU time
    (all threads) during the call; ``wall_s`` is the call's wall time here.
    """
    import nbddp
    import torch
    import torch.nn.functional as F

    kwargs = dict(
        epochs=cfg["epochs"],
        batch_size=cfg["batch_size"],
        loss_fn=F.cross_entropy,
        optimizer=torch.optim.SGD,
        lr=cfg["lr"],
        shuffle=False,
        live=live,
        log_every=cfg.get("log_every", LOG_EVERY),
    )
    accepted = dist_fit_params()
    for k, v in extra.items():
        if not accepted or k in accepted:
            kwargs[k] = v
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    hist = nbddp.dist_fit(model, data, **kwargs)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    timings = dict(getattr(hist, "timings", {}) or {})
    train_s = timings.get("train_s")
    n = len(data[0])
    samples = samples_per_epoch(n, world, cfg["batch_size"]) * cfg["epochs"]
    steps = list(getattr(hist, "steps", []) or [])
    res: dict[str, Any] = {
        "wall_s": wall,
        "total_s": timings.get("total_s", wall),
        "train_s": train_s,
        "timings": timings,
        "kernel_cpu_s": cpu,
        "samples": samples,
        "samples_per_s": (samples / train_s) if train_s else None,
        "overhead_s": (wall - train_s) if train_s is not None else None,
        "status": getattr(hist, "status", None),
        "world_size": getattr(hist, "world_size", None),
        "last_step": steps[-1].get("step") if steps else None,
        "steps_logged": len(steps),
        "final_loss": steps[-1].get("loss") if steps else None,
        "reported_samples_per_s": median(s.get("samples_per_s") for s in steps[1:] or steps),
    }
    if res["status"] not in (None, "completed"):
        raise RuntimeError(f"dist_fit ended with status {res['status']!r}")
    return res


# --------------------------------------------------------------------------
# output
# --------------------------------------------------------------------------


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def print_table(rows: list[dict[str, Any]], columns: list[str] | None = None, title: str = "") -> str:
    if not rows:
        return ""
    columns = columns or list(dict.fromkeys(k for r in rows for k in r))
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for row in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)))
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def stamp() -> str:
    return _dt.datetime.now().strftime("%Y-%m-%d_%H%M%S")


def write_json(results: dict[str, Any], name: str | None = None, path: str | Path | None = None) -> Path:
    """Write ``results`` (+ environment) to ``benchmarks/results/<date>[_name].json``."""
    if path is None:
        RESULTS_DIR.mkdir(parents=True, exist_ok=True)
        path = RESULTS_DIR / (f"{stamp()}_{name}.json" if name else f"{stamp()}.json")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"environment": environment(), **results}
    path.write_text(json.dumps(payload, indent=2, default=str))
    log(f"wrote {path}")
    return path


def cli(main: Callable[..., dict[str, Any]], name: str) -> None:
    """Shared ``__main__``: ``--quick``, ``--out PATH``; runs main and writes JSON."""
    import argparse

    ap = argparse.ArgumentParser(description=f"nbddp benchmark: {name}")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/<date>_<name>.json)")
    args = ap.parse_args()
    res = main(quick=args.quick)
    write_json({name: res}, name=name, path=args.out)
