"""What showing the ranks' output costs a call: nbddp's reader against main's (issue 46, rich output), one run.

Since issue 46 every ``%%ddp`` cell, ``nbddp.run`` and script takes each of
the ranks' output messages through a callback in the client's IO thread
(``nbddp/cells/rank_messages.py``), turns streams into lines as a terminal
shows them, draws bars in place and republishes displays
(``nbddp/cells/rank_output.py``). Before, it re-read each task's kept text
at every tick. Both readers wrap the same call on the same workers, in
turns (A, B, B, A, ...), so the machine's load hits both alike:

* ``quiet``: a cell that prints nothing (``a = 1``): the cost of attaching
  and detaching the callbacks, around every task;
* ``bar``: a cell with a 200-step tqdm bar, a figure and 20 printed lines:
  about 230 messages a rank.

Reported: each side's median wall time per call, the ratio new / main (of
the medians, and the median of each turn's pair), and
the kernel's own time in the new reader's ticks per message (its whole
cost on the kernel's thread, ``tick_us_per_message``).

``MainReader`` is main's reader (acc8075, ``nbddp/cells/rank_output.py``),
kept here as the baseline: complete lines of ``AsyncResult.stdout`` and
``stderr`` by offset, printed labelled.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from typing import Any

QUIET = "a = 1"
BAR = """
from tqdm import tqdm
import matplotlib.pyplot as plt
for _ in tqdm(range(200), mininterval=0):
    pass
for i in range(20):
    print('line', i)
plt.plot([0, 1])
plt.show()
"""


class MainReader:
    """Main's reader before issue 46: each task's kept text re-read at each tick, complete lines printed."""

    def __init__(self, ars: dict[int, Any], inbox: Any = None):
        self.ars = ars
        self.seen = {(r, k): 0 for r in ars for k in ("stdout", "stderr")}
        self.partial = {key: "" for key in self.seen}

    def tick(self) -> None:
        for rank, ar in self.ars.items():
            for kind in ("stdout", "stderr"):
                text = ar[kind] or ""
                key = (rank, kind)
                new = text[self.seen[key]:]
                if not new:
                    continue
                self.seen[key] = len(text)
                *complete, rest = (self.partial[key] + new).split("\n")
                self.partial[key] = rest
                for line in complete:
                    print(f"[rank {rank}] {line}")

    def finish(self, tasks: Any) -> None:
        for ar in self.ars.values():
            with contextlib.suppress(Exception):
                ar.wait_for_output(2.0)
        self.tick()


class TimedReader:
    """nbddp's reader, its ticks timed (the kernel's own cost) and its messages counted."""

    def __init__(self, ars: dict[int, Any], inbox: Any):
        from nbddp.cells.rank_output import RankOutput

        self.reader = RankOutput(ars, inbox, live=True, shown={0}, drawing="plain")
        self.tick_s = 0.0
        self.messages = 0
        drain = self.reader.inbox.drain

        def counted() -> list:
            taken = drain()
            self.messages += len(taken)
            return taken

        self.reader.inbox.drain = counted  # type: ignore[method-assign]

    def tick(self) -> None:
        t0 = time.perf_counter()
        self.reader.tick()
        self.tick_s += time.perf_counter() - t0

    def finish(self, tasks: Any) -> None:
        t0 = time.perf_counter()
        self.reader.finish(tasks)
        self.tick_s += time.perf_counter() - t0


def one_call(session: Any, code: str, reader_class: type) -> tuple[float, Any]:
    """A ``%%ddp`` cell of ``code`` shown by ``reader_class``: its wall time and the reader."""
    from nbddp.cells.rank_messages import RankInbox
    from nbddp.execution.calls import call_on_ranks
    from nbddp.worker.tasks.cells import run_cell as remote_cell

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        inbox = RankInbox() if reader_class is TimedReader else None
        call = call_on_ranks(session, "%%ddp cell", remote_cell, lambda p: (code, 0, session.generation, False,
                                                                            p.rank == 0),
                             listen=inbox.attach if inbox is not None else None)
        reader = reader_class(call.tasks.ars, inbox)
        try:
            call.wait(on_tick=reader.tick)
        finally:
            reader.finish(call.tasks)
    return time.perf_counter() - t0, reader


def measure(reps: int) -> dict[str, Any]:
    """Medians of ``reps`` alternating calls of each cell with each reader, and the new reader's tick cost."""
    from nbddp.session.session import get_session

    session = get_session()
    sides = {"main": MainReader, "new": TimedReader}
    times: dict[str, list[float]] = {f"{cell}/{side}": [] for cell in ("quiet", "bar") for side in sides}
    tick_s, messages = 0.0, 0
    for cell, code in (("quiet", QUIET), ("bar", BAR)):
        for side in sides.values():  # warm-up: tqdm and matplotlib imported on the workers, each path once
            one_call(session, code, side)
        for r in range(reps):
            order = ["main", "new"] if r % 2 == 0 else ["new", "main"]
            for side in order:
                wall, reader = one_call(session, code, sides[side])
                times[f"{cell}/{side}"].append(wall)
                if side == "new" and cell == "bar":
                    tick_s, messages = tick_s + reader.tick_s, messages + reader.messages
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"reps": reps, "median_s": med,
            "ratio_new_over_main": {cell: med[f"{cell}/new"] / med[f"{cell}/main"] for cell in ("quiet", "bar")},
            "paired_ratio_median": {cell: statistics.median(n / m for n, m in zip(times[f"{cell}/new"],
                                                                                  times[f"{cell}/main"]))
                                    for cell in ("quiet", "bar")},
            "tick_us_per_message": 1e6 * tick_s / messages if messages else None,
            "messages_per_bar_call": messages / reps if reps else None, "raw": times}


def rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows: each cell's median with nbddp's reader, against main's reader."""
    out = [{"bench": "latency/output", "competitor": cell, "metric": "s/call", "median": res["median_s"][f"{cell}/new"],
            "ratio": ratio, "ratio_of": "x main's reader"} for cell, ratio in res["ratio_new_over_main"].items()]
    if res.get("tick_us_per_message") is not None:
        out.append({"bench": "latency/output", "competitor": "kernel per message", "metric": "us/message",
                    "median": res["tick_us_per_message"], "ratio": None, "ratio_of": ""})
    return out


if __name__ == "__main__":  # this figure alone: python benchmarks/output_cost.py [--quick] [--out PATH]
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))
    from benchmarks import common

    def _main(quick: bool = False) -> dict[str, Any]:
        common.nbddp_start(2)
        try:
            res = measure(reps=3 if quick else 15)
        finally:
            common.nbddp_stop()
        common.print_table(rows(res), title="\n== latency: the ranks' output, nbddp's reader against main's ==")
        return res

    common.cli(_main, "output")
