"""The kernel's half of ``dist_fit``: check, ship, launch, stream, bring weights back.

``prepare`` turns the person's arguments into something the workers can run,
raising every error that can be known before a worker starts. ``FitRun``
then launches one task per rank and watches them in a background thread
(``tasks.RankTasks``), feeding records to the ``History`` and the live view;
the calling cell either waits (``block=True``, where Kernel > Interrupt
becomes a coordinated stop) or gets a ``FitHandle`` at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from nbddp import shipping
from nbddp.history import History
from nbddp.options import FitConfig, make_config
from nbddp.tasks import RankTasks


@dataclass
class FitPlan:
    cfg: FitConfig
    parts: dict[str, Any]
    model: Any  # the person's nn.Module (weights come back into it) or None for a factory
    train_len: int | None
    parcels: dict[bool, shipping.Parcel] = field(default_factory=dict)  # local? -> parcel
    ship_s: float = 0.0
    data_keys: list[str] = field(default_factory=list)  # resident on the workers once this fit succeeds

    def discard(self) -> None:
        for parcel in self.parcels.values():
            parcel.discard()


# ---------------------------------------------------------------------------
# checks and shipping


def _is_dataset(obj: Any) -> bool:
    return (not isinstance(obj, (type, str, bytes, Mapping))
            and hasattr(obj, "__getitem__") and hasattr(obj, "__len__"))


def data_spec(data: Any, name: str) -> tuple[Any, int | None, int | None]:
    """(``DataSpec``, its length if known in the kernel, a DataLoader's batch size)."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset, TensorDataset

    from nbddp.worker.data import DataSpec

    if isinstance(data, DataLoader):
        if isinstance(data.dataset, IterableDataset):
            raise TypeError(f"{name}: a DataLoader over an IterableDataset cannot be sharded by rank; use a map-style Dataset")
        from torch.utils.data.dataloader import default_collate

        collate = None if data.collate_fn is default_collate else data.collate_fn
        return DataSpec(dataset=data.dataset, collate_fn=collate), len(data.dataset), data.batch_size
    if isinstance(data, tuple) or (isinstance(data, list) and data and all(isinstance(t, torch.Tensor) for t in data)):
        if not data or not all(isinstance(t, torch.Tensor) for t in data):
            kinds = [type(t).__name__ for t in data]
            raise TypeError(f"{name}: a tuple must hold tensors (x, y, ...), got ({', '.join(kinds)})")
        lengths = [t.shape[0] if t.dim() else None for t in data]
        if None in lengths or len(set(lengths)) != 1:
            raise ValueError(
                f"{name}: the tensors of the tuple must have the same first dimension (one row per sample); "
                f"got lengths {lengths}"
            )
        return DataSpec(dataset=TensorDataset(*data)), lengths[0], None
    if isinstance(data, IterableDataset):
        raise TypeError(
            f"{name}: an IterableDataset cannot be sharded by rank with DistributedSampler; "
            "use a map-style Dataset (with __len__ and __getitem__)"
        )
    if _is_dataset(data):
        return DataSpec(dataset=data), len(data), None
    if callable(data):
        return DataSpec(factory=data), None, None
    raise TypeError(
        f"{name} must be a Dataset, a DataLoader, a tuple of tensors (x, y) or a zero-argument function "
        f"that builds the dataset on each worker; got {type(data).__name__}"
    )


def _check_callable(name: str, value: Any) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"dist_fit({name}=...) must be callable, got {type(value).__name__} {value!r}")


