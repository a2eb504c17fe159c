"""Reducing metrics across ranks, and publishing records to the kernel.

Per step, the loop only adds detached tensors on the device (no ``.item()``,
no collective). At a synchronisation point every rank packs its sums into
ONE tensor and ``all_reduce``s it: loss and sample sums, the stop flag,
extra values, and one slot per rank for throughput and memory (an
all-gather by sum). The next interval is derived from rank 0's timing
slot, identical on every rank, so all ranks agree on where the next
collective is and nobody can wait for a partner that skipped it.

Rank 0 publishes with ``ipyparallel.datapub.publish_data``. The client keeps
only the latest value per key, so each ``Progress`` message carries a
sequence number and a window of recent records; the full list also comes
back as the task's result, so the kernel's ``History`` never misses a
record. What only the workers know about the fit (total steps, ...) is
published once, under its own key (``FitPlanInfo``).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.distributed as dist

from nbddp.protocol.messages import PUBLISH_KEYS, TIMED_PHASES, FitPlanInfo, Progress, timed_phases
from nbddp.worker.training import journal
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.memory.usage import cuda_memory
from nbddp.worker.training.compile_watch import COMPILES

WINDOW = 64
RANK_SLOTS = ("samples_per_s", "samples", "peak_mem", "base_mem", "param_bytes", "cuda_allocated", "cuda_reserved",
              "cuda_peak", "compile_s", "compile_cache_hits")
FLOAT_SLOTS = ("samples_per_s", "compile_s")


class Reporter:
    def __init__(self, rank: int, world: int, device: torch.device, cfg: Any, plan: FitPlanInfo, param_bytes: int = 0,
                 counted: bool = True, roles: list[dict[str, Any]] | None = None, base_mem: int = 0,
                 group: Any = None):
        self.rank, self.world, self.device, self.cfg = rank, world, device, cfg
        self.group = group  # the ranks this fit trains on (a sweep's trial: a subgroup); None: every rank
        self.plan = plan
        self.total_steps = plan.total_steps if plan.total_steps is not None else math.inf  # None: a stream's
        self.param_bytes = param_bytes
        # one rank per model copy counts its loss and samples (a pipeline's last stage, a TP group's first
        # rank): the reduction is then over the data-parallel replicas; every rank reports its own speed
        self.counted = counted
        self.roles = roles or [{} for _ in range(world)]
        self.base_mem = base_mem  # resident when the fit began (usage.reset_peak_memory)
        self.sync_every = 1  # the first interval is measured, then adapted
        self.records: list[tuple[int, str, dict[str, Any]]] = []
        self.ranks: list[dict[str, Any]] = []
        self.status = "training"
        self._last_publish = 0.0
        self._published = 0
        self._zero = torch.zeros((), device=device, dtype=torch.float64)
        self._extra_keys: list[str] | None = None
        self.request: tuple[int, int] | None = None  # a profile asked at the last reduction: (id, steps)
        self.reset_window()
        self.epoch_loss = 0.0
        self.epoch_n = 0.0
        self.samples = 0  # this rank's samples trained in this fit (History.ranks[r]["samples"])
        self.t0 = time.perf_counter()
        self._publish = None
        self.publish_s = 0.0  # rank 0's time in publish_data: what streaming costs the training loop
        if rank == 0:
            try:
                from ipyparallel.datapub import publish_data
                self._publish = publish_data
            except Exception:  # noqa: BLE001 - outside an engine (unit tests) there is nobody to publish to
                self._publish = None
        if self._publish is not None:
            self._publish({PUBLISH_KEYS["plan"]: plan})
        self.publish(force=True)

    def reset_window(self) -> None:
        self.loss_sum = self._zero.clone()
        self.n = 0
        self.extras: dict[str, torch.Tensor] = {}
        self.steps_since = 0
        self.t_last = time.perf_counter()

    # -- per step (no synchronisation) ----------------------------------
    def add(self, loss: torch.Tensor, n: int, extras: dict[str, Any]) -> None:
        self.loss_sum.add_(loss.detach(), alpha=n)  # one kernel: promoted into the float64 sum in place
        self.n += n
        self.samples += n
        for k, v in extras.items():
            v = v.detach().to(self.device, torch.float64) if isinstance(v, torch.Tensor) else torch.tensor(float(v), dtype=torch.float64, device=self.device)
            self.extras[k] = self.extras.get(k, self._zero) + v.reshape(()) * n

    def due(self, step: int) -> bool:
        return self.steps_since >= self.sync_every or step >= self.total_steps

    # -- collective -----------------------------------------------------
    def sync(self, step: int, epoch: int, lr: float, stop_requested: bool, peak_mem: int,
             request: tuple[float, float] = (0.0, 0.0)) -> bool:
        """Reduce the window, record it (rank 0), return whether to stop.

        ``request``: rank 0's ``(id, steps)`` of a profile the notebook asked
        for (``handle.profile``), ``(0, 0)`` if none; after the reduction every
        rank finds it in ``self.request``.
        """
        if self._extra_keys is None:
            self._extra_keys = sorted(self.extras)
        keys = self._extra_keys
        elapsed = max(time.perf_counter() - self.t_last, 1e-9)
        w = self.world
        weight = 1.0 if self.counted else 0.0
        head = torch.stack([
            self.loss_sum * weight,
            torch.tensor(float(self.n) * weight, dtype=torch.float64, device=self.device),
            torch.tensor(1.0 if stop_requested else 0.0, dtype=torch.float64, device=self.device),
            torch.tensor(elapsed if self.rank == 0 else 0.0, dtype=torch.float64, device=self.device),
            *(torch.tensor(x if self.rank == 0 else 0.0, dtype=torch.float64, device=self.device) for x in request),
            *[self.extras.get(k, self._zero) * weight for k in keys],
        ])
        mine = {"samples_per_s": self.n / elapsed, "samples": float(self.samples), "peak_mem": float(peak_mem),
                "base_mem": float(self.base_mem), "param_bytes": float(self.param_bytes), **cuda_memory(self.device),
                **self._compile_figures()}
        spent = timed_phases(BEAT.phase_seconds())  # the time split so far rides in the same reduction
        values = [float(mine.get(key, 0.0)) for key in RANK_SLOTS] + [spent[p] for p in TIMED_PHASES]
        slots = torch.zeros(len(values) * w, dtype=torch.float64, device=self.device)
        slots[self.rank::w] = torch.tensor(values, dtype=torch.float64)
        vec = torch.cat([head, slots])
        dist.all_reduce(vec, group=self.group)
        v = vec.cpu().tolist()
        loss_sum, n, stop, elapsed0 = v[0], v[1], v[2], v[3]
        self.request = (int(v[4]), int(v[5])) if v[5] > 0 else None
        extras = dict(zip(keys, v[6 : 6 + len(keys)]))
        per_rank = v[6 + len(keys):]
        steps = max(self.steps_since, 1)
        self.sync_every = max(1, min(self.cfg.log_every, int(self.cfg.record_interval_s / (elapsed0 / steps))))
        loss = loss_sum / n if n else float("nan")
        if not math.isfinite(loss):
            raise FloatingPointError(
                f"the loss is {loss} at step {step} (epoch {epoch}): training diverged or the data holds NaN/inf. "
                "Lower lr, add clip_grad_norm=..., or check the inputs."
            )
        self.epoch_loss += loss_sum
        self.epoch_n += n
        record = {"step": step, "epoch": epoch, "loss": loss, "lr": lr,
                  "samples_per_s": n / elapsed0, "time": time.perf_counter() - self.t0}
        record.update({k: s / n for k, s in extras.items()})
        self.ranks = [self._rank_figures(r, per_rank) for r in range(w)]
        self.record("step", record)
        self.reset_window()
        return stop > 0

    def _compile_figures(self) -> dict[str, float]:
        """Seconds this rank compiled in this fit, and the graphs it found in Inductor's cache (``compile=...``)."""
        if getattr(self.cfg, "compile", None) is None:
            return {}
        return {"compile_s": COMPILES.seconds, "compile_cache_hits": float(COMPILES.cache_hits)}

    def _rank_figures(self, r: int, per_rank: list[float]) -> dict[str, Any]:
        w = self.world
        out: dict[str, Any] = {"rank": r, **self.roles[r]}
        for i, key in enumerate(RANK_SLOTS):
            value = per_rank[i * w + r]
            if key.startswith("cuda_") and self.device.type != "cuda":
                continue
            if key.startswith("compile_") and getattr(self.cfg, "compile", None) is None:
                continue
            out[key] = value if key in FLOAT_SLOTS else int(value)
        first = len(RANK_SLOTS)
        out["phase_s"] = {p: per_rank[(first + j) * w + r] for j, p in enumerate(TIMED_PHASES)}
        return out

    def end_epoch(self, epoch: int, step: int) -> dict[str, Any]:
        loss = self.epoch_loss / self.epoch_n if self.epoch_n else float("nan")
        self.epoch_loss, self.epoch_n = 0.0, 0.0
        return {"epoch": epoch, "step": step, "loss": loss}

    def reduce_sums(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, group=self.group)
        return t.cpu().tolist()

    # -- publishing (rank 0) --------------------------------------------
    def record(self, kind: str, record: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.records.append((len(self.records), kind, record))
        self.publish()

    def publish(self, force: bool = False) -> None:
        if self._publish is None:
            return
        now = time.perf_counter()
        behind = len(self.records) - self._published  # records no message has carried yet
        if not force and now - self._last_publish < self.cfg.publish_interval_s and behind < WINDOW // 2:
            return
        self._last_publish = now
        self._published = len(self.records)
        self._publish({PUBLISH_KEYS["progress"]: Progress(seq=len(self.records), window=self.records[-WINDOW:],
                                                           status=self.status, ranks=self.ranks)})
        journal.keep(self.plan, self.records, self.status, self.ranks)  # a detached session's: for a later kernel
        self.publish_s += time.perf_counter() - now
