"""``nbddp.compile_cache(save=..., load=...)`` on a rank: torch's portable cache artifacts out of, or into, this engine.

``torch.compiler.save_cache_artifacts`` gives what this process compiled
(Inductor's graphs, AOTAutograd's entries, autotuning results) as bytes
that another process, on another machine with the same torch, loads with
``load_cache_artifacts`` and then compiles from cache.
"""

from __future__ import annotations

from typing import Any


def save_artifacts() -> tuple[bytes, dict[str, int]] | None:
    """This rank's artifacts and how many of each kind, or ``None`` when it compiled nothing."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        return None
    blob, info = saved
    return blob, {kind: len(keys) for kind, keys in info.artifacts.items()}


def load_artifacts(blobs: list[bytes], cache_dir: str) -> dict[str, int]:
    """Load every blob into this rank's caches (the session's directory); how many artifacts of each kind."""
    import torch

    from nbddp.protocol.compile_settings import CompileSpec
    from nbddp.worker.strategies.compiling import prepare_inductor

    prepare_inductor(CompileSpec(cache_dir=cache_dir))
    counts: dict[str, Any] = {}
    for blob in blobs:
        info = torch.compiler.load_cache_artifacts(blob)
        for kind, keys in (info.artifacts.items() if info is not None else ()):
            counts[kind] = counts.get(kind, 0) + len(keys)
    return counts
