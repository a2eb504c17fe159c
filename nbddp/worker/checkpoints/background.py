"""An elastic fit's snapshots written off the training thread: the step waits only for the copy.

At a snapshot the training thread copies the state into host buffers
(``stage``: torch's own ``DefaultStager``, which keeps one host copy per
source tensor across snapshots, pinned on CUDA and filled with
``copy_(non_blocking=True)`` then one device sync; a plain copy on the CPU).
A thread then serialises and writes those buffers (``Writer.submit``), under
a temporary name and renamed, as a synchronous write did: a rank killed
mid-write still leaves the previous whole snapshot. One write at a time: the
next snapshot, the fit's end (``Writer.close``) and a relaunch's read wait
for the previous write, so the buffers are never refilled while written and
every rank reads the same newest snapshot.

``NBDDP_SNAPSHOT_INLINE=1`` in a worker's environment writes on the training
thread instead, the way snapshots were written before: the benchmark's A/B.
"""

from __future__ import annotations

import os
import threading
from datetime import timedelta
import time
from typing import Any, Callable

import torch

INLINE_ENV = "NBDDP_SNAPSHOT_INLINE"
SIDE_TIMEOUT = timedelta(seconds=120)  # a write's collective or peer copy waiting on a rank that is gone


class Writer:
    """One fit's snapshot writes on one rank: at most one in flight, its failure raised at the next wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self.inline = os.environ.get(INLINE_ENV, "") not in ("", "0")
        self.write_s = 0.0  # seconds the writes themselves took (in the thread, or inline)
        self._stager: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._side_group: Any = None

    # ---- the copy, on the training thread -----------------------------------------------------------
    @property
    def stager(self) -> Any:
        """torch's stager, kept for the fit: its host buffers are reused by every snapshot (pinned on CUDA)."""
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            cuda = self.device.type == "cuda"
            self._stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                        use_async_staging=False, use_non_blocking_copy=cuda))
        return self._stager

    def stage(self, state: Any) -> Any:
        """A host copy of ``state`` (tensors anywhere inside it), safe to write while training goes on."""
        if self.inline:
            return state
        return self.stager.stage(state)

    def stage_shards(self, state: Any) -> Any:
        """``stage`` for a state dict of DTensors (FSDP, tensor parallel): each one's local shard copied.

        torch's stager reads some DTensors as plain storage (torch 2.13: a replicated DTensor's ``data_ptr``
        is not 0, and copying its storage raises "invalid python storage"), so the local tensors are
        staged and each DTensor is rebuilt around its host copy with its own spec, which is what DCP's
        staging makes of one (a DTensor whose local part is in host memory).
        """
        if self.inline:
            return state
        return _rebuilt(self.stager.stage(_swapped(state, lambda d: d.to_local())), state)

    def side_group(self, group: Any) -> Any:
        """A gloo group of ``group``'s ranks for the writes' own collectives (DCP's), apart from training's.

        Made at the first snapshot that needs it, by every rank at the same step (``new_group`` is
        collective over the world; an elastic fit trains on all of it). Not with a name hashed from its
        ranks (``use_local_synchronization``): a second fit of the same generation would meet the first
        one's addresses in the store.
        """
        if self._side_group is None:
            import torch.distributed as dist

            ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
            self._side_group = dist.new_group(ranks, backend="gloo", timeout=SIDE_TIMEOUT)
        return self._side_group

    # ---- the write, in the background ------------------------------------------------------------------
    def submit(self, write: Callable[[], Any]) -> None:
        """Run ``write`` in the writer thread once the previous write is done (inline when so configured)."""
        self.wait()
        if self.inline:
            self._timed(write)
            return
        self._thread = threading.Thread(target=self._run, args=(write,), name="nbddp-snapshot-writer", daemon=True)
        self._thread.start()

    def _timed(self, write: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        try:
            write()
        finally:
            self.write_s += time.perf_counter() - t0

    def _run(self, write: Callable[[], Any]) -> None:
        try:
            self._timed(write)
        except BaseException as exc:  # noqa: BLE001 - raised on the training thread at the next wait
            self._error = exc

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self, raise_error: bool = True) -> None:
        """Until the previous write is done; its failure raised here (the previous snapshot stays the newest)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise RuntimeError(f"nbddp: writing an elastic fit's snapshot failed ({type(error).__name__}: {error}); "
                               "the previous snapshot is kept. If /dev/shm is full, free it or lower snapshot_every's "
                               "frequency") from error

    def close(self, raise_error: bool = True) -> None:
        """At the fit's end, whatever its outcome: the last write finished, buffers and side group let go."""
        try:
            self.wait(raise_error)
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._side_group is not None:
                import torch.distributed as dist

                try:
                    dist.destroy_process_group(self._side_group)
                except Exception:  # noqa: BLE001 - the group may already be gone with a failed world
                    pass
                self._side_group = None


class Staged:
    """DCP's ``AsyncStager`` for a state dict already in host memory (``Writer.stage_shards``): nothing to do."""

    should_synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing is staged in the background."""

    def close(self) -> None:
        """No buffers of its own: the Writer's stager keeps them."""


def _swapped(state: Any, swap: Callable[[Any], Any]) -> Any:
    """``state`` with each DTensor replaced by ``swap(it)``, through dicts and lists."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return swap(state)
    if isinstance(state, dict):
        return {k: _swapped(v, swap) for k, v in state.items()}
    if isinstance(state, list):
        return [_swapped(v, swap) for v in state]
    return state


def _rebuilt(staged: Any, original: Any) -> Any:
    """``staged`` (host copies, DTensors as their local parts) with each DTensor of ``original`` put back."""
    from torch.distributed.tensor import DTensor

    if isinstance(original, DTensor):
        return DTensor(staged, original._spec, requires_grad=False)  # the host copy, the original's placement
    if isinstance(original, dict):
        return {k: _rebuilt(staged[k], v) for k, v in original.items()}
    if isinstance(original, list):
        return [_rebuilt(s, o) for s, o in zip(staged, original)]
    return staged
