"""Holistic Trace Analysis (HTA) on a profile's per-rank traces, where it is installed and the ranks ran GPU kernels.

HTA (``pip install "nbddp[profile]"``) reads one trace file per rank, each
naming its rank in ``distributedInfo``: nbddp writes them next to the merged
trace (``<trace>-ranks/rank-N.json``, on the merged file's clock, owner-only)
so HTA, or a person with HTA, can read them. On each rank that ran GPU
kernels nbddp calls HTA's temporal breakdown, its communication/computation
overlap and its idle-time breakdown (why the GPU sat idle: the host had not
launched the next kernel yet, the gap between back-to-back kernels, or
something else, such as a kernel waiting on another stream's event).

HTA reads GPU kernels only: on CPU traces (gloo) it fails or gives NaN (HTA
0.5.0). So without GPU kernels, without HTA, or when HTA fails, the profile
keeps nbddp's own breakdown (``trace_analysis.py``) and says why: an
analysis never fails a fit. Each rank gets a ``TraceAnalysis`` of its own,
which HTA parses in this process (with several ranks at once it would start
a pool of processes from the notebook's kernel).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hta.trace_analysis import TraceAnalysis

INSTALL = "pip install 'nbddp[profile]' (HTA's package: holistictraceanalysis)"
IDLE_KINDS = ("host_wait", "kernel_wait", "other")
_LOG_LOCK = threading.Lock()  # HTA logs each parse as a warning; its level is lowered around the calls


def write_rank_traces(traces: dict[int, dict[str, Any]], shifts: dict[int, float], folder: str) -> dict[int, str]:
    """One owner-only trace file per rank in ``folder`` (made 0700), as HTA reads them; rank -> path.

    Each keeps its rank's export metadata (``deviceProperties``, ...), gains ``distributedInfo.rank``
    (HTA finds a file's rank there), and has its timestamps moved by ``shifts[rank]``, as the merged file's.
    """
    os.makedirs(folder, mode=0o700, exist_ok=True)
    files = {}
    for r, t in sorted(traces.items()):
        doc = dict(t.get("meta") or {})
        doc["distributedInfo"] = {**(doc.get("distributedInfo") or {}), "rank": r}
        doc["traceEvents"] = [dict(e, ts=e["ts"] + shifts[r]) if "ts" in e else e for e in t["events"]]
        files[r] = rank_trace_path(folder, r)
        fd = os.open(files[r], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
    return files


def rank_trace_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank-{rank}.json")


def has_gpu_kernels(trace: dict[str, Any]) -> bool:
    return any(e.get("cat") == "kernel" for e in trace["events"])


def hta_analyses(files: dict[int, str], gpu_ranks: list[int]) -> dict[str, Any]:
    """``History.profile["hta"]``: HTA's figures for ``gpu_ranks``, or ``used: False`` and the ``reason``."""
    out: dict[str, Any] = {"used": False, "reason": None, "version": None, "ranks": {}}
    if not gpu_ranks:
        return {**out, "reason": "no GPU kernels in the traces, and HTA reads GPU kernels only"}
    try:
        from hta.trace_analysis import TraceAnalysis
        version = ".".join(map(str, getattr(importlib.import_module("hta.version"), "__version_tuple__", ())))
    except Exception as exc:  # absent, or present but broken (a missing dependency): nbddp's figures stand
        why = "not installed" if isinstance(exc, ModuleNotFoundError) else f"{type(exc).__name__}: {exc}"
        return {**out, "reason": f"HTA could not be imported ({why}); {INSTALL}"}
    rank = gpu_ranks[0]
    try:
        with _quiet():
            for rank in gpu_ranks:
                ta = TraceAnalysis(trace_files={rank: files[rank]}, include_last_profiler_step=True)
                out["ranks"][rank] = rank_figures(ta, rank)
    except Exception as exc:  # HTA's own failure on this trace: report it, never fail the fit
        return {**out, "ranks": {}, "reason": f"HTA {version} failed on rank {rank}: {type(exc).__name__}: {exc}"}
    return {**out, "used": True, "version": version}


def rank_figures(ta: TraceAnalysis, rank: int) -> dict[str, Any]:
    """HTA's temporal breakdown, overlap and idle-time breakdown of one rank, in seconds and shares."""
    tb = ta.get_temporal_breakdown(visualize=False).iloc[0]
    total = float(tb["kernel_time(us)"])
    seconds = {"compute": float(tb["compute_time(us)"]), "non_compute": float(tb["non_compute_time(us)"]),
               "idle": float(tb["idle_time(us)"])}
    ratio = float(ta.get_comm_comp_overlap(visualize=False)["comp_comm_overlap_pctg"].iloc[0]) / 100  # 2 decimals
    idle, _ = ta.get_idle_time_breakdown(ranks=[rank], visualize=False)
    waits = {k: float(idle.loc[idle["idle_category"] == k, "idle_time"].sum()) for k in IDLE_KINDS}
    waited = sum(waits.values())
    return {"kernel_time_s": total / 1e6, **{f"{k}_s": v / 1e6 for k, v in seconds.items()},
            **{f"{k}_share": v / total if total > 0 else 0.0 for k, v in seconds.items()},
            "overlap": None if math.isnan(ratio) else ratio,  # NaN: no NCCL kernel on this rank
            **{f"{k}_s": v / 1e6 for k, v in waits.items()},
            **{f"{k}_share": v / waited if waited > 0 else 0.0 for k, v in waits.items()},
            "streams": sorted({int(s) for s in idle["stream"]})}


def hta_lines(result: dict[str, Any]) -> list[str]:
    """The summary's lines: one a rank HTA read, or the one that says why HTA's figures are not there."""
    if not result["used"]:
        return [f"HTA not used: {result['reason']}; the breakdown above is nbddp's own"]
    lines = []
    for r, f in sorted(result["ranks"].items()):
        overlap = ("no NCCL kernel" if f["overlap"] is None
                   else f"{f['overlap'] * 100:.0f} % of its communication under compute")
        lines.append(f"HTA {result['version']}, rank {r} over {f['kernel_time_s'] * 1000:.1f} ms of GPU kernels: "
                     f"compute {f['compute_share'] * 100:.0f} %, non-compute {f['non_compute_share'] * 100:.0f} %, "
                     f"idle {f['idle_share'] * 100:.0f} % ({overlap}); idle by cause over {len(f['streams'])} "
                     f"stream(s): host wait {f['host_wait_share'] * 100:.0f} %, kernel wait "
                     f"{f['kernel_wait_share'] * 100:.0f} %, other {f['other_share'] * 100:.0f} %")
    return lines


class _quiet:
    """For the calls, HTA's logger at ERROR (it logs every parse as a warning) and the warnings raised in HTA's
    modules (pandas deprecations, with pandas 3) ignored: a person sees HTA's figures, not its noise."""

    def __enter__(self) -> None:
        _LOG_LOCK.acquire()
        self.logger = logging.getLogger("hta")
        self.level = self.logger.level
        self.logger.setLevel(logging.ERROR)
        self.warnings = warnings.catch_warnings()
        self.warnings.__enter__()
        warnings.filterwarnings("ignore", module=r"hta(\.|$)")  # only HTA's: another thread's still show

    def __exit__(self, *exc: Any) -> None:
        self.warnings.__exit__(*exc)
        self.logger.setLevel(self.level)
        _LOG_LOCK.release()
