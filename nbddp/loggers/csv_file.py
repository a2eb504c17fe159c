"""CSV: one row per record, every fit in one file, told apart by its ``run`` column.

Columns: ``run``, ``kind`` (``step``, ``epoch`` or ``val``), ``step``,
``epoch``, then every value of the records (``loss``, ``lr``,
``samples_per_s``, ``time``, ``val_loss``, ...). Reading it back:
``pd.read_csv(path)``, then ``df[df.kind == "step"]`` or
``df.groupby("run")`` to compare fits. A resumed fit continues its run: rows
that run wrote after the checkpoint's step are dropped first, so the run
reads as one straight series. The file is rewritten when a record brings a
new column (the first validation), appended to otherwise.
"""

from __future__ import annotations

import csv
import os
from typing import Any

from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers.base import Logger, writable_dir

FIRST = ["run", "kind", "step", "epoch", "loss", "lr", "samples_per_s", "time"]


class CSV(Logger):
    """``dist_fit(loggers=[CSV("runs/metrics.csv")])``; ``pandas.read_csv`` reads it back.

    Args:
        path: the CSV file; a fit appends its rows under its run name.
        name: the run's name in the ``run`` column (default: the fit's run name).
    """

    name = "csv"

    def __init__(self, path: str | os.PathLike = "runs/metrics.csv", name: str | None = None):
        self.path = path
        self.run_name = name
        self.run: str | None = None
        self.columns: list[str] = list(FIRST)
        self.file: Any = None
        self.writer: Any = None

    def check(self) -> None:
        path = os.path.abspath(os.fspath(self.path))
        if os.path.isdir(path):
            raise IsADirectoryError(f"CSV(path={self.path!r}) is a directory; give the path of a file, e.g. "
                                    f"{os.path.join(os.fspath(self.path), 'metrics.csv')!r}")
        writable_dir(os.path.dirname(path), f"CSV(path={self.path!r})")
        self.path = path

    def start(self, info: FitInfo, resume: dict[str, Any] | None) -> dict[str, Any]:
        columns, rows = _read(os.fspath(self.path))
        if resume and resume.get("run"):
            self.run = resume["run"]
            rows = [r for r in rows if r.get("run") != self.run or _step(r) <= info.start_step]
        else:
            self.run = _free_name(self.run_name or info.run_name, {r.get("run") for r in rows})
        self.columns = columns or list(FIRST)
        self._rewrite(rows)
        return {"run": self.run}

    def log(self, kind: str, record: dict[str, Any]) -> None:
        row = {"run": self.run, "kind": kind, **record}
        new = [k for k in row if k not in self.columns]
        if new:
            self.file.close()
            self.columns += new
            self._rewrite(_read(os.fspath(self.path))[1])
        self.writer.writerow(row)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        """The file anew with ``self.columns`` and ``rows``; left open for appending."""
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.columns, restval="")
            writer.writeheader()
            writer.writerows(rows)
        os.replace(tmp, self.path)
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, fieldnames=self.columns, restval="")

    def flush(self) -> None:
        self.file.flush()

    def finish(self, status: str) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def where(self) -> str:
        return f"{self.path} (run {self.run})" if self.run else ""

    def __repr__(self) -> str:
        return f"CSV({os.fspath(self.path)!r})"


def _read(path: str) -> tuple[list[str], list[dict[str, Any]]]:
    if not os.path.isfile(path):
        return [], []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        return list(reader.fieldnames or []), rows


def _step(row: dict[str, Any]) -> float:
    try:
        return float(row.get("step") or 0)
    except ValueError:
        return 0.0


def _free_name(name: str, taken: set[Any]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        n += 1
        candidate = f"{name}-{n}"
    return candidate
