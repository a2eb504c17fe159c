"""What stays resident on a worker between tasks, and how much memory it holds: ``%ddp status``'s keeps column.

Everything a task allocated is given back when it ends (``worker/memory/release.py``)
except what the person kept: the names of ``%%ddp`` cells (``keep=`` binds
the trained module to one of them, ``%ddp push`` adds others) and the
datasets kept resident between fits. ``resident_items`` sizes each by the
tensor and array memory it reaches (a module's parameters and buffers, a
sharded module's local shards, a dataset's tensors, containers' items),
counting each storage once; other objects count for their own size.

In nbddp's code "kept" names one thing, a model bound by ``dist_fit(keep=...)``
(``worker/inference/kept.py``); what a worker holds between tasks is "resident".
"""

from __future__ import annotations

import sys
from typing import Any

MAX_DEPTH = 4  # how deep containers and objects are followed
MAX_ITEMS = 10_000  # items looked at per container (the rest are not counted)


def _tensor_bytes(t: Any, seen: set[int]) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    try:
        storage = local.untyped_storage()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (meta, some subclasses)
        return 0
    key = storage.data_ptr() or id(storage)
    if key in seen:
        return 0
    seen.add(key)
    return int(storage.nbytes())


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return list(obj.values())[:MAX_ITEMS]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)[:MAX_ITEMS]
    state = getattr(obj, "__dict__", None)
    return list(state.values())[:MAX_ITEMS] if isinstance(state, dict) else []


def nbytes(obj: Any, seen: set[int] | None = None, depth: int = 0) -> int:
    """The memory ``obj`` holds: tensors' storages (each once), arrays, and what containers and objects reach."""
    torch = sys.modules.get("torch")
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if torch is not None and isinstance(obj, torch.Tensor):
        return _tensor_bytes(obj, seen)
    if torch is not None and isinstance(obj, torch.nn.Module):
        return sum(_tensor_bytes(t, seen) for t in (*obj.parameters(), *obj.buffers()))
    array_bytes = getattr(obj, "nbytes", None)  # numpy arrays, pyarrow tables (a datasets.Dataset's .data)
    if isinstance(array_bytes, int) and not isinstance(obj, type):
        return array_bytes
    if isinstance(obj, (str, bytes, bytearray, int, float, complex, bool, type(None))) or depth >= MAX_DEPTH:
        return sys.getsizeof(obj)
    return sys.getsizeof(obj) + sum(nbytes(c, seen, depth + 1) for c in _children(obj))


def resident_items(namespace: dict[str, Any], names: list[str], datasets: dict[str, Any]) -> tuple[tuple[str, int], ...]:
    """``(name, bytes)`` of every ``%%ddp`` name in ``names`` and every resident dataset, largest first.

    Storages shared between items count once, for the first (a module kept
    under two names, a dataset pushed too).
    """
    seen: set[int] = set()
    items = [(name, nbytes(namespace[name], seen)) for name in names if name in namespace]
    items += [(f"resident dataset {key[:8]}", nbytes(ds, seen)) for key, ds in datasets.items()]
    return tuple(sorted(items, key=lambda kv: -kv[1]))
