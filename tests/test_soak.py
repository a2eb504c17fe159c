"""Soak (issue 4): 50 fits in a row mixing successes and every failure kind.

After the run, engine RSS, open file descriptors and threads (summed over
the ranks) and the kernel's own fds and threads must not have grown by more
than 10 % over the largest value seen in the first five fits (which already
mix successes and failures).
Replaced engines start fresh, so the failure kinds that replace workers
come early and the last ~30 fits run on the same engines.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import cloudpickle
import pytest

import nbddp
from faultkit import Net, read_mark, record_time, regression_data
from nbddp.protocol.errors import WorkerDied, WorkerError

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.faults]

# the first five already mix kinds: an engine's first failures and group rebuilds warm up
# a bounded set of threads and fds (seen: +3 threads per engine, then flat for 30 fits)
HEAD = ["ok", "nan", "noloss", "both", "stop", "raise", "ok", "bad", "kill", "ok", "nan", "noloss", "both", "ok",
        "raise", "ok"]
CYCLE = ["bad", "ok", "nan", "ok", "noloss", "both", "stop", "ok"]
SEQUENCE = (HEAD + CYCLE * 5)[:50]


def _engine_resources() -> tuple[int, int, int]:
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return rss, len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _kernel_resources() -> tuple[int, int]:
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def _one(kind: str, session, tmp: str, i: int) -> str:
    x, y = regression_data(256)
    common = dict(batch_size=16, live=False)
    marker = os.path.join(tmp, f"m{i}")
    if kind == "ok":
        h = nbddp.dist_fit(Net(), (x, y), max_steps=4, **common)
        assert h.status == "completed"
    elif kind == "bad":
        with pytest.raises(ValueError, match="epochs"):
            nbddp.dist_fit(Net(), (x, y), epochs=0, **common)
    elif kind == "nan":
        x = x.clone()
        x[:] = float("nan")
        with pytest.raises(WorkerError, match="FloatingPointError: the loss is nan at step 1"):
            nbddp.dist_fit(Net(), (x, y), max_steps=4, **common)
    elif kind == "noloss":
        with pytest.raises(WorkerError, match="the loss must be a scalar"):
            nbddp.dist_fit(Net(), (x, y), max_steps=4, loss_fn=lambda o, t: (o - t) ** 2, **common)
    elif kind == "raise":
        with pytest.raises(WorkerError, match="boom in the model on rank 1"):
            nbddp.dist_fit(Net(fail=(1, 2, "raise", marker)), (x, y), max_steps=8, **common)
    elif kind == "both":
        with pytest.raises(WorkerError, match="also failed: rank"):
            nbddp.dist_fit(Net(fail=((0, 1), 2, "raise", marker)), (x, y), max_steps=8, **common)
    elif kind == "kill":
        pid = session.placements[1].pid
        threading.Thread(target=lambda: (read_mark(marker, 120), os.kill(pid, signal.SIGKILL)), daemon=True).start()
        with pytest.raises(WorkerDied, match="SIGKILL"):
            nbddp.dist_fit(Net(fail=(1, 2, "mark", marker), delay=0.05), (x, y), epochs=3, **common)
    elif kind == "stop":
        handle = nbddp.dist_fit(Net(delay=0.02), (x, y), epochs=20, block=False, **common)
        deadline = time.monotonic() + 60
        while not handle.history.steps and time.monotonic() < deadline:
            time.sleep(0.05)
        h = handle.stop()
        assert h.status == "interrupted"
    else:
        raise AssertionError(kind)
    session.wait_healed(raise_error=True)
    return kind


def test_fifty_fits_do_not_leak(workers, tmp_path):
    """Fifty fits in a row, every failure kind among them, and no resource grows.

    It cannot be faster: a leak only shows over many fits, and the failure kinds that replace
    a worker (a rank that raises, a killed rank) each wait for a new engine. Each fit is 4 steps.
    """
    assert len(SEQUENCE) == 50 and set(SEQUENCE) == {"ok", "bad", "nan", "noloss", "raise", "both", "kill", "stop"}
    engine, kernel, times = [], [], []
    t_start = time.perf_counter()
    for i, kind in enumerate(SEQUENCE):
        t0 = time.perf_counter()
        _one(kind, workers, str(tmp_path), i)
        times.append((kind, time.perf_counter() - t0))
        per_rank = nbddp.run(_engine_resources)
        engine.append(tuple(sum(r[k] for r in per_rank) for k in range(3)))
        kernel.append(_kernel_resources())
    total = time.perf_counter() - t_start
    base_e = [max(e[k] for e in engine[:5]) for k in range(3)]
    base_k = [max(e[k] for e in kernel[:5]) for k in range(2)]
    growth = {name: engine[-1][k] / base_e[k] for k, name in enumerate(["engine_rss", "engine_fds", "engine_threads"])}
    growth.update({name: kernel[-1][k] / base_k[k] for k, name in enumerate(["kernel_fds", "kernel_threads"])})
    record_time("soak: 50 fits", total_s=total, **{k: round(v, 3) for k, v in growth.items()})
    grown = {k: v for k, v in growth.items() if v > 1.10}
    assert not grown, (f"grew more than 10 % over the first five fits: {grown}; engine (rss, fds, threads) per fit: "
                       f"{engine}; kernel (fds, threads): {kernel}")
    assert workers.world_size == 2
