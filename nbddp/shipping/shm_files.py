"""The ``/dev/shm`` files that carry tensors between the kernel and the workers on one host.

A tensor file is written once per transfer by one side and mapped by the
other (``shipping/pickling.py``), in the folder both sides agree on
(``protocol/notes.py``, with the small notes). Large transfers reuse their files
(``BufferPool``); every file carries the session's prefix, so whoever owns
the session can remove them all, a killed worker's too (``remove_files``).
Files are created owner-only (0600).
"""

from __future__ import annotations

import mmap
import os
import secrets
import shutil
import threading

from nbddp.protocol.notes import shm_dir

_POOL_OF: dict[str, "BufferPool"] = {}  # path -> pool, for this process's pooled files


class BufferPool:
    """Shared-memory files reused from one transfer to the next.

    Copying into a fresh ``/dev/shm`` file faults in every page (about
    2 GB/s here); rewriting pages that are already resident runs at memory
    speed. So the files of large transfers (the model and data of each fit,
    in the kernel) are kept and rewritten. The weights coming back are not
    pooled: a pooled file kept the model's size resident on rank 0 between
    fits. Files are named with
    ``prefix`` so whoever owns the session can remove every one of them,
    even those of a worker that was killed.
    """

    def __init__(self, prefix: str, keep: int = 2):
        self.prefix = prefix
        self.keep = keep
        self._free: dict[str, int] = {}  # path -> size
        self._busy: dict[str, int] = {}
        self._maps: dict[str, mmap.mmap] = {}
        self._lock = threading.Lock()

    def acquire(self, size: int) -> tuple[str, mmap.mmap]:
        """A file of at least ``size`` bytes and a writable mapping of it, kept for reuse.

        The mapping stays open between transfers: a fresh mapping takes one
        page fault per 4 KiB page on the next write, even when the pages are
        resident (about 0.1 s per 400 MB here).
        """
        with self._lock:
            fitting = sorted((sz, p) for p, sz in self._free.items() if sz >= size)
            if fitting:
                sz, path = fitting[0]
            elif self._free:  # grow the largest: its resident pages stay resident
                sz, path = max((sz, p) for p, sz in self._free.items())
            else:
                path, sz = os.path.join(shm_dir(), f"{self.prefix}-{secrets.token_hex(6)}"), 0
            self._free.pop(path, None)
            self._busy[path] = max(sz, size)
            _POOL_OF[path] = self
            mm = self._maps.get(path)
        if mm is None or len(mm) < max(size, 1):
            if mm is not None:
                mm.close()
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size < size:
                    os.ftruncate(fd, max(size, 1))
                mm = mmap.mmap(fd, max(size, 1))
            finally:
                os.close(fd)
            with self._lock:
                self._maps[path] = mm
        return path, mm

    def release(self, path: str) -> None:
        with self._lock:
            size = self._busy.pop(path, None)
            if size is None:
                return
            self._free[path] = size
            while len(self._free) > self.keep:
                smallest = min(self._free, key=self._free.__getitem__)
                del self._free[smallest]
                _POOL_OF.pop(smallest, None)
                self._close_map(smallest)
                _unlink(smallest)

    def _close_map(self, path: str) -> None:
        mm = self._maps.pop(path, None)
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # a tensor still views it: the mapping goes with the last view
                pass

    def reclaim(self) -> None:
        """Take back every file handed out (its reader is known to be done)."""
        for path in list(self._busy):
            self.release(path)

    def close(self) -> None:
        with self._lock:
            for path in [*self._free, *self._busy]:
                _POOL_OF.pop(path, None)
                self._close_map(path)
                _unlink(path)
            self._free.clear()
            self._busy.clear()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_files(prefix: str) -> int:
    """Remove every shared-memory file whose name starts with ``prefix`` (session clean-up)."""
    import glob

    paths = glob.glob(os.path.join(shm_dir(), glob.escape(prefix) + "*"))
    for path in paths:
        _POOL_OF.pop(path, None)
        if os.path.isdir(path):  # an elastic fit's snapshot folder
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
    return len(paths)


def release_pooled(path: str) -> None:
    """A pooled file's reader is done: the file goes back to the pool of this process that wrote it."""
    pool = _POOL_OF.get(path)
    if pool is not None:
        pool.release(path)
