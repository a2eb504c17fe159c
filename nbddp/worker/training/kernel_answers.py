"""Synchronous callback points on the ranks: wait for the kernel's answer, then all apply it at the same step.

When the fit's callbacks define ``on_epoch_end`` (or ``on_validation_end``),
the kernel lists the record kinds to wait after (``FitLaunch.answers``).
After such a record rank 0 publishes it at once and waits for the answer
file (``protocol/epoch_answer.py``); the answer is then broadcast, so every
rank stops, sets the learning rate, or writes the asked checkpoint at the
same step. Without such callbacks nothing here runs: no wait, no collective.

When the group met at a TCPStore (across hosts), the answer comes under a
key of the group's own torch store instead (``FitLaunch.channel`` names the
fit; ``protocol/store_channel.py``): rank 0 blocks on that key, takes the
answer and deletes the key.

The kernel that answers may die while the fit trains on (a detached
session, ``docs/sessions.md``). On the kernel's host rank 0 sees that
(``FitLaunch.answers_pid`` no longer runs) within ``GONE_CHECK_S`` of
waiting: every rank then skips this point and the later ones without
waiting, and the fit's notices and ``History.timings["callback_points_skipped"]``
say how many were skipped. (Across hosts the kernel's pid means nothing to
rank 0: there each point still waits up to ``TIMEOUT_S``.)
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from nbddp.protocol import store_channel
from nbddp.protocol.epoch_answer import TIMEOUT_S, EpochAnswer, answer_path, wait_answer
from nbddp.protocol.host import pid_alive
from nbddp.worker.engine.heartbeat import BEAT


class KernelAnswers:
    """This rank's side of the synchronous callback points of one fit."""

    def __init__(self, rank: int, kinds: tuple[str, ...], prefix: str, group: Any = None,
                 timeout_s: float = TIMEOUT_S, channel: str = "", generation: int = 0, kernel_pid: int = 0):
        self.rank, self.kinds, self.group, self.timeout_s = rank, kinds, group, timeout_s
        self.kernel_pid = kernel_pid  # the kernel that answers (0: unknown; on rank 0's host when no channel)
        self.channel, self.generation = channel, generation  # channel: the fit's token in the store's keys
        self.path = answer_path(prefix) if prefix and kinds and not channel else ""
        self.kinds = kinds if self.path or channel else ()
        self.checkpoint: str | None = None  # asked, written at the next point where a checkpoint can resume
        self.notices: list[str] = []  # for the person, at the end (FitResult.notices)
        self.waited = 0  # points answered
        self.wait_s = 0.0  # seconds this rank waited at them (History.timings["answer_wait_s"], rank 0's)
        self.skipped = 0  # points skipped because the kernel that answers them died (callback_points_skipped)
        self.gone_at: tuple[str, int] | None = None  # (kind, step) of the first of them

    def exchange(self, ts: Any, kind: str) -> None:
        """Every rank, right after a ``kind`` record: wait for the kernel's answer (rank 0), share it, apply it."""
        if kind not in self.kinds or ts.status == "interrupted":
            return
        if self.gone_at is not None:  # every rank learnt it from the same broadcast: no collective from here on
            self.skipped += 1
            return
        BEAT.mark("callbacks")
        t0 = time.perf_counter()
        box: list[Any] = [None]
        if self.rank == 0:
            rep = ts.reporter
            seq = len(rep.records) - 1
            rep.publish(force=True)  # the kernel sees the record now, not at the next publish interval
            box[0] = self.wait(seq)
            if box[0] is None:
                self.notices.append(f"nbddp: the kernel did not answer the callbacks' {kind} point at step {ts.step} "
                                    f"within {self.timeout_s:.0f} s; the workers trained on without its answer (was "
                                    "a callback's hook still running?)")
                box[0] = EpochAnswer(seq=seq)
        src = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        dist.broadcast_object_list(box, src=src, group=self.group)
        self.wait_s += time.perf_counter() - t0
        if box[0].kernel_gone:
            self.gone_at, self.skipped = (kind, ts.step), 1
            return
        self.waited += 1
        self.apply(ts, box[0])

    def gone_notice(self) -> list[str]:
        """Rank 0's notice of the points skipped because their kernel died (none when it never did)."""
        if self.gone_at is None or self.rank != 0:
            return []
        kind, step = self.gone_at
        return [f"nbddp: the kernel that ran this fit's callbacks (pid {self.kernel_pid}) was gone from step {step} "
                f"on: {self.skipped} synchronous callback point(s) ({', '.join(self.kinds)} records) were skipped and "
                "the ranks trained on without waiting; EarlyStopping and the fit's other worker-side rules still "
                "held. Pass callbacks again to a new fit: a fit found running by attach() runs none"]

    def _kernel_gone(self) -> bool:
        return bool(self.kernel_pid) and not pid_alive(self.kernel_pid)

    def wait(self, seq: int) -> EpochAnswer | None:
        """Rank 0: the kernel's answer to record ``seq`` (its file, or its key in the group's store)."""
        if not self.channel:  # (on the kernel's host: its pid tells whether it still lives)
            return wait_answer(self.path, seq, self.timeout_s, gone=self._kernel_gone if self.kernel_pid else None)
        key = store_channel.answer_key(self.channel, self.generation, seq)
        value = store_channel.wait_value(store_channel.rank_store(), key, self.timeout_s)
        if value is None or value.get("seq") != seq:
            return None
        return EpochAnswer(seq=seq, stop=value.get("stop"), lr=value.get("lr"), checkpoint=value.get("checkpoint"))

    def apply(self, ts: Any, answer: EpochAnswer) -> None:
        """What the answer asks, on this rank: the same on every rank."""
        if answer.lr is not None:
            for group in ts.optimizer.param_groups:
                group["lr"] = answer.lr
        if answer.checkpoint is not None:
            self.checkpoint = answer.checkpoint
        if answer.stop is not None and ts.stop_reason is None:
            ts.stop_reason = answer.stop  # a normal end: status stays "completed"

    def take_checkpoint(self) -> str | None:
        """The folder a checkpoint was asked into (once), at a point where the loop can write one."""
        path, self.checkpoint = self.checkpoint, None
        return path