def prepare(session: Any, model: Any, data: Any, *, val_data: Any = None, loss_fn: Callable | None = None,
            optimizer: Any = None, scheduler: Callable | None = None, metrics: Mapping[str, Callable] | None = None,
            step_fn: Callable | None = None, batch_size: int | None = None, **options: Any) -> FitPlan:
    import torch

    if isinstance(model, torch.nn.Module):
        returned = model
    elif isinstance(model, type) and issubclass(model, torch.nn.Module):
        returned = None  # a Module class is a factory: Net() is built on each worker
    elif callable(model) and not isinstance(model, type):
        returned = None
    else:
        what = f"the class {model.__name__}, which is not an nn.Module" if isinstance(model, type) else type(model).__name__
        raise TypeError(f"dist_fit(model=...) must be a torch.nn.Module or a zero-argument function returning one; got {what}")
    spec, n_train, loader_bs = data_spec(data, "dist_fit(data=...)")
    if n_train == 0:
        raise ValueError("dist_fit(data=...) is empty (len 0); nothing to train on")
    val_spec = None
    if val_data is not None:
        val_spec, n_val, _ = data_spec(val_data, "dist_fit(val_data=...)")
        if n_val == 0:
            raise ValueError("dist_fit(val_data=...) is empty (len 0); pass None to skip validation")
    for name, value in (("loss_fn", loss_fn), ("scheduler", scheduler), ("step_fn", step_fn)):
        _check_callable(name, value)
    if optimizer is not None:
        if isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                "dist_fit(optimizer=...) got an optimizer already built on the notebook's parameters; each rank needs its own. "
                "Pass the class (optimizer=torch.optim.SGD, with lr=...) or a factory: optimizer=lambda params: torch.optim.SGD(params, lr=0.1)"
            )
        _check_callable("optimizer", optimizer)
    if metrics is not None:
        if not isinstance(metrics, Mapping) or not all(isinstance(k, str) and callable(v) for k, v in metrics.items()):
            raise TypeError("dist_fit(metrics=...) must be a dict of name -> fn(output, target), e.g. {'acc': accuracy}")
        if val_data is None:
            raise ValueError("dist_fit(metrics=...) are computed on validation data; pass val_data=... too")
        if step_fn is not None:
            raise ValueError("dist_fit(metrics=...) cannot see outputs inside a step_fn; return the values in step_fn's dict instead")
    if batch_size is None:
        batch_size = loader_bs or 32
    cfg = make_config(batch_size=batch_size, **options)
    _check_against_workers(session, cfg, n_train)
    if n_train is not None:
        _check_shard(cfg, n_train, session.world_size)
    keys = _make_resident(session, [spec, val_spec])
    parts = {"model": model, "data": spec, "val_data": val_spec, "loss_fn": loss_fn, "optimizer": optimizer,
             "scheduler": scheduler, "metrics": dict(metrics) if metrics else None, "step_fn": step_fn,
             "resident": list(dict.fromkeys([*keys, *session.resident]))[:MAX_RESIDENT]}
    plan = FitPlan(cfg=cfg, parts=parts, model=returned, train_len=n_train, data_keys=keys)
    t0 = time.perf_counter()
    localities = {p.local for p in session.placements}
    try:
        for local in sorted(localities, reverse=True):
            plan.parcels[local] = shipping.pack(parts, what="the dist_fit arguments", local=local,
                                                pool=session.send_pool if local else None)
    except shipping.ShippingError:
        plan.discard()
        _raise_for_unpicklable_argument(parts)
        raise
    except BaseException:
        plan.discard()
        raise
    plan.ship_s = time.perf_counter() - t0
    return plan


MAX_RESIDENT = 4  # datasets kept on the workers between fits


def _make_resident(session: Any, specs: list[Any]) -> list[str]:
    """Key each dataset by content; one the workers already hold is not shipped again."""
    keys = []
    for spec in specs:
        if spec is None or spec.dataset is None:
            continue  # factories run on the workers every time: they may build something new
        key = shipping.fingerprint(spec.dataset)
        if key is None:
            continue
        spec.key = key
        keys.append(key)
        if key in session.resident:
            spec.dataset = None  # the workers have it: send the key alone
    return keys


def _raise_for_unpicklable_argument(parts: dict[str, Any]) -> None:
    """After a failed pack: pickle each argument alone to name the one that fails.

    Only on the failure path: pickling every argument again on each fit would
    double the cost of shipping.
    """
    for name, value in parts.items():
        if name == "resident":
            continue
        if name in ("data", "val_data") and value is not None:
            value = value.dataset if value.dataset is not None else value.factory
        shipping.dumps(value, what=f"dist_fit({name}=...)", label=name)


