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
"""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from nbddp.protocol import store_channel
from nbddp.protocol.epoch_answer import TIMEOUT_S, EpochAnswer, answer_path, wait_answer
from nbddp.worker.engine.heartbeat import BEAT


class KernelAnswers:
    """This rank's side of the synchronous callback points of one fit."""

    def __init__(self, rank: int, kinds: tuple[str, ...], prefix: str, group: Any = None,
                 timeout_s: float = TIMEOUT_S, channel: str = "", generation: int = 0):
        self.rank, self.kinds, self.group, self.timeout_s = rank, kinds, group, timeout_s
        self.channel, self.generation = channel, generation  # channel: the fit's token in the store's keys
        self.path = answer_path(prefix) if prefix and kinds and not channel else ""
        self.kinds = kinds if self.path or channel else ()
        self.checkpoint: str | None = None  # asked, written at the next point where a checkpoint can resume
        self.notices: list[str] = []  # for the person, at the end (FitResult.notices)
        self.waited = 0  # points answered
        self.wait_s = 0.0  # seconds this rank waited at them (History.timings["answer_wait_s"], rank 0's)

    def exchange(self, ts: Any, kind: str) -> None:
        """Every rank, right after a ``kind`` record: wait for the kernel's answer (rank 0), share it, apply it."""
        if kind not in self.kinds or ts.status == "interrupted":
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
        self.waited += 1
        self.wait_s += time.perf_counter() - t0
        self.apply(ts, box[0])

    def wait(self, seq: int) -> EpochAnswer | None:
        """Rank 0: the kernel's answer to record ``seq`` (its file, or its key in the group's store)."""
        if not self.channel:
            return wait_answer(self.path, seq, self.timeout_s)
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
