"""``handle.profile(steps)`` on a rank: rank 0 reads the kernel's request, every rank traces the agreed steps.

Rank 0 looks for the request file (``protocol.profile_spec.request_path``)
when it packs a record's reduction and puts ``(id, steps)`` in it; every rank
starts tracing right after that reduction, so all trace the same steps. A
rank publishes its trace (``PUBLISH_KEYS["profile"]``) as soon as its steps
are done, while the fit goes on; the kernel merges them
(``nbddp/profiling/requests.py``). When the group met at a TCPStore (across
hosts), the request comes through the group's torch store instead
(``protocol/store_channel.newest_request``, one non-blocking round trip).
"""

from __future__ import annotations

import time

import torch

from nbddp.protocol import store_channel
from nbddp.protocol.messages import PUBLISH_KEYS
from nbddp.protocol.profile_spec import ProfileSpec, request_path
from nbddp.protocol.notes import read_note
from nbddp.worker.engine.heartbeat import engine_publisher
from nbddp.worker.training.profiler import StepProfiler

LOOK_EVERY_S = 0.05  # across hosts, rank 0 asks the store for a request at most this often (not at every step)


class AskedProfiles:
    """The profiles the notebook asks of this fit while it runs."""

    def __init__(self, rank: int, device: torch.device, agreed_us: float, prefix: str, channel: str = ""):
        self.rank, self.device, self.agreed_us = rank, device, agreed_us
        self.channel = channel  # a group across hosts: the fit's token in the store's keys
        self.path = request_path(prefix) if prefix and not channel else ""
        self.looked = -LOOK_EVERY_S  # when rank 0 last asked the store
        self.seen = 0  # the last request id started
        self.current: tuple[int, StepProfiler] | None = None

    def pending(self) -> tuple[float, float]:
        """Rank 0, at a reduction: ``(id, steps)`` of a request not yet started, else ``(0, 0)``."""
        if self.rank != 0 or self.current is not None or not (self.path or self.channel):
            return 0.0, 0.0
        if self.channel:  # a round trip to the store: at most every LOOK_EVERY_S (a person's request can wait that)
            now = time.monotonic()
            if now - self.looked < LOOK_EVERY_S:
                return 0.0, 0.0
            self.looked = now
            asked = store_channel.newest_request(store_channel.rank_store(), self.channel, self.seen)
            return (float(asked["id"]), float(asked["steps"])) if asked else (0.0, 0.0)
        request = read_note(self.path)
        if request is None:  # none, or being replaced
            return 0.0, 0.0
        return (float(request["id"]), float(request["steps"])) if request["id"] > self.seen else (0.0, 0.0)

    def start(self, request: int, steps: int) -> None:
        """Every rank, right after the reduction that carried the request."""
        self.seen = request
        if self.current is None:
            spec = ProfileSpec(wait=0, warmup=1, active=steps)
            self.current = (request, StepProfiler(spec, self.device, self.agreed_us))

    def step(self) -> None:
        """After an optimizer step: trace it; publish the trace once the steps are done."""
        if self.current is not None:
            self.current[1].step()
            if self.current[1].prof is None:
                self.end()

    def end(self) -> None:
        """Publish what was traced (the fit may be ending): the kernel waits for every rank's."""
        if self.current is None:
            return
        request, prof = self.current
        self.current = None
        trace = prof.close()
        publish = engine_publisher()
        if publish is not None:
            publish({PUBLISH_KEYS["profile"]: (request, trace)})
