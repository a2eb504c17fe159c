"""A compact text progress line for terminals and scripts, and a final summary."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from nbddp.live.state import FitRecords, LiveState, ViewedFit
from nbddp.live.time_bars import split_sentence


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60:d}:{seconds % 60:02d}"


def estimated_total(state: LiveState, hist: FitRecords) -> int:
    """A stream's total steps, guessed from the epochs it finished (0: no guess yet).

    A stream's length is known only at its end, so until one epoch ended the
    views show ``step 12/?``; after that, the steps of the last epoch times
    the epochs left, shown as ``~``.
    """
    done = hist.epochs
    if not done or not state.epochs:
        return 0
    if len(done) >= 2:
        per_epoch = done[-1]["step"] - done[-2]["step"]
    elif state.start_step == 0:
        per_epoch = done[0]["step"]
    else:
        return 0  # the first epoch seen was resumed part-way: its steps say nothing of a whole one
    return done[-1]["step"] + per_epoch * max(0, state.epochs - done[-1]["epoch"] - 1)


def progress_fields(run: ViewedFit) -> dict[str, Any]:
    """What every view shows: step/total, epoch, loss, lr, throughput, elapsed, ETA."""
    state, hist = run.live_state, run.history
    last = hist.steps[-1] if hist.steps else {}
    step = last.get("step", state.start_step)
    total, guessed = state.total_steps, False
    if not total and state.plan is not None:
        total = step if state.status == "completed" else estimated_total(state, hist)
        guessed = bool(total) and state.status != "completed"
    train_time = last.get("time", 0.0)  # seconds since training began, on the workers
    done_from = state.start_step
    rate = (step - done_from) / train_time if train_time > 0 else 0.0
    eta = (total - step) / rate if rate > 0 and total and step < total else None
    finished = getattr(run, "finished", False)
    if hist.timings.get("total_s") is not None:
        elapsed = hist.timings["total_s"]  # the whole call, shipping and returning weights included
    elif getattr(run, "started_at", None) is not None and not finished:
        elapsed = time.perf_counter() - run.started_at
    else:
        elapsed = train_time
    if finished:
        eta = None
    val = hist.validations[-1] if hist.validations else {}
    return {"status": state.status, "step": step, "total": total,
            "total_text": f"~{total}" if guessed else str(total or "?"),
            "epoch": last.get("epoch", 0), "epochs": state.epochs, "loss": last.get("loss"),
            "lr": last.get("lr"), "samples_per_s": last.get("samples_per_s"), "elapsed": elapsed, "eta": eta,
            "val": {k: v for k, v in val.items() if k.startswith("val_")},
            "fraction": min(1.0, step / total) if total else 0.0}


def fmt_bytes(n: float | None) -> str:
    if not n:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


FINAL_STATES = {"completed": "done", "interrupted": "stopped", "failed": "failed"}


def ended_status(run: ViewedFit) -> str | None:
    """``"completed"``, ``"interrupted"`` or ``"failed"`` once the fit ended, else None.

    The views draw their last frame before ``run.finished`` turns true, so the
    final status (or an error) decides, not the flag alone.
    """
    status = run.live_state.status
    if getattr(run, "error", None) is not None and status not in ("failed", "interrupted"):
        return "failed"
    if status in FINAL_STATES:
        return status
    return "completed" if getattr(run, "finished", False) else None


def failed_ranks(run: ViewedFit) -> set[int]:
    """The ranks the fit's error names (its first failure and the others)."""
    error = getattr(run, "error", None)
    ranks = {getattr(error, "rank", None)} | {getattr(f, "rank", None) for f in getattr(error, "others", [])}
    return {r for r in ranks if r is not None}


def rank_state(run: ViewedFit, rank: int, positions: dict[int, dict[str, Any]]) -> str:
    """Where a rank is (``"step 12 · backward"``, from its heartbeat), or, once the fit ended, its final state.

    A failed fit reads ``failed`` on the ranks its error names and ``stopped``
    on the others.
    """
    ended = ended_status(run)
    if ended == "failed":
        named = failed_ranks(run)
        return "failed" if not named or rank in named else "stopped"
    if ended is not None:
        return FINAL_STATES[ended]
    pos = positions.get(rank)
    return f"step {pos['step']} · {pos['phase']}" if pos else "-"


def rank_positions(state: LiveState) -> str:
    """Where every rank is, from its heartbeat: ``"0: step 3 backward · 1: step 3 data, stalled 12 s"``."""
    stalled = {s["rank"]: s for s in state.stalled}
    paused = {p["rank"]: p for p in state.paused}
    parts = []
    for pos in state.positions:
        text = f"{pos['rank']}: step {pos['step']} {pos['phase']}"
        if pos["rank"] in paused:
            text = f"{pos['rank']}: paused"
        elif paused:
            text += f", waiting for rank {min(paused)}"
        elif pos["rank"] in stalled:
            text += f", stalled {stalled[pos['rank']]['idle_s']:.0f} s"
        parts.append(text)
    return " · ".join(parts)


