"""Fault injection for elastic fits, like torchft's ``EventInjector().fail_at(rank, step)``.

``KillAt`` is a ``step_fn``: on the chosen rank, at its chosen call (one
optimizer step each, without accumulation), it SIGKILLs its own engine, as
the kernel's OOM killer would. Each trigger fires once per test: it needs
its marker file, and the first process to remove the marker is the one that
dies, so the replacement worker replays that step without dying again.
Travels to the workers by value (the engines cannot import tests/).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time

import cloudpickle
import torch.nn as nn

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def armed(path: str) -> str:
    """A trigger's marker: while it exists, its kill is still to come."""
    with open(path, "w") as f:
        f.write("armed")
    return path


class KillAt:
    """``step_fn``: ``triggers`` is ``[(rank, call, marker), ...]`` (add ``"stall"`` to block instead of dying).

    ``modes``: where rank 0 writes the snapshots' modes, at its call ``modes_at``; ``delay``: seconds per step.
    """

    def __init__(self, triggers: list[tuple[int, int, str]] = (), prefix: str = "", modes: str = "",
                 modes_at: int = 6, delay: float = 0.0):
        self.triggers, self.prefix, self.modes, self.calls = list(triggers), prefix, modes, 0
        self.modes_at, self.delay = modes_at, delay

    def __call__(self, model: nn.Module, batch) -> object:
        import torch.distributed as dist

        x, y = batch
        loss = nn.functional.mse_loss(model(x), y)
        self.calls += 1
        rank = dist.get_rank()
        for who, call, marker, *action in self.triggers:
            if who == rank and call == self.calls and _disarm(marker):
                if action == ["stall"]:  # blocked in Python, outside any collective: only the stall guard sees it
                    time.sleep(600)
                os.kill(os.getpid(), signal.SIGKILL)
        if self.modes and rank == 0 and self.calls == self.modes_at:
            _write_modes(self.prefix, self.modes)
        if self.delay:
            time.sleep(self.delay)
        return loss


def _disarm(marker: str) -> bool:
    try:
        os.unlink(marker)
        return True
    except FileNotFoundError:
        return False


def _write_modes(prefix: str, out: str) -> None:
    """Every snapshot folder and file of the session ``prefix``, with its mode, as JSON."""
    found = {}
    from nbddp.protocol.notes import shm_dir

    for top in glob.glob(os.path.join(shm_dir(), f"{prefix}-snap-*")):
        found[top] = oct(os.stat(top).st_mode & 0o777)
        for root, dirs, files in os.walk(top):
            for name in dirs + files:
                path = os.path.join(root, name)
                found[path] = oct(os.stat(path).st_mode & 0o777)
    with open(out, "w") as f:
        json.dump(found, f)


class KillLayer(nn.Module):
    """An identity layer that SIGKILLs its process on rank ``who`` at its ``call``-th training forward, once.

    For strategies that take no ``step_fn`` (a pipeline's schedule runs the stages): put it in the model, in a
    part that rank holds. Its call count is not state: a relaunched rank counts from 0.
    """

    def __init__(self, who: int, call: int, marker: str):
        super().__init__()
        self.who, self.call, self.marker, self.calls = who, call, marker, 0

    def forward(self, x):
        import torch.distributed as dist

        if self.training:
            self.calls += 1
            if dist.get_rank() == self.who and self.calls == self.call and _disarm(self.marker):
                os.kill(os.getpid(), signal.SIGKILL)
        return x


class FakeRun:
    """A stand-in for the fit ``Recovery`` relaunches (``nbddp.elastic.recovery.Relaunchable``), without workers:
    what it was told to show, and the configuration it would launch with next."""

    def __init__(self, session=None, config=None, policy=None, restarts=None, world_size=2, started_at=0.0):
        from nbddp.execution.policy import FailurePolicy

        self.session, self.config = session, config
        self.policy = policy or FailurePolicy()
        self.stop_requested = self.hard_stopped = False
        self.restarts = list(restarts or [])  # the live view's restart lines
        self.world_size, self.started_at, self.updates = world_size, started_at, 0

    @property
    def stopping(self):
        return self.stop_requested or self.hard_stopped

    def reconfigure(self, cfg, world_size):
        self.config, self.world_size = cfg, world_size

    def show_restart(self, line, replace_last=False, status=None):
        if replace_last and self.restarts:
            self.restarts[-1] = line
        else:
            self.restarts.append(line)
        self.updates += 1
