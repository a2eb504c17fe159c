"""How long this rank compiles, told to the heartbeat as it happens: compiling is a phase, not a stall.

Dynamo calls back when a compile starts and ends (``torch._dynamo.callback``:
a frame traced, a backward compiled lazily); the callbacks are installed
once per engine and count only while a fit that compiles is running. While
one runs the heartbeat's phase is ``"compiling"``, and the monitor counts
each beat as progress (``worker/engine/heartbeat.py``): a first step that
compiles for minutes is never taken for a stalled rank.
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.worker.engine.heartbeat import BEAT


class CompileWatch:
    """Seconds spent compiling in this fit (``History.ranks[i]["compile_s"]``), and the phase while it lasts."""

    def __init__(self) -> None:
        self.installed = False
        self.active = False
        self.seconds = 0.0
        self._started: float | None = None
        self._before = "forward"
        self._hits_before = 0

    def begin(self) -> None:
        """A fit that compiles starts: count from zero."""
        if not self.installed:
            from torch._dynamo.callback import callback_handler

            callback_handler.register_start_callback(self._start)
            callback_handler.register_end_callback(self._end)
            self.installed = True
        self.seconds, self._started, self.active = 0.0, None, True
        self._hits_before = _cache_hits()
        from torch._dynamo.utils import clear_compilation_metrics

        clear_compilation_metrics()  # Dynamo's record of each compile: this fit's only, for report()

    @property
    def cache_hits(self) -> int:
        """Cache hits in this fit (Inductor's FX graphs, AOTAutograd's entries): compiled by a peer rank or an earlier fit."""
        return _cache_hits() - self._hits_before

    def report(self) -> dict[str, object]:
        """This fit's compiles as Dynamo recorded them: recompiles with their reasons, graph breaks, seconds."""
        from torch._dynamo.utils import get_compilation_metrics

        metrics = get_compilation_metrics()
        reasons = [m.recompile_reason.split(": ", 1)[-1] for m in metrics if m.recompile_reason]
        return {"compiles": len(metrics), "recompiles": len(reasons), "reasons": reasons,
                "graph_breaks": sum(m.num_graph_breaks or 0 for m in metrics), "compile_s": self.seconds,
                "cache_hits": self.cache_hits}

    def end(self) -> None:
        """The fit is over (or failed): later compiles (a ``%%ddp`` cell's) count for nobody."""
        self.active = False
        self._started = None

    def _start(self, args: Any) -> None:
        if not self.active:
            return
        self._started = time.perf_counter()
        self._before = BEAT.marked
        BEAT.mark("compiling")

    def _end(self, args: Any) -> None:
        if not self.active or self._started is None:
            return
        self.seconds += time.perf_counter() - self._started
        self._started = None
        BEAT.mark(self._before)


def _cache_hits() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_hit"] + counters["aot_autograd"]["autograd_cache_hit"])


COMPILES = CompileWatch()