def _check_against_workers(session: Any, cfg: FitConfig, n_train: int | None) -> None:
    devices = {p.device.split(":")[0] for p in session.placements}
    if cfg.precision == "16-mixed" and devices != {"cuda"}:
        raise ValueError("dist_fit(precision='16-mixed') needs CUDA GPUs (fp16 with a gradient scaler); on CPU workers use precision='bf16'")
    if cfg.sync_batchnorm and devices != {"cuda"}:
        raise ValueError(
            "dist_fit(sync_batchnorm=True) needs CUDA GPUs: SyncBatchNorm has no CPU implementation. "
            "On CPU workers leave it off (each rank then normalises over its own batch)."
        )


def _check_shard(cfg: FitConfig, n: int, world: int) -> None:
    shard = n // world if cfg.drop_last else -(-n // world)
    if shard < cfg.batch_size:
        raise ValueError(
            f"dist_fit(batch_size={cfg.batch_size}) is larger than each rank's shard: {n} samples over {world} ranks "
            f"gives {shard} per rank. batch_size is per rank; use batch_size<={max(shard, 1)} or fewer workers."
        )


# ---------------------------------------------------------------------------
# running


class FitRun:
    """One fit in flight: tasks on every rank, a watcher thread, the live view."""

    def __init__(self, session: Any, plan: FitPlan, view: Any):
        self.session = session
        self.plan = plan
        self.view = view
        self.history = History(world_size=session.world_size)
        self.error: BaseException | None = None
        self.done_event = threading.Event()
        self.stop_requested = False
        self._training_started = False
        self._stop_sent = False
        self.hard_stopped = False
        self.tasks: RankTasks | None = None
        self._seen = 0
        self._t0 = time.perf_counter() - plan.ship_s  # the call began when shipping began
        self.live_state: dict[str, Any] = {"status": "starting", "ranks": [], "meta": {}}
        self.thread: threading.Thread | None = None
        self.poll_s = 0.05  # how often the watcher looks at rank 0's published records
        self.watch_cpu_s: float | None = None

    # -- public-ish --------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.done_event.is_set()

    def describe(self) -> str:
        return "a dist_fit"

    def launch(self) -> None:
        from nbddp.worker.entry import fit_task

        s = self.session
        meta = {"generation": s.generation, "return": "state_dict" if self.plan.model is not None else "module",
                "world_size": s.world_size, "backend": s.backend, "epochs": self.plan.cfg.epochs,
                "ranks": [{"rank": p.rank, "host": p.host, "device": p.device, "pid": p.pid} for p in s.placements]}
        self.live_state["meta"] = meta
        ars = {p.rank: s.client[p.engine_id].apply_async(fit_task, self.plan.parcels[p.local], self.plan.cfg, meta)
               for p in s.placements}
        self.tasks = RankTasks(s, ars, "dist_fit")
        s.running = self
        self.view.start(self)
        self.thread = threading.Thread(target=self._watch, name="nbddp-fit-watch", daemon=True)
        self.thread.start()

    def request_stop(self) -> None:
        """The coordinated stop: every rank stops at the same step."""
        if self.finished or self.stop_requested:
            return
        self.stop_requested = True
        self.live_state["status"] = "stopping"
        if self._training_started:
            self._send_stop()
        # else: sent by _stream when rank 0 first reports. Before that a rank may not yet have
        # turned SIGINT into a stop flag, and the signal would kill its task instead.

    def _send_stop(self) -> None:
        import signal

        if not self._stop_sent:
            self._stop_sent = True
            self.session.workers.signal([p.engine_id for p in self.session.placements], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill every rank now (they are replaced); the model keeps its old weights."""
        if self.finished:
            return
        self.hard_stopped = True
        self.hard_stop_reason = reason
        placements = self.session.placements
        self.session.workers.kill([p.engine_id for p in placements], {p.engine_id: p.pid for p in placements})
        self.done_event.wait(30)

    # -- watcher thread --------------------------------------------------------
    def _stream(self) -> None:
        """Take new records from rank 0's published data (seq + window)."""
        ar = self.tasks.ars.get(0)
        data = getattr(ar, "data", None) or {}
        msg = data.get("nbddp") if isinstance(data, dict) else None
        if not msg:
            return
        if not self._training_started:
            # rank 0 publishes only after every rank agreed on setup, so all have the stop handler now
            self._training_started = True
            if self.stop_requested:
                self._send_stop()
        self.live_state["ranks"] = msg.get("ranks") or self.live_state["ranks"]
        self.live_state["meta"] = {**self.live_state["meta"], **(msg.get("meta") or {})}
        if not self.stop_requested:
            self.live_state["status"] = msg.get("status", "training")
        window = msg.get("window", [])
        if window and window[0][0] > self._seen:
            # fell behind the window (a very slow poll): skip ahead so the view goes on;
            # the final result (every record, from rank 0's return value) fills the gap
            self.live_state["missed"] = self.live_state.get("missed", 0) + window[0][0] - self._seen
            self._seen = window[0][0]
        for seq, kind, record in window:
            if seq == self._seen:
                self.history.add(kind, record)
                self._seen = seq + 1
        self.view.update(self)

    def _watch(self) -> None:
        try:
            results = self.tasks.wait(on_tick=self._stream, tick_s=self.poll_s)
            self._finish(results)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting cell / handle
            if self.hard_stopped:
                exc = KeyboardInterrupt(f"training was killed ({self.hard_stop_reason}); the workers are being replaced "
                                        "and the model keeps the weights it had before the call")
            self.error = exc
            self.session.resident = {}  # the workers' caches may have changed mid-way: ship afresh next time
            self.history.status = "failed"
            self.live_state["status"] = "failed" if not self.hard_stopped else "interrupted"
        finally:
            self.session.running = None
            self.plan.discard()
            try:  # before done_event: a blocking cell returns only once the final state is drawn
                self.view.finish(self)
            except Exception:  # noqa: BLE001 - a display problem must not hide the result
                pass
            self.watch_cpu_s = time.thread_time()  # this thread's CPU seconds, view included
            self.history.timings["watch_cpu_s"] = self.watch_cpu_s
            self.done_event.set()

    def _finish(self, results: dict[int, Any]) -> None:
        t0 = time.perf_counter()
        head = results[0]
        statuses = {r["status"] for r in results.values()}
        history = History(world_size=self.session.world_size)
        for _, kind, record in head["records"]:
            history.add(kind, record)
        history.status = "interrupted" if "interrupted" in statuses else "completed"
        parcel: shipping.Parcel = head["weights"]
        try:
            if self.plan.model is not None:
                state = shipping.unpack(parcel, copy=False)
                self.plan.model.load_state_dict(state)
                del state
                history.model = self.plan.model
            else:
                history.model = shipping.unpack(parcel)
        finally:
            parcel.discard()
        loaded = time.perf_counter()
        worker = head["timings"]
        local = self.session.placements[0].local
        history.timings = {
            "ship_s": self.plan.ship_s,
            "setup_s": worker["setup_s"],
            "train_s": worker["train_s"],
            "publish_s": worker.get("publish_s", 0.0),  # of train_s: rank 0 streaming records to the kernel
            # from rank 0's last step to the weights in the notebook's model: same clock on one host
            "return_s": (time.time() - worker["end_wall"]) if local else worker.get("pack_s", 0.0) + loaded - t0,
            "pack_s": worker.get("pack_s", 0.0),  # rank 0 writing the weights out
            "load_s": loaded - t0,  # the kernel reading them into the model
            "total_s": loaded - self._t0,
        }
        history.transfers = {"shipped_bytes": max(p.nbytes for p in self.plan.parcels.values()),
                             "returned_bytes": parcel.nbytes}
        history.timings["overhead_s"] = history.timings["total_s"] - history.timings["train_s"]
        self.history = history
        self.live_state["status"] = "interrupted" if history.status == "interrupted" else "done"
        self.session.mark_resident(self.plan.data_keys, MAX_RESIDENT)

    def result(self) -> History:
        if self.error is not None:
            raise self.error
        return self.history
