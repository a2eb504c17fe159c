"""Which source lines each worker already holds, so tracebacks on a rank show the person's lines.

Code shipped by value runs on the workers with no file behind it; its lines
travel with a call the first time a worker needs them
(``shipping/source_lines.py`` registers them there). This ledger, one per
session, remembers per worker process which file contents it holds, so each
content goes to each worker once.
"""

from __future__ import annotations

import dataclasses
import hashlib
import linecache
import os
import threading
from typing import Any

from nbddp.protocol.placement import Placement
from nbddp.shipping.pickling import Parcel
from nbddp.shipping.source_lines import Source, cell_number


class SourceLedger:
    """Which file contents each worker process already holds; what a call must carry to it."""

    def __init__(self) -> None:
        self._held: dict[tuple[str, int], dict[str, str]] = {}  # (host, pid) -> filename -> digest
        self._digests: dict[str, tuple[Any, Source | None]] = {}  # filename -> (linecache entry, its Source)
        self._lock = threading.Lock()

    def source(self, filename: str) -> Source | None:
        """The kernel's lines of ``filename`` (None: it has none), hashed once per linecache entry."""
        if not filename.startswith("<") and os.path.exists(filename):
            linecache.checkcache(filename)  # a module edited on disk and reloaded: its new lines
        lines = linecache.getlines(filename)
        entry = linecache.cache.get(filename)
        known = self._digests.get(filename)
        if known is not None and entry is not None and known[0] is entry:
            return known[1]
        found = None
        if lines:
            digest = hashlib.blake2b("".join(lines).encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
            found = Source(filename, digest, tuple(lines), cell_number(filename))
        self._digests[filename] = (entry, found)
        return found

    def attach(self, parcel: Parcel | None, placement: Placement) -> Parcel | None:
        """``parcel`` carrying the lines this worker lacks (a copy; the shared parcel is left as it is)."""
        if parcel is None or not parcel.source_files:
            return parcel
        key = (placement.host, placement.pid)
        with self._lock:
            held = self._held.setdefault(key, {})
            missing = []
            for filename in parcel.source_files:
                found = self.source(filename)
                if found is not None and held.get(filename) != found.digest:
                    missing.append(found)
                    held[filename] = found.digest
        return dataclasses.replace(parcel, sources=tuple(missing)) if missing else parcel

    def forget(self) -> None:
        """After ``stop()``: the next workers hold nothing."""
        with self._lock:
            self._held.clear()
