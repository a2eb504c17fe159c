"""TensorBoard: one event directory per fit, under ``log_dir``.

Written with torch's ``SummaryWriter`` (the ``tensorboard`` package). The
hyperparameters go into the same directory as the scalars (the HParams
tab lists the run), and as a text table. A resumed fit writes into the same
directory with ``purge_step`` at the checkpoint's next step: TensorBoard
then drops what the interrupted fit wrote after the checkpoint, and the run
reads as one straight series.
"""

from __future__ import annotations

import glob
import os
from typing import Any

from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers.base import Logger, need, writable_dir


class TensorBoard(Logger):
    """``dist_fit(loggers=[TensorBoard(log_dir="runs")])``; then ``tensorboard --logdir runs``.

    Args:
        log_dir: the directory of every fit's run; each fit writes
            ``log_dir/<name>``.
        name: the run's directory name (default: the fit's run name,
            ``<ModelClass>-<date>-<time>-<tag>``); taken names get ``-2``, ``-3``...
        flush_secs: how often the writer's own thread writes events to disk.
    """

    name = "tensorboard"

    def __init__(self, log_dir: str | os.PathLike = "runs", name: str | None = None, flush_secs: float = 5.0):
        self.log_dir = log_dir
        self.run_name = name
        self.flush_secs = flush_secs
        self.dir: str | None = None
        self.writer: Any = None

    def check(self) -> None:
        need("torch.utils.tensorboard", "tensorboard", "nbddp.loggers.TensorBoard")
        self.log_dir = writable_dir(self.log_dir, f"TensorBoard(log_dir={self.log_dir!r})")

    def start(self, info: FitInfo, resume: dict[str, Any] | None) -> dict[str, Any]:
        from torch.utils.tensorboard import SummaryWriter

        if resume and resume.get("dir"):
            self.dir = resume["dir"]
            self.writer = SummaryWriter(self.dir, purge_step=info.start_step + 1, flush_secs=self.flush_secs)
        else:
            self.dir = _free_dir(os.fspath(self.log_dir), self.run_name or info.run_name)
            self.writer = SummaryWriter(self.dir, flush_secs=self.flush_secs)
            self._hparams(info)
        return {"dir": self.dir}

    def _hparams(self, info: FitInfo) -> None:
        from torch.utils.tensorboard.summary import hparams

        values = {k: (v if isinstance(v, (bool, int, float, str)) else str(v)) for k, v in info.hparams.items()}
        for summary in hparams(values, {"train/loss": 0.0, "val/loss": 0.0, "epoch/loss": 0.0}):
            self.writer.file_writer.add_summary(summary)
        table = "\n".join(f"| {k} | {v} |" for k, v in values.items())
        self.writer.add_text("hparams", "| hyperparameter | value |\n|---|---|\n" + table, info.start_step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        pass  # the writer's thread writes every flush_secs; finish() closes it

    def finish(self, status: str) -> None:
        if self.writer is not None:
            self.writer.add_text("status", status)
            self.writer.close()
            self.writer = None

    def where(self) -> str:
        return self.dir or ""

    def __repr__(self) -> str:
        return f"TensorBoard(log_dir={os.fspath(self.log_dir)!r})"


def _free_dir(root: str, name: str) -> str:
    """``root/name``, or ``root/name-2``... when an earlier fit already wrote events there."""
    path, n = os.path.join(root, name), 1
    while glob.glob(os.path.join(path, "events.out.tfevents.*")):
        n += 1
        path = os.path.join(root, f"{name}-{n}")
    return path
