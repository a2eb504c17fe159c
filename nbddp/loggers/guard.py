"""Loggers that may fail without failing the fit: each one's errors are reported once and its misses counted.

A logger writes to a disk, a database or a service, any of which can fail
mid-fit. Training is worth more than its log: the first exception is
printed with its traceback, that logger gets no more records, and the end
of the fit says how many records it missed (``History.loggers`` too).
"""

from __future__ import annotations

import json
import os
import traceback
from typing import Any, Callable

from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers.base import Logger
from nbddp.protocol.fit_options import FitConfig
from nbddp.protocol.notices import notify, report

RUNS_FILE = "nbddp-runs.json"  # in checkpoint_dir: the run each logger wrote, for a resumed fit to continue


class Guarded:
    """One logger and its account: records written, missed, and the first error."""

    def __init__(self, logger: Logger, key: str):
        self.logger, self.key = logger, key
        self.logged = 0
        self.pending = 0  # handed over since the last flush: lost too if the flush fails
        self.missed = 0
        self.error: str | None = None
        self.failed_at: int | None = None
        self.traceback = ""

    def call(self, what: str, fn: Callable[..., Any], *args: Any, step: int | None = None) -> Any:
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - a logger must never stop the fit
            self.fail(what, exc, step)
            return None

    def fail(self, what: str, exc: BaseException, step: int | None) -> None:
        if what == "flush":  # what it buffered since the last flush is lost
            self.missed += self.pending
        else:  # the records it took before are written (or buffered for finish, which it still gets)
            self.logged += self.pending
        self.pending = 0
        if self.error is not None:
            return
        self.error = f"{type(exc).__name__}: {exc}"
        self.failed_at = step
        self.traceback = "".join(traceback.format_exception(exc))
        at = f" at step {step}" if step is not None else ""
        report(f"nbddp: logger {self.key} failed in {what}{at}; it gets no more records this fit, and training goes on",
               self.traceback)

    def row(self) -> dict[str, Any]:
        return {"logger": self.key, "where": self.call("where", self.logger.where) if self.error is None else "",
                "logged": self.logged, "missed": self.missed, "error": self.error, "failed_at": self.failed_at}


class LoggerSet:
    """Every logger of one fit, driven by ``FitHooks`` from the fit's watcher thread."""

    def __init__(self, loggers: list[Logger]):
        keys: dict[str, int] = {}
        self.guards = []
        for logger in loggers:
            base = type(logger).__name__
            keys[base] = keys.get(base, 0) + 1
            self.guards.append(Guarded(logger, base if keys[base] == 1 else f"{base}-{keys[base]}"))
        self.started = False

    def __bool__(self) -> bool:
        return bool(self.guards)

    def start(self, info: FitInfo, saved: dict[str, Any]) -> dict[str, Any]:
        """Open every logger's run; return what each needs to be resumed later (key -> state)."""
        self.started = True
        states = {}
        for g in self.guards:
            state = g.call("start", g.logger.start, info, saved.get(g.key), step=info.start_step)
            if state is not None and g.error is None:
                states[g.key] = state
        return states

    def log(self, kind: str, record: dict[str, Any]) -> None:
        for g in self.guards:
            if g.error is not None:
                g.missed += 1
                continue
            g.call("log", g.logger.log, kind, record, step=record.get("step"))
            if g.error is None:
                g.pending += 1
            else:
                g.missed += 1

    def flush(self, step: int | None = None) -> None:
        for g in self.guards:
            if g.error is None and g.pending:
                g.call("flush", g.logger.flush, step=step)
                g.logged += g.pending
                g.pending = 0

    def finish(self, status: str, step: int | None) -> list[dict[str, Any]]:
        """Flush and close every run; print one line per logger that missed records; the rows for History."""
        self.flush(step)
        for g in self.guards:
            if self.started:
                g.call("finish", g.logger.finish, status, step=step)
            if g.missed:
                notify(f"nbddp: logger {g.key} missed {g.missed} of {g.logged + g.missed} records "
                       f"(it failed at step {g.failed_at}: {g.error}); the fit itself went on")
        return [g.row() for g in self.guards]


def runs_file(cfg: FitConfig) -> str | None:
    """Where a fit's runs are noted: beside its checkpoints (``checkpoint_dir``, or the resumed checkpoint's)."""
    if cfg.checkpoint_dir:
        return os.path.join(cfg.checkpoint_dir, RUNS_FILE)
    if isinstance(cfg.resume, str):
        return os.path.join(os.path.dirname(os.path.abspath(cfg.resume)), RUNS_FILE)
    return None


def read_runs(path: str | None) -> dict[str, Any]:
    if path is None or not os.path.isfile(path):
        return {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        notify(f"nbddp: cannot read {path} ({exc}); the loggers start new runs")
        return {}
    return data if isinstance(data, dict) else {}


def write_runs(path: str | None, run_name: str, states: dict[str, Any]) -> None:
    """Note the runs next to the checkpoints (atomically), so that ``resume=`` continues them."""
    if path is None:
        return
    data = {"run_name": run_name, "loggers": {**read_runs(path).get("loggers", {}), **states}}
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)  # before the first checkpoint makes it
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as exc:
        notify(f"nbddp: cannot note the loggers' runs in {path} ({exc}); a resumed fit will start new runs")
