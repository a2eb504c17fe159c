"""Helpers shared by the fault, bad-input and soak tests.

Everything here travels to the workers by value (``register_pickle_by_value``),
because the engines cannot import the tests folder.

A misbehaving rank writes ``time.time()`` to a marker file right before it
fails, so a test can measure the time from the failure to the kernel's
error (same machine, same clock).
"""

from __future__ import annotations

import json
import os
import sys
import time

import cloudpickle
import torch
import torch.nn as nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])

N, D = 512, 8
TIMES_FILE = os.environ.get("NBDDP_FAULT_TIMES", "/tmp/nbddp-fault-times.jsonl")


def regression_data(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, D, generator=g)
    return x, x @ torch.linspace(-1, 1, D).reshape(D, 1)


def rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else -1


def mark(path: str, value: object = None) -> None:
    """Write ``value`` (default: now) to ``path`` atomically."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(repr(time.time() if value is None else value))
    os.replace(tmp, path)


def read_mark(path: str, timeout: float = 60.0) -> float:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no marker {path} after {timeout} s")
        time.sleep(0.02)
    with open(path) as f:
        return float(f.read())


def boom(where: str, marker: str) -> None:
    mark(marker)
    raise ValueError(f"boom in the {where} on rank {rank()}")


class Net(nn.Module):
    """A linear model that can fail on one rank at one forward call.

    ``fail``: None, or ``(rank, call, action, marker)`` with ``action`` one of
    ``"raise"``, ``"exit"`` (``os._exit(3)``), ``"segfault"``, ``"mark"`` (only
    write the marker: the test kills the process itself), ``"sleep"``
    (block in Python for a long time: a rank that hangs outside collectives).
    """

    def __init__(self, fail: tuple | None = None, delay: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(D, 1)
        self.fail = fail
        self.delay = delay
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.delay:
                time.sleep(self.delay)
            if self.fail is not None:
                who, call, action, marker = self.fail
                if rank() in (who if isinstance(who, tuple) else (who,)) and self.calls == call:
                    _act(action, marker, "model")
        return self.lin(x)


def _act(action: str, marker: str, where: str) -> None:
    if action == "raise":
        if rank() == 0:
            time.sleep(0.5)  # when both ranks fail, rank 1 fails first
        boom(where, marker)
    mark(marker)
    if action == "exit":
        os._exit(3)
    if action == "segfault":
        import ctypes

        ctypes.string_at(0)
    if action == "sleep":
        time.sleep(120)


class FailingLoss:
    def __init__(self, who: int, call: int, marker: str):
        self.who, self.call, self.marker, self.calls = who, call, marker, 0

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if rank() == self.who and self.calls == self.call:
            boom("loss", self.marker)
        return nn.functional.mse_loss(out, y)


class FailingData(torch.utils.data.Dataset):
    """Rank ``who`` misbehaves in ``__getitem__`` at its ``after``-th sample (here: raises)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, who: int, after: int, marker: str):
        self.x, self.y, self.who, self.after, self.marker, self.seen = x, y, who, after, marker, 0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.seen += 1
        if rank() == self.who and self.seen == self.after:
            self.misbehave()
        return self.x[i], self.y[i]

    def misbehave(self) -> None:
        boom("data pipeline", self.marker)


class FailingMetric:
    def __init__(self, who: int, marker: str):
        self.who, self.marker = who, marker

    def __call__(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if rank() == self.who:
            boom("metric", self.marker)
        return (out - y).abs().mean()


class CountingStep:
    """``step_fn`` that records how many steps this rank ran in ``{folder}/rank{r}``."""

    def __init__(self, folder: str, delay: float = 0.0, stall_after: int | None = None, stall_s: float = 0.0):
        self.folder, self.delay, self.stall_after, self.stall_s, self.calls = folder, delay, stall_after, stall_s, 0

    def __call__(self, model: nn.Module, batch) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        self.calls += 1
        mark(os.path.join(self.folder, f"rank{rank()}"), self.calls)
        if self.delay:
            time.sleep(self.delay)
        if self.stall_after is not None and self.calls == self.stall_after:
            time.sleep(self.stall_s)
        return loss


def record_time(fault: str, **values: float) -> None:
    """Append a measured row to ``TIMES_FILE`` (collected for the report)."""
    row = {"fault": fault, **{k: round(v, 3) if isinstance(v, float) else v for k, v in values.items()}}
    print("FAULT-TIMES", json.dumps(row))
    try:
        with open(TIMES_FILE, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


def engine_pids(session) -> list[int]:
    return [p.pid for p in session.placements]


def good_fit(**kwargs):
    """A short fit that must succeed on healthy workers; returns (History, seconds)."""
    import nbddp

    t0 = time.perf_counter()
    h = nbddp.dist_fit(Net(), regression_data(), batch_size=16, max_steps=4, live=False, **kwargs)
    assert h.status == "completed", h
    return h, time.perf_counter() - t0
