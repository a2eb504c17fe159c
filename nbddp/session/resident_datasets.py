"""Datasets the workers keep between fits, as the kernel tracks them.

Fitting twice on the same tensors should not ship them twice. Each dataset
passed by value gets a content key (``shipping.fingerprint``); once a fit
with it succeeded, the workers hold it under that key and the next fit sends
the key alone. The kernel's list is the truth: every fit tells the workers
which keys to keep (``FitLaunch.resident``), and they drop the rest.

Anything that may have left the workers' caches in doubt (a failed fit, a
new process-group generation) empties the list, so the next fit ships afresh.
"""

from __future__ import annotations

import threading
from typing import Any

from nbddp.shipping import pickling as shipping
MAX_RESIDENT = 4  # datasets kept on the workers between fits


class ResidentSet:
    def __init__(self, limit: int = MAX_RESIDENT):
        self.limit = limit
        self._keys: dict[str, None] = {}  # oldest first
        self._lock = threading.Lock()

    def __contains__(self, key: str) -> bool:
        return key in self._keys

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    def key_specs(self, specs: list[Any], by_value: bool = False) -> list[str]:
        """Give each dataset passed by value its key; one the workers hold is replaced by the key alone.

        ``by_value``: keep the dataset in the spec all the same (an elastic fit may relaunch on new workers).
        """
        keys = []
        for spec in specs:
            if spec is None or spec.dataset is None or spec.stream:
                # factories run on the workers every time: they may build something new; a stream is read
                # (and may be moved by load_state_dict) in each fit, so each fit gets the person's copy afresh
                continue
            key = shipping.fingerprint(spec.dataset)
            if key is None:
                continue
            spec.key = key
            keys.append(key)
            if key in self and not by_value:
                spec.dataset = None  # the workers have it: send the key alone
        return keys

    def to_keep(self, new: list[str]) -> tuple[str, ...]:
        """What the workers should keep after this fit: its datasets first, then the newest others."""
        return tuple(list(dict.fromkeys([*new, *reversed(self.keys())]))[: self.limit])

    def mark(self, keys: list[str]) -> None:
        """A fit with these datasets succeeded: the workers hold them now."""
        with self._lock:
            for key in keys:
                self._keys.pop(key, None)
                self._keys[key] = None
            while len(self._keys) > self.limit:
                self._keys.pop(next(iter(self._keys)))

    def clear(self) -> None:
        with self._lock:
            self._keys.clear()
