"""Batches copied to the GPU while the previous step computes.

On CUDA, ``prefetch(batches, device, depth)`` keeps ``depth`` batches ahead:
each is moved from (pinned) host memory to the GPU with ``non_blocking``
copies on a side stream, while the default stream runs the current step.
Before a batch is used, the default stream waits for its copy, and every
tensor is marked as used on the default stream (``record_stream``), so the
caching allocator does not hand its memory to the side stream too early.
On CPU there is nothing to overlap: the batches pass through unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any, Iterator

import torch

from nbddp.worker.data.batches import move


def _record(batch: Any, stream: Any) -> None:
    if isinstance(batch, torch.Tensor):
        batch.record_stream(stream)
    elif isinstance(batch, Mapping):
        for v in batch.values():
            _record(v, stream)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            _record(v, stream)


class CudaPrefetcher:
    def __init__(self, batches: Iterator[Any], device: torch.device, depth: int):
        self.batches, self.device, self.depth = batches, device, depth
        self.stream = torch.cuda.Stream(device=device)
        self.ready: deque[Any] = deque()
        self.exhausted = False
        for _ in range(depth):
            self._load()

    def _load(self) -> None:
        if self.exhausted:
            return
        try:
            batch = next(self.batches)
        except StopIteration:
            self.exhausted = True
            return
        with torch.cuda.stream(self.stream):
            self.ready.append(move(batch, self.device, non_blocking=True))

    def __iter__(self) -> "CudaPrefetcher":
        return self

    def __next__(self) -> Any:
        if not self.ready:
            raise StopIteration
        batch = self.ready.popleft()
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self.stream)
        _record(batch, current)
        self._load()
        return batch


def prefetch(batches: Iterator[Any], device: torch.device, depth: int) -> Iterator[Any]:
    """``batches`` with the next ``depth`` already on their way to ``device`` (CUDA only; else unchanged)."""
    if device.type != "cuda" or depth <= 0:
        return batches
    return CudaPrefetcher(iter(batches), device, depth)
