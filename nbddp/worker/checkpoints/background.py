"""An elastic fit's snapshots written off the training thread: the step waits only for the copy.

At a snapshot the training thread copies the state into host buffers kept
for the fit (``Writer.stage``: pinned on CUDA and filled with
``copy_(non_blocking=True)``, then one device sync; a plain copy on the
CPU). torch's ``DefaultStager`` does the same with a generic deep copy, which
took 15 ms for a 400k-parameter model's state here against 0.2 ms for these
copies, and it misreads some DTensors (see ``stage``).
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

import copy
import os
import sys
import threading
from datetime import timedelta
import time
from typing import Any, Callable

import torch

_IMMUTABLE = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)
INLINE_ENV = "NBDDP_SNAPSHOT_INLINE"
SIDE_TIMEOUT = timedelta(seconds=120)  # a write's collective or peer copy waiting on a rank that is gone


class Writer:
    """One fit's snapshot writes on one rank: at most one in flight, its failure raised at the next wait."""

    def __init__(self, device: torch.device):
        self.device = device
        self.inline = os.environ.get(INLINE_ENV, "") not in ("", "0")
        self.write_s = 0.0  # seconds the writes themselves took (in the thread, or inline)
        self._buffers: dict[tuple, torch.Tensor] = {}  # the host copies, by their place in the state
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._side_group: Any = None

    # ---- the copy, on the training thread -----------------------------------------------------------
    def stage(self, state: Any) -> Any:
        """A host copy of ``state`` (tensors anywhere inside it, DTensors too), safe to write while training goes on.

        Each tensor is copied into a host buffer kept for the fit under its place in ``state`` (reallocated
        only when its shape or dtype changes): pinned on CUDA, filled with ``copy_(non_blocking=True)``, then
        one sync of the device, so the step waits for the copy and nothing more. A DTensor (FSDP, tensor
        parallel) becomes a DTensor of the same spec around the host copy of its local part, which is what
        DCP's own staging makes of one. Other values are rebuilt through dicts, lists and tuples, and
        deep-copied unless immutable.
        """
        if self.inline:
            return state
        copied = self._copy(state, ())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return copied

    def _copy(self, obj: Any, where: tuple) -> Any:
        dtensor = _dtensor_class()
        if dtensor is not None and isinstance(obj, dtensor):
            return dtensor(self._buffer(obj.to_local(), where), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            return self._buffer(obj, where)
        if isinstance(obj, dict):
            return {k: self._copy(v, where + (k,)) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._copy(v, where + (i,)) for i, v in enumerate(obj)]
        if type(obj) is tuple:
            if all(isinstance(v, _IMMUTABLE) for v in obj):  # (random.getstate(): 625 ints)
                return obj
            return tuple(self._copy(v, where + (i,)) for i, v in enumerate(obj))
        return obj if isinstance(obj, _IMMUTABLE) else copy.deepcopy(obj)

    def _buffer(self, t: torch.Tensor, where: tuple) -> torch.Tensor:
        buf = self._buffers.get(where)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=self.device.type == "cuda" and t.is_cuda)
            self._buffers[where] = buf
        return buf.copy_(t.detach(), non_blocking=t.is_cuda)

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
            self._buffers.clear()
            if self._side_group is not None:
                import torch.distributed as dist

                try:
                    dist.destroy_process_group(self._side_group)
                except Exception:  # noqa: BLE001 - the group may already be gone with a failed world
                    pass
                self._side_group = None


class Staged:
    """DCP's ``AsyncStager`` for a state dict already in host memory (``Writer.stage``): nothing to do."""

    should_synchronize_after_execute = False
    _synchronize_after_execute = False  # what the protocol's own should_synchronize_after_execute property reads

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        """Nothing is staged in the background."""

    def close(self) -> None:
        """No buffers of its own: the Writer keeps them."""


def _dtensor_class() -> Any:
    """DTensor, if this process has imported it (a DDP fit never does, and need not pay for the import)."""
    return getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
