"""The last leg of a synchronous callback's round trip: the kernel's answer written, rank 0 holding it (issue 37).

Two ways to carry it, measured on this machine in the same run, each with
two processes (a "rank 0" that already waits, a "kernel" that answers
``delay_s`` later, as the watcher does after the hooks ran):

* ``file``: the owner-only file in /dev/shm that rank 0 polls (backoff from
  0.5 ms to 5 ms: ``protocol/epoch_answer.py``), used when rank 0 is on the
  kernel's host;
* ``store``: a key in the group's ``TCPStore`` that rank 0 blocks on
  (``protocol/store_channel.py``), used when rank 0 is on another host
  (here over loopback: the network's own latency comes on top).

Each figure is the median, over ``reps`` answers, of the time from the
kernel's write to rank 0 having the answer (``time.time`` on both sides:
one machine, one clock). Run: ``python benchmarks/answer_channel.py``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time
from datetime import timedelta
from typing import Any


def _rank0(kind: str, where: Any, reps: int, ready: Any, out: Any) -> None:
    from nbddp.protocol import epoch_answer, store_channel

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", where, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=60)) if kind == "store" else None
    ready.set()
    lags = []
    for seq in range(reps):
        if kind == "file":
            got = epoch_answer.wait_answer(where, seq, timeout_s=30)
            sent = got.lr
        else:
            sent = store_channel.wait_value(store, store_channel.answer_key("bench", 0, seq), timeout_s=30)["lr"]
        lags.append(time.time() - sent)
    out.put(lags)
    if store is not None:
        time.sleep(0.5)  # the kernel's client disconnects first


def _kernel(kind: str, where: Any, reps: int, delay_s: float) -> None:
    from nbddp.protocol import epoch_answer, store_channel

    client = store_channel.KernelStore("127.0.0.1", where, 0) if kind == "store" else None
    for seq in range(reps):
        time.sleep(delay_s)  # rank 0 waits meanwhile (its poll backs off to its longest pause)
        if client is None:
            epoch_answer.write_answer(where, epoch_answer.EpochAnswer(seq=seq, lr=time.time()))
        else:
            client.set(store_channel.answer_key("bench", 0, seq), {"seq": seq, "lr": time.time()})


def measure(reps: int = 50, delay_s: float = 0.02) -> dict[str, float]:
    """Median ms from the kernel's write to rank 0 holding the answer, for ``file`` and ``store``."""
    from nbddp.protocol.host import free_port
    from nbddp.protocol.notes import shm_dir

    ctx = mp.get_context("spawn")
    result = {}
    for kind in ("file", "store"):
        if kind == "file":
            where: Any = os.path.join(shm_dir(), f"nbddp-bench-{os.getpid()}-{next(tempfile._get_candidate_names())}")
        else:
            where = free_port("127.0.0.1")
        ready, out = ctx.Event(), ctx.Queue()
        rank0 = ctx.Process(target=_rank0, args=(kind, where, reps, ready, out))
        rank0.start()
        try:
            ready.wait(60)
            kernel = ctx.Process(target=_kernel, args=(kind, where, reps, delay_s))
            kernel.start()
            lags = out.get(timeout=120)
            kernel.join(60)
        finally:
            rank0.join(60)
            if kind == "file" and os.path.exists(where):
                os.remove(where)
        result[kind] = statistics.median(lags) * 1e3
    return result


def main(quick: bool = False) -> dict[str, float]:
    """The medians, as the other benchmarks' ``main`` (``quick``: 20 answers instead of 50)."""
    return measure(reps=20 if quick else 50)


if __name__ == "__main__":
    figures = main()
    print(f"kernel's write -> rank 0 holds the answer (median ms): file {figures['file']:.2f}, "
          f"store {figures['store']:.2f}")
