"""``dist_fit(compile=...)`` as both sides read it: ``CompileSpec``, plain data that travels in the ``FitConfig``.

The kernel turns ``True`` or a dict into a ``CompileSpec`` and checks every
field against the torch it runs (``fit/compile_checks.py``); each rank then
compiles what its strategy says (``worker/strategies/compiling.py``). The
cache directory is chosen by the kernel, once per session and host, so that
every rank and every later fit of the session reads one Inductor cache.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass

COMPILE_KEYS = ("mode", "backend", "fullgraph", "dynamic", "regional")


@dataclass(frozen=True)
class CompileSpec:
    """How each rank compiles its module: ``torch.compile``'s own arguments, plus ``regional``.

    ``regional``: compile each repeated block on its own (FSDP's units, a
    transformer's layers) instead of the whole module: one small graph
    compiled once and reused by every block, and no graph across FSDP's
    all-gathers. Strategies without blocks compile their whole module.
    """

    mode: str | None = None  # None: torch's "default"
    backend: str = "inductor"
    fullgraph: bool = False
    dynamic: bool | None = None  # None: torch decides (static first, dynamic after a size changes)
    regional: bool = True
    cache_dir: str = ""  # Inductor's caches, one per session and host (set by the kernel)

    def kwargs(self) -> dict[str, object]:
        """The arguments of ``torch.compile`` / ``nn.Module.compile``."""
        out: dict[str, object] = {"backend": self.backend, "fullgraph": self.fullgraph, "dynamic": self.dynamic}
        if self.mode is not None:
            out["mode"] = self.mode
        return out


def session_cache_dir(file_prefix: str) -> str:
    """Where a host's ranks keep Inductor's caches for one session (``/tmp/<session prefix>-inductor``).

    Removed by ``nbddp.stop()`` on the kernel's host, and by the reaper when the kernel dies without it.
    """
    return os.path.join(tempfile.gettempdir(), f"{file_prefix}-inductor")