def paused_lines(state: LiveState) -> list[str]:
    """``"rank 1 paused at Cell In[3], line 4 (step_fn), %ddp debug 1 to attach"`` for each paused rank."""
    return [f"rank {p['rank']} paused at {p['where']}" + (f" ({p['function']})" if p.get("function") else "")
            + f", `%ddp debug {p['rank']}` to attach" for p in state.paused]


REPORT_KEYS_SKIPPED = ("step", "time", "samples", "samples_per_s")


def reported_values(run: ViewedFit) -> list[tuple[str, float]]:
    """A call's reports (``nbddp.report``): each metric's latest reduced value, in the order they first came."""
    hist = run.history
    latest: dict[str, float] = {}
    for record in reversed(hist.steps[-50:]):
        for k, v in record.items():
            latest.setdefault(k, v)
    names = getattr(hist, "metrics", None) or list(latest)
    return [(k, latest[k]) for k in names if k in latest and k not in REPORT_KEYS_SKIPPED]


def report_text(run: ViewedFit) -> str:
    """``step 120 · loss 0.41 · acc 0.9 · 5,120 samples/s · 0:12 elapsed``: a reporting call's progress."""
    f = progress_fields(run)
    parts = [f"step {f['step']}"] + [f"{k} {v:.4g}" for k, v in reported_values(run)]
    if f["samples_per_s"]:
        parts.append(f"{f['samples_per_s']:,.0f} samples/s")
    parts.append(f"{fmt_time(f['elapsed'])} elapsed")
    return " · ".join(parts)


def progress_line(run: ViewedFit) -> str:
    if run.live_state.kind == "report":
        ended = ended_status(run) is not None
        positions = "" if ended else rank_positions(run.live_state)
        return f"[{run.live_state.status}]  {report_text(run)}" + (f"  ranks {positions}" if positions else "")
    f = progress_fields(run)
    parts = [f"[{f['status']}]", f"step {f['step']}/{f['total_text']}", f"epoch {f['epoch'] + 1}/{f['epochs'] or '?'}"]
    if f["loss"] is not None:
        parts.append(f"loss {f['loss']:.4g}")
    parts += [f"{k} {v:.4g}" for k, v in f["val"].items()]
    if f["samples_per_s"]:
        parts.append(f"{f['samples_per_s']:.0f} samples/s")
    parts.append(f"{fmt_time(f['elapsed'])}" + (f" (ETA {fmt_time(f['eta'])})" if f["eta"] is not None else ""))
    ended = ended_status(run) is not None
    positions = "" if ended else rank_positions(run.live_state)
    if positions:
        parts.append(f"ranks {positions}")
    if not ended:
        parts += paused_lines(run.live_state)
    parts += run.live_state.restarts  # an elastic fit's lost ranks, and where it resumed
    return "  ".join(parts)


class TextView:
    """One line, rewritten in place on a terminal, at most every ``every`` seconds."""

    def __init__(self, stream: TextIO | None = None, every: float = 1.0):
        self.stream = stream or sys.stdout
        self.every = every
        self._last = 0.0
        self._paused: tuple[int, ...] = ()
        self._tty = hasattr(self.stream, "isatty") and self.stream.isatty()

    def start(self, run: ViewedFit) -> None:
        state = run.live_state
        batch = f", {state.batch_text()}" if state.batch_size else ""
        if state.kind == "report":
            self.stream.write(f"nbddp: what {state.world_size or '?'} rank(s) report (nbddp.report), backend "
                              f"{state.backend or '?'}\n")
            self.stream.flush()
            return
        self.stream.write(f"nbddp: training on {state.world_size or '?'} rank(s), backend {state.backend or '?'}"
                          f"{batch}\n")
        self.stream.flush()

    def update(self, run: ViewedFit) -> None:
        now = time.monotonic()
        if now - self._last < self.every:
            return
        paused = tuple(p["rank"] for p in run.live_state.paused)
        if paused and paused == self._paused:  # said once: the person may be typing at the prompt below
            return
        self._last, self._paused = now, paused
        line = progress_line(run)
        self.stream.write(("\r" + line + "\x1b[K") if self._tty else line + "\n")
        self.stream.flush()

    def finish(self, run: ViewedFit) -> None:
        # on a terminal the final line replaces the last progress line instead of repeating it below
        self.stream.write(("\r" + progress_line(run) + "\x1b[K\n") if self._tty else progress_line(run) + "\n")
        sentence = split_sentence(run)
        if sentence and run.error is None:
            self.stream.write(f"nbddp: time split: {sentence}\n")
        if run.error is not None:
            self.stream.write(f"nbddp: training failed: {str(run.error).splitlines()[0]}\n")
        self.stream.flush()
