"""The public functions: thin calls into the kernel's one ``Session``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Literal, overload

from nbddp.fit.arguments import (Callbacks, CompileChoice, FilePath, FitArguments, Loggers, Metrics, ModelLike,
                                 ModuleClasses, OptimizerLike, ProfileChoice, RetryOn, SchedulerLike, SnapshotEvery)
from nbddp.fit.handle import FitHandle
from nbddp.fit.history import History
from nbddp.session.session import get_session
from nbddp.session.start_options import check_stall_timeout
from nbddp.execution.work import interrupts_held, wait_interruptibly
from nbddp.live.choice import LiveChoice
from nbddp.protocol.data_forms import DataLike
from nbddp.inference.launch import run_inference
from nbddp.protocol.strategy_settings import StrategySettings
from nbddp.worker.tasks.reports import report, should_stop  # called on the ranks; each one list lookup elsewhere
from nbddp.worker.tasks.report_loggers import accelerate_tracker, lightning_logger  # the frameworks' one line

if TYPE_CHECKING:
    from ipyparallel import Cluster
    from optuna import Study
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler

    from nbddp.cells.call_handle import CallHandle
    from nbddp.cells.rank_displays import Displays
    from nbddp.fit.fit_run import FitRun
    from nbddp.inference.predict_run import PredictHandle
    from nbddp.sweeps.handle import SweepHandle
    from nbddp.sweeps.result import SweepResult


def start(n: int | None = None, *, backend: str | None = None, cluster: Cluster | None = None,
          profile: str | None = None, cluster_id: str | None = None, timeout: float | None = None,
          threads: int | None = None, interface: str | None = None, stall_timeout: float | None = None,
          slurm: bool | Mapping[str, Any] | None = None, detach: bool = False,
          keep_alive: str | float = "2h") -> dict[str, Any]:
    """Start (or attach to) the workers and form the process group; return ``status()``.

    Args:
        n: workers to start; default: one per visible GPU, or 2 CPU workers.
        backend: ``"nccl"`` (default with GPUs) or ``"gloo"`` (default without).
        cluster: any ``ipyparallel.Cluster`` (SSH, MPI, Slurm... launchers);
            nbddp starts it if it is not running, and stops it at ``stop()``.
        profile, cluster_id: attach to a running cluster (``ipcluster start``,
            or ``ipcontroller`` with ``ipengine`` on each host): ``profile`` is
            a profile name, a profile directory path, or the path of the
            client connection file ``ipcontroller-<id>-client.json``. nbddp
            never stops engines it did not start. See ``docs/multi-node.md``.
        timeout: process-group timeout in seconds: how long a collective may
            hang before it fails (default ``DEFAULT_PG_TIMEOUT_S``, 5 minutes;
            torch's own is 30). Given while workers run, the group is formed
            again with the new timeout (same engines).
        threads: CPU threads per worker; default: the host's cores divided by
            its workers (torchrun's ``OMP_NUM_THREADS`` logic).
        interface: network interface for gloo/NCCL across hosts, set as
            ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` on every rank (default:
            on each host, the interface carrying the address that reaches the
            controller; loopback on one host). Every host must have it.
        stall_timeout: the default ``dist_fit(stall_timeout=...)``: seconds a
            rank may go without progress before the fit fails with
            ``WorkerStalled`` (default None: stalls are shown, never fatal).
        slurm: ``True`` or ``{"partition": ..., "nodes": K, "gpus_per_node": G,
            "time": "04:00:00", "account": ..., "sbatch": "extra args",
            "queue_timeout": seconds, "controller_ip": ...}``: the workers are
            one Slurm job, submitted through ipyparallel's Slurm launcher: one
            engine per GPU (2 per node without GPUs; ``n`` must spread evenly
            over the nodes); ``threads`` is its ``--cpus-per-task``. The
            controller runs here, on the address this machine uses to reach
            the nodes. While the job waits in the queue, the cell shows its
            state and Slurm's reason; Kernel > Interrupt cancels it;
            ``queue_timeout`` cancels it after that many seconds (default: wait).
            ``stop()``, ``restart()`` and the kernel's death cancel it. See
            ``docs/multi-node.md``.
        detach: the workers outlive this kernel (as ``nbddp.detach()`` right
            after the start): restart or lose the kernel, then ``nbddp.attach()``
            in the next one. See ``docs/sessions.md``.
        keep_alive: with ``detach``: a session with no kernel attached and no
            fit running ends by itself after this long (``"2h"``, ``"30m"``,
            ``"90s"``, ``"1d"`` or seconds), leaving nothing behind.

    Calling it again with the same settings while workers run does nothing
    (a new ``timeout`` or ``stall_timeout`` is applied).
    """
    from nbddp.detached.detach import check_start, detach as detach_session

    check_start(detach, keep_alive)  # a bad value fails before any process starts
    get_session().start(n, backend=backend, cluster=cluster, profile=profile, cluster_id=cluster_id,
                        timeout=timeout, threads=threads, interface=interface, stall_timeout=stall_timeout,
                        slurm=slurm)
    if detach:
        detach_session(get_session(), keep_alive)
    return status()


def stop() -> None:
    """Stop the workers this kernel started (an attached cluster is only left)."""
    get_session().stop()


def detach(keep_alive: str | float = "2h") -> dict[str, Any]:
    """Let the running workers outlive this kernel; the session's ``sessions()`` row.

    The workers, the controller, a running fit, kept models, resident
    datasets and every ``%%ddp`` name stay when the kernel exits, restarts or
    dies; ``nbddp.attach()`` in the next kernel takes them up again. With no
    kernel attached and no fit running for ``keep_alive`` (``"2h"``, ``"30m"``,
    ``"90s"`` or seconds; never "forever"), the session ends by itself,
    leaving no process, file or Slurm job behind. Called again, it sets a new
    ``keep_alive``. See ``docs/sessions.md``.

    Raises:
        NotStartedError: no workers run here. SessionError: another kernel
            drives the session now. ClusterError: the workers are an
            ipcluster nbddp did not start (they already outlive the kernel).
        TypeError, ValueError: ``keep_alive`` is not a duration above zero.
    """
    from nbddp.detached.detach import detach as detach_session
    from nbddp.detached.listing import row

    return row(detach_session(get_session(), keep_alive))


def attach(id: str | None = None, *, take_over: bool = False) -> dict[str, Any]:
    """Take a detached session up in this kernel (a new one after a restart, or another notebook); ``status()``.

    ``id``: one of ``nbddp.sessions()``; default: the only one there is.
    The workers come back as they are: their process group, kept models
    (``nbddp.kept()``), resident datasets and ``%%ddp`` names; a fit that
    was running comes back as ``nbddp.running()``. One kernel drives a
    session at a time: ``take_over=True`` moves it here from a live one.

    Raises:
        SessionError: no session (the message lists ``sessions()``), the one
            named has ended, several exist and none was named, another live
            kernel is attached (naming its pid), or its controller is gone
            (the record is then removed). PermissionError: the session
            belongs to another user.
    """
    from nbddp.detached.attach import attach as attach_session

    attach_session(get_session(), id, take_over)
    return status()


def sessions() -> list[dict[str, Any]]:
    """This user's detached sessions: ``id``, ``world``, ``backend``, ``started``, ``attached`` (a kernel's pid),
    ``running`` (the fit running there), ``kept`` (names), ``keep_alive_s``, ``slurm_jobs``."""
    from nbddp.detached.listing import rows

    return rows()


def running() -> FitHandle | None:
    """The handle of the fit running on this kernel's workers (also one found running by ``attach()``), or None."""
    from nbddp.detached.resumed_handle import running_handle

    return running_handle(get_session())


def kept() -> list[dict[str, Any]]:
    """The models ``dist_fit(keep=...)`` left on the ranks: ``name``, ``strategy`` ("module", "fsdp", "pipeline",
    "tensor"), ``precision``, ``params``; each usable as ``predict("name", ...)`` and ``evaluate("name", ...)``."""
    from nbddp.inference.kept_listing import kept_models

    return kept_models(get_session())


def restart() -> dict[str, Any]:
    """Stop and start again with the same settings (fresh engines, fresh group; a detached session stays detached)."""
    from nbddp.detached.detach import restart as restart_session

    restart_session(get_session())
    return status()


def status() -> dict[str, Any]:
    """A snapshot: running, backend, world size, and one row per rank (of one process-group generation)."""
    return get_session().snapshot()


@overload
def run(fn: Callable[..., Any], *args: Any, block: Literal[True] = True, live: LiveChoice = None,
        loggers: Any = None, callbacks: Any = None, displays: Displays = None, **kwargs: Any) -> list[Any]: ...
@overload
def run(fn: Callable[..., Any], *args: Any, block: Literal[False], live: LiveChoice = None,
        loggers: Any = None, callbacks: Any = None, displays: Displays = None, **kwargs: Any) -> CallHandle: ...
@overload
def run(fn: Callable[..., Any], *args: Any, block: bool = True, live: LiveChoice = None,
        loggers: Any = None, callbacks: Any = None, displays: Displays = None,
        **kwargs: Any) -> list[Any] | CallHandle: ...


def run(fn: Callable[..., Any], *args: Any, block: bool = True, live: LiveChoice = None,
        loggers: Any = None, callbacks: Any = None, displays: Displays = None,
        **kwargs: Any) -> list[Any] | CallHandle:
    """Call ``fn(*args, **kwargs)`` on every rank (process group ready); results in rank order.

    ``fn`` may be defined in the notebook: it travels by value. Inside it,
    ``torch.distributed`` is initialised (``dist.get_rank()`` works). What it
    prints is shown labelled ``[rank N]``.

    ``block``, ``live``, ``loggers``, ``callbacks`` and ``displays`` are
    ``run``'s own (a keyword of ``fn`` with one of these names goes through
    ``functools.partial``):

    * ``block=False`` returns a ``CallHandle`` at once, a
      ``concurrent.futures.Future`` of the list (``result()``, ``done()``,
      ``stop()``, ``await handle``, ...), as ipyparallel's ``apply_async``;
      what the ranks print is kept on it (``display_outputs()``).
    * ``live``: ``True``, ``None``, ``"widget"`` or ``"text"`` print the
      ranks' output as it arrives, progress bars (``\r``) redrawn in place,
      one line per rank (``"widget"``: as a notebook display, ``"text"``:
      as text), and show what ``fn`` reports (``nbddp.report``) in
      dist_fit's live view; ``False`` shows neither.
    * ``loggers``, ``callbacks``: as ``dist_fit``'s, fed the reduced reports
      from the kernel; an ``EarlyStopping`` ends the call through
      ``nbddp.should_stop()``.
    * ``displays``: whose rich output (``plt.show()``, ``display(...)``,
      HTML progress tables) is shown under the cell: rank 0 by default, a
      rank, a list of ranks, ``"all"`` or ``"none"``.

    The list (a ``RankResults``) carries ``.history``: the ``History`` of
    what ``fn`` reported (None if nothing), also ``nbddp.last_history()``.
    """
    from nbddp.cells.function_calls import call_everywhere, start_everywhere
    from nbddp.cells.live_lines import drawing_for
    from nbddp.cells.reported_call import hooks_for
    from nbddp.execution.handle import check_block
    from nbddp.live.choice import live_choice

    if not callable(fn):
        raise TypeError(f"nbddp.run(fn, ...) needs a function, got {type(fn).__name__}. "
                        f"HINT: pass the function itself, run(f, x), not its result, run(f(x))")
    check_block(block, "nbddp.run")
    live = live_choice(live, "nbddp.run")
    hooks = hooks_for(loggers, callbacks)
    if not block:
        if hooks is not None:
            raise ValueError("nbddp.run(block=False) takes no loggers= or callbacks= yet: their records are fed "
                             "while a cell waits. Use block=True, or call nbddp.last_history() after the handle "
                             "ended and log from it")
        return start_everywhere(get_session(), fn, args, kwargs, displays=displays)
    return call_everywhere(get_session(), fn, args, kwargs, output=live is not False, live=live, hooks=hooks,
                           displays=displays, drawing=drawing_for(live))


@overload
def dist_fit(model: ModelLike, data: DataLike, *, epochs: int = 1, val_data: DataLike | None = None,
             batch_size: int | str | None = None, loss_fn: Callable[..., Any] | None = None,
             optimizer: OptimizerLike | None = None, lr: float | None = None, scheduler: SchedulerLike | None = None,
             scheduler_interval: str | None = None, metrics: Metrics | None = None,
             step_fn: Callable[..., Any] | None = None, max_steps: int | None = None, shuffle: bool | None = None,
             seed: int = 0, precision: str = "32-true", grad_accum: int = 1, clip_grad_norm: float | None = None,
             sync_batchnorm: bool = False, checkpoint_dir: FilePath | None = None, checkpoint_every: int | None = None,
             resume: bool | FilePath = False, log_every: int = 20, val_every: int | str | None = None,
             strategy: str | StrategySettings = "ddp", mesh: dict[str, int] | None = None,
             activation_checkpointing: ModuleClasses = False, keep: str | None = None, return_weights: bool = True,
             block: Literal[True] = True, live: LiveChoice = None, stall_timeout: float | None = None,
             on_nan: str = "raise", profile: ProfileChoice = False, loggers: Loggers = None,
             callbacks: Callbacks = None, compile: CompileChoice = False, max_restarts: int = 0,
             snapshot_every: SnapshotEvery = None, retry_on: RetryOn = None, min_workers: int | None = None,
             **advanced: Any) -> History: ...
@overload
def dist_fit(model: ModelLike, data: DataLike, *, epochs: int = 1, val_data: DataLike | None = None,
             batch_size: int | str | None = None, loss_fn: Callable[..., Any] | None = None,
             optimizer: OptimizerLike | None = None, lr: float | None = None, scheduler: SchedulerLike | None = None,
             scheduler_interval: str | None = None, metrics: Metrics | None = None,
             step_fn: Callable[..., Any] | None = None, max_steps: int | None = None, shuffle: bool | None = None,
             seed: int = 0, precision: str = "32-true", grad_accum: int = 1, clip_grad_norm: float | None = None,
             sync_batchnorm: bool = False, checkpoint_dir: FilePath | None = None, checkpoint_every: int | None = None,
             resume: bool | FilePath = False, log_every: int = 20, val_every: int | str | None = None,
             strategy: str | StrategySettings = "ddp", mesh: dict[str, int] | None = None,
             activation_checkpointing: ModuleClasses = False, keep: str | None = None, return_weights: bool = True,
             block: Literal[False], live: LiveChoice = None, stall_timeout: float | None = None,
             on_nan: str = "raise", profile: ProfileChoice = False, loggers: Loggers = None,
             callbacks: Callbacks = None, compile: CompileChoice = False, max_restarts: int = 0,
             snapshot_every: SnapshotEvery = None, retry_on: RetryOn = None, min_workers: int | None = None,
             **advanced: Any) -> FitHandle: ...
@overload
def dist_fit(model: ModelLike, data: DataLike, *, epochs: int = 1, val_data: DataLike | None = None,
             batch_size: int | str | None = None, loss_fn: Callable[..., Any] | None = None,
             optimizer: OptimizerLike | None = None, lr: float | None = None, scheduler: SchedulerLike | None = None,
             scheduler_interval: str | None = None, metrics: Metrics | None = None,
             step_fn: Callable[..., Any] | None = None, max_steps: int | None = None, shuffle: bool | None = None,
             seed: int = 0, precision: str = "32-true", grad_accum: int = 1, clip_grad_norm: float | None = None,
             sync_batchnorm: bool = False, checkpoint_dir: FilePath | None = None, checkpoint_every: int | None = None,
             resume: bool | FilePath = False, log_every: int = 20, val_every: int | str | None = None,
             strategy: str | StrategySettings = "ddp", mesh: dict[str, int] | None = None,
             activation_checkpointing: ModuleClasses = False, keep: str | None = None, return_weights: bool = True,
             block: bool = True, live: LiveChoice = None, stall_timeout: float | None = None,
             on_nan: str = "raise", profile: ProfileChoice = False, loggers: Loggers = None,
             callbacks: Callbacks = None, compile: CompileChoice = False, max_restarts: int = 0,
             snapshot_every: SnapshotEvery = None, retry_on: RetryOn = None, min_workers: int | None = None,
             **advanced: Any) -> History | FitHandle: ...


def dist_fit(model: ModelLike, data: DataLike, *, epochs: int = 1, val_data: DataLike | None = None,
             batch_size: int | str | None = None, loss_fn: Callable[..., Any] | None = None,
             optimizer: OptimizerLike | None = None, lr: float | None = None, scheduler: SchedulerLike | None = None,
             scheduler_interval: str | None = None, metrics: Metrics | None = None,
             step_fn: Callable[..., Any] | None = None, max_steps: int | None = None, shuffle: bool | None = None,
             seed: int = 0, precision: str = "32-true", grad_accum: int = 1, clip_grad_norm: float | None = None,
             sync_batchnorm: bool = False, checkpoint_dir: FilePath | None = None, checkpoint_every: int | None = None,
             resume: bool | FilePath = False, trust_checkpoint: bool = False, log_every: int = 20, val_every: int | str | None = None,
             strategy: str | StrategySettings = "ddp", mesh: dict[str, int] | None = None,
             activation_checkpointing: ModuleClasses = False, keep: str | None = None, return_weights: bool = True,
             block: bool = True, live: LiveChoice = None, stall_timeout: float | None = None,
             on_nan: str = "raise", profile: ProfileChoice = False, loggers: Loggers = None,
             callbacks: Callbacks = None, compile: CompileChoice = False, max_restarts: int = 0,
             snapshot_every: SnapshotEvery = None, retry_on: RetryOn = None, min_workers: int | None = None,
             **advanced: Any) -> History | FitHandle:
    """Train ``model`` with DistributedDataParallel on every worker; return a ``History``.

    Args:
        model: an ``nn.Module`` (its weights are shipped; the trained weights of
            rank 0 are loaded back into this same object) or a zero-argument
            function returning one (built on each worker; the trained module
            is ``history.model``).
        data: a ``Dataset``, a ``DataLoader`` (every setting kept: its batch
            size, order, collate function, ``num_workers``, ``worker_init_fn``,
            ``generator``, ``drop_last``, ``pin_memory``; its sampler is swapped
            for a distributed one, a custom sampler shared out per rank; a
            ``dist_fit`` argument that disagrees with it is an error), a tuple of tensors ``(x, y)``, or a
            zero-argument function that builds the dataset on each worker
            (best for large data: nothing is shipped).
        epochs: passes over the data. ``max_steps`` stops earlier (mid-epoch).
        val_data: same forms as ``data``; evaluated after each epoch (or every
            ``val_every`` steps) without padding, reduced over all ranks.
        batch_size: samples per rank per step (global batch = batch_size x
            world size x grad_accum). Default: the DataLoader's, else 32.
            ``"auto"``: the largest that fits on every rank
            (``nbddp.find_batch_size`` with this fit's options, run first);
            ``History.batch_size`` says which.
        loss_fn: ``loss_fn(model(x), y)`` for ``(x, y)`` batches. Default:
            cross-entropy for integer targets, MSE for float targets; float
            targets that hold only 0 and 1 are refused (binary labels want
            ``loss_fn=F.binary_cross_entropy_with_logits``; say
            ``loss_fn=F.mse_loss`` if MSE is meant). Dict batches run
            ``model(**batch)`` and use the output's loss.
        optimizer: an optimizer class (built with ``lr``) or a factory
            ``params -> Optimizer``. Default: AdamW.
        lr: learning rate for the default optimizer or an optimizer class
            (default 1e-3). A factory sets its own: giving ``lr`` with one is
            an error, so it can never be silently ignored.
        scheduler: a factory ``optimizer -> LR scheduler``, or Lightning's dict
            ``{"scheduler": factory, "interval": "step", "frequency": k,
            "monitor": "val_loss"}``; ``History.steps`` records ``lr``.
        scheduler_interval: ``"step"`` (after every optimizer step) or
            ``"epoch"``. Default: as the scheduler's own docs count:
            ``StepLR``, ``MultiStepLR``, ``ExponentialLR``,
            ``CosineAnnealingLR`` and ``ReduceLROnPlateau`` per epoch,
            ``OneCycleLR`` and ``LambdaLR`` (HF's warmup schedules) per step,
            any other kind per epoch with a notice. ``ReduceLROnPlateau`` steps
            on the epoch's reduced ``val_loss`` (else ``loss``), or the dict's
            ``monitor``.
        metrics: ``{"acc": fn(output, target)}`` computed on validation data,
            sample-weighted over all ranks, recorded as ``val_acc``; or
            torchmetrics ``Metric`` objects (``{"f1": MulticlassF1Score(10)}``),
            updated with every rank's batches and synced over the ranks:
            exact over the whole validation set (F1, AUROC, precision).
        step_fn: ``step_fn(model, batch) -> loss or {"loss": ..., ...}``: full
            control of a step; extra dict entries are recorded like metrics.
        shuffle, seed: sampling order; the same seed gives the same History.
            ``shuffle`` defaults to True, or to a DataLoader's own setting.
        precision: ``"32-true"``, ``"bf16-mixed"`` (bf16 autocast, CPU and
            GPU) or ``"16-mixed"`` (fp16 with a gradient scaler, GPU only);
            ``"32"`` and ``"bf16"`` are accepted as aliases.
        grad_accum: micro-batches per optimizer step (gradients synchronised
            only on the last one).
        clip_grad_norm: clip the global gradient norm to this value.
        sync_batchnorm: convert BatchNorm to SyncBatchNorm (GPU only).
        checkpoint_dir, checkpoint_every: save model, optimizer, scheduler,
            scaler, data position, step and RNG states every N steps (rank 0,
            atomic); ``resume=True`` continues from the latest one, or
            ``resume="path"`` from that file. Files load with plain torch.load.
        trust_checkpoint: read ``resume``'s checkpoint in full. By default
            nbddp reads it as ``torch.load(weights_only=True)`` does (tensors
            and plain data only: a pickle could run code as it loads), and
            refuses a file that needs more with ``UntrustedCheckpointError``
            naming it; pass True only for a file whose writer you trust.
        log_every: reduce and record metrics at most every N steps (and about
            once a second for slow steps).
        strategy: ``"ddp"`` (a full copy of the model per rank) or ``"fsdp"``
            (FSDP2: each rank holds 1/N of the parameters, gradients and
            optimizer state); ``nbddp.FSDP(...)`` for its settings. See
            ``docs/sharded.md``. ``nbddp.Pipeline(...)`` cuts the model into
            stages, one per rank; ``nbddp.TensorParallel(...)`` splits its
            linear layers across ranks (``docs/topologies.md``).
        mesh: the ranks as a 2-D mesh of named dimensions: ``{"dp": 2, "pp":
            2}`` (pipelines of 2 stages, 2 of them on different data) or
            ``{"dp": 2, "tp": 2}``; the product of the sizes is the number of
            workers. ``strategy`` says what runs over ``dp`` ("ddp", "fsdp")
            or is the Pipeline/TensorParallel itself. Default: data parallel
            over every worker, or ``{"pp": stages}`` / ``{"tp": workers}`` for a
            model-parallel strategy. ``batch_size`` is per data-parallel rank:
            the ranks of one pipeline or TP group train on the same batch.
        activation_checkpointing: ``True`` recomputes each unit's activations
            in backward instead of keeping them (the repeated blocks, or
            FSDP's ``shard_modules``), or a set of module classes to do it for.
            Same weights, less activation memory, about one more forward.
        keep: bind the trained module to this name in every rank's ``%%ddp``
            namespace (sharded under FSDP), for evaluation in later cells.
        return_weights: ``False`` leaves the notebook's model as it is (for a
            model too big for the kernel; use ``keep`` or checkpoints).
        block: ``False`` returns a ``FitHandle`` at once; training and the
            dashboard go on while the notebook stays usable. The handle is a
            ``concurrent.futures.Future`` of the ``History`` (``result()``,
            ``cancel()``, ``add_done_callback()``, ``await handle``, ...).
        live: ``None`` or ``True`` (automatic: dashboard in Jupyter, text
            elsewhere), ``False`` (show nothing), ``"widget"`` or ``"text"``:
            the same values for every call that shows itself.
        stall_timeout: seconds a rank may go without progress (each rank
            reports its step, micro-batch and phase about once a second)
            before the fit fails with ``WorkerStalled``; the stalled ranks are
            replaced. Default: ``nbddp.start(stall_timeout=...)``, else None
            (a stall is shown live, with the rank's stack, never fatal).
        on_nan: what a NaN or inf training loss does: ``"raise"`` (the fit
            fails with a ``WorkerError`` naming the step), ``"stop"`` (training
            ends before that step's update: the model gets the last good
            weights, ``status="completed"`` and ``History.stop_reason`` says
            why) or ``"skip"`` (that step's update is dropped and training goes
            on; a notice counts the skipped steps). Every rank agrees on the
            step; ``"stop"`` and ``"skip"`` cost one small all-reduce per step.
        profile: ``True`` or ``{"wait": 1, "warmup": 1, "active": 3, "repeat": 1,
            "record_shapes": False, "profile_memory": False, "with_stack": False,
            "dir": None}``: ``torch.profiler`` on every rank over the same
            steps (its schedule), stopped by itself after them; the ranks'
            traces come back and are merged into one Chrome/Perfetto trace,
            one process lane per rank, clocks aligned at the fit's start.
            ``History.profile`` gives its path and the top operators per rank.
            See ``docs/profiling.md``.
        loggers: where the run is written, once, from the kernel: ``"tensorboard"``,
            ``"wandb"``, ``"mlflow"``, ``"csv"``, or ``nbddp.loggers.TensorBoard(log_dir=...)``,
            ``WandB(project=...)``, ``MLflow(tracking_uri=..., experiment=...)``,
            ``CSV(path)`` or your own ``nbddp.loggers.Logger``: every record,
            and the hyperparameters once. A resumed fit continues the same
            runs. A logger that fails is reported and skipped; the fit goes on.
            Needs ``pip install "nbddp[loggers]"``; see ``docs/loggers.md``.
        callbacks: objects with any of ``on_fit_start(info)``,
            ``on_record(record)``, ``on_validation_end(record)``,
            ``on_epoch_end(record)``, ``on_fit_end(history)``, called in the
            kernel as records arrive; ``on_epoch_end``/``on_validation_end`` are
            synchronous (the ranks wait for them; their stop ends the fit right
            there, ``"completed"``, and ``self.handle.set_lr``/``save_checkpoint``
            act on every rank before the next epoch). A hook may stop the fit
            (``return "stop"`` or ``nbddp.stop_fit()``), and one that raises stops
            it cleanly (``History.stop_reason`` says why).
            ``nbddp.EarlyStopping(...)`` is one.
        compile: ``True`` or ``{"mode", "backend", "fullgraph", "dynamic",
            "regional"}``: ``torch.compile`` on every rank, applied by the
            strategy (DDP: the wrapped module; FSDP: each sharded block,
            ``regional``; pipeline: each stage; tensor parallel: each block).
            Inductor's caches are shared by the ranks of a host and by later
            fits of the session; ``History.ranks[i]["compile_s"]`` says how
            long each rank compiled. See ``docs/compile.md``.
        max_restarts: how many times a lost rank (a process killed or
            crashed, a collective broken by it, a stall past ``stall_timeout``)
            is replaced and the same fit goes on, in this call, from the last
            snapshot; the final weights equal an unbroken run's.
            ``History.restarts`` lists each restart. Default 0: a lost rank
            ends the fit. An exception raised by your code is not retried.
        snapshot_every: how often an elastic fit snapshots its whole state to
            ``/dev/shm`` (removed when the fit ends): an int of steps,
            ``"epoch"``, a duration (``"30s"``, ``"2min"``) or ``"auto"`` (the
            default: every 30 s, further apart if writing one would cost more
            than 2 % of the time). See ``docs/faults.md``.
        retry_on: exception classes to retry too (matched by name), such as
            a flaky ``OSError`` from remote storage.
        min_workers: the fewest ranks an elastic fit goes on with when a
            lost rank's replacement cannot start (torchrun's
            ``--nnodes=MIN:MAX``). The global batch is kept: the survivors
            read the lost ranks' shards and accumulate more micro-batches per
            step, so the weights stay the unbroken fit's. Default None: a
            lost rank must be replaced. DDP or FSDP, map-style data; see
            ``docs/faults.md``.
        **advanced: ``drop_last``, ``num_workers``, ``pin_memory``,
            ``prefetch`` (batches copied to the GPU on a side stream while the
            previous step computes: 0, 1 (default) or 2; ignored on CPU),
            ``record_interval_s``, ``publish_interval_s``.

    Kernel > Interrupt during a blocking fit stops every rank at the same
    step (the model holds that step's weights), then raises
    ``KeyboardInterrupt`` so that Run All stops; the History, with
    ``status == "interrupted"``, is on the exception (``e.history``) and in
    ``nbddp.last_history()``. A second interrupt kills and replaces the
    workers. The Stop button and ``handle.stop()`` return normally.

    Raises:
        TypeError, ValueError: bad arguments, before any worker starts work.
        WorkerError: a rank failed (``.rank``, ``.remote_traceback``).
        WorkerDied: a worker process died (pid, signal, log tail).
        WorkerStalled: a rank made no progress for ``stall_timeout`` seconds (``.stacks``).
    """
    given = dict(locals())  # first: this signature's parameters by name, and nothing else yet (the records' names)
    from nbddp.callbacks.fit_hooks import FitHooks
    from nbddp.fit.fit_run import FitRun
    from nbddp.live import choose_view
    from nbddp.fit.preflight import plan_fit

    del given["model"], given["data"]
    advanced = given.pop("advanced")
    args = FitArguments.of({**given, **advanced})
    watch, step = args.watch, args.step
    if not isinstance(watch.block, bool):
        raise TypeError(f"dist_fit(block=...) must be True or False, got {watch.block!r}")
    stall_timeout = check_stall_timeout(watch.stall_timeout, "dist_fit")
    view = choose_view(watch.live)
    hooks = FitHooks.build(watch.loggers, watch.callbacks, val_data=args.validation.val_data,
                           metrics=args.validation.metrics, step_fn=step.step_fn, optimizer=step.optimizer,
                           loss_fn=step.loss_fn,
                           scheduler=step.scheduler.get("scheduler") if isinstance(step.scheduler, dict)
                           else step.scheduler)
    if args.data.batch_size == "auto":  # the step the fit will take: strategy, precision, accumulation, checkpointing
        from nbddp.measure.batch_size import search_batch_size, trial_arguments

        args = replace(args, data=replace(args.data, batch_size=search_batch_size(model, data, trial_arguments(args))))
    s = get_session()
    s.ensure_started()
    with interrupts_held() as held, s.lock:  # an interrupt while it launches stops it once launched
        s.ensure_ready()
        plan = plan_fit(s, model, data, args)
        if stall_timeout is None and s.options is not None:
            stall_timeout = s.options.stall_timeout
        run_ = FitRun(s, plan, view, stall_timeout, hooks)
        run_.launch()
    return _wait_for_fit(run_, already=len(held)) if watch.block else _handle(run_, held=len(held))


def _handle(run_: FitRun, held: int) -> FitHandle:
    """``block=False``: the handle at once (a Kernel > Interrupt while it launched has asked the fit to stop)."""
    if held:
        run_.request_stop()
    return FitHandle(run_)


def _wait_for_fit(run_: FitRun, already: int = 0) -> History:
    """The History of a blocking fit; after a Kernel > Interrupt's clean stop, ``FitInterrupted`` carrying it."""
    from nbddp.protocol.errors import FitInterrupted

    interrupted: list[bool] = []

    def first_interrupt() -> None:
        interrupted.append(True)
        run_.request_stop()

    wait_interruptibly(run_, on_first_interrupt=first_interrupt, already=already)
    history = run_.result()  # a failure, or a second interrupt's kill, raises here
    if interrupted:
        raise FitInterrupted(history)
    return history


def last_history() -> History | None:
    """The ``History`` of this kernel's last fit that ended (also one interrupted by Kernel > Interrupt), or of
    the last ``%%ddp`` cell, ``nbddp.run`` call or script that reported (``nbddp.report``), whichever came last."""
    return get_session().last_history


@overload
def sweep(model: ModelLike, data: DataLike, *, space: Mapping[str, Any], n_trials: int, metric: str = "val_loss",
          mode: str = "min", workers_per_trial: int = 1, sampler: BaseSampler | None = None,
          pruner: BasePruner | None = None, study: Study | None = None, live: LiveChoice | Literal["html"] = None,
          block: Literal[True] = True, **fit_kwargs: Any) -> SweepResult: ...
@overload
def sweep(model: ModelLike, data: DataLike, *, space: Mapping[str, Any], n_trials: int, metric: str = "val_loss",
          mode: str = "min", workers_per_trial: int = 1, sampler: BaseSampler | None = None,
          pruner: BasePruner | None = None, study: Study | None = None, live: LiveChoice | Literal["html"] = None,
          block: Literal[False], **fit_kwargs: Any) -> SweepHandle: ...
@overload
def sweep(model: ModelLike, data: DataLike, *, space: Mapping[str, Any], n_trials: int, metric: str = "val_loss",
          mode: str = "min", workers_per_trial: int = 1, sampler: BaseSampler | None = None,
          pruner: BasePruner | None = None, study: Study | None = None, live: LiveChoice | Literal["html"] = None,
          block: bool = True, **fit_kwargs: Any) -> SweepResult | SweepHandle: ...


def sweep(model: ModelLike, data: DataLike, *, space: Mapping[str, Any], n_trials: int, metric: str = "val_loss",
          mode: str = "min", workers_per_trial: int = 1, sampler: BaseSampler | None = None,
          pruner: BasePruner | None = None, study: Study | None = None, live: LiveChoice | Literal["html"] = None,
          block: bool = True, **fit_kwargs: Any) -> SweepResult | SweepHandle:
    """Run ``n_trials`` independent fits on groups of the warm workers, sampled and pruned by Optuna.

    For a small model, DDP over every worker buys little; independent trials
    on each worker (or group of ``workers_per_trial``) run side by side with no
    gradient sync. The model code and data are shipped once per sweep.

    Args:
        model, data, **fit_kwargs: as for ``dist_fit`` (``val_data``,
            ``metrics``, ``epochs``, ``batch_size``, ...). A trial trains
            over its group with any ``dist_fit`` strategy: DDP, FSDP, or
            ``nbddp.TensorParallel``/``nbddp.Pipeline``/``mesh`` laid over the
            group's ranks (a mesh must span ``workers_per_trial``). ``max_restarts`` (default 1): how many times a trial
            whose worker died runs again; with ``snapshot_every`` it resumes
            from its newest snapshot instead.
        block: ``False`` returns a ``SweepHandle`` at once, a
            ``concurrent.futures.Future`` of the ``SweepResult``
            (``.result()``, ``.stop()``, ``.cancel()``, ``await``, ``.trials``).
        space: name -> an Optuna distribution, ``(low, high)``, ``(low, high,
            "log")`` or a list of choices. A name is a ``dist_fit`` option
            (``nbddp.sweeps.space.SWEEPABLE``: ``lr``, ``batch_size``, ``epochs``,
            ...), an argument of the model factory, or of ``step_fn`` after
            ``(model, batch)``.
        n_trials: how many trials the study should have completed or pruned
            (with a resumed ``study``, those done before count).
        metric, mode: the value each trial reports at every epoch and
            validation (``"val_loss"``, ``"val_<metric>"``, ``"loss"``), and
            whether lower (``"min"``) or higher (``"max"``) is better.
        workers_per_trial: ranks per trial; must divide the running workers.
            Each group gets its own process group; the session's group stays.
        sampler, pruner: Optuna's (default TPE and the median pruner). A pruned
            trial stops on its workers at its next synchronisation.
        study: an ``optuna.Study`` (with a SQLite storage a sweep resumes after
            a kernel restart, skipping the trials that are done).
        live: ``None`` or ``True`` (automatic): in Jupyter one output updated
            in place, the leaderboard (best first) and every trial's curve (the
            best red, the pruned grey); elsewhere a line per finished trial.
            ``"widget"``, ``"text"`` force one (``"html"``, the old spelling of
            ``"widget"``, warns); ``False`` shows nothing.
        stall_timeout: (a keyword of ``**fit_kwargs``) a trial whose rank makes
            no progress for this many seconds is killed and recorded as failed;
            its workers are replaced and the sweep goes on.

    Kernel > Interrupt stops every running trial and returns what finished
    (``SweepResult.status == "interrupted"``); a second one kills the ranks.
    A trial that raises is recorded as failed, with its rank and traceback.

    Returns:
        ``SweepResult``: ``trials`` (a DataFrame), ``best_params``,
        ``best_value``, ``histories``, ``best_model`` (the notebook's
        ``model`` with the best weights, or the factory's module), ``plot()``.

    Raises:
        ValueError, TypeError: bad arguments, before any trial starts.
        ImportError: Optuna is not installed (``pip install "nbddp[sweep]"``).
    """
    from nbddp.sweeps.call import run_sweep

    return run_sweep(model, data, space=space, n_trials=n_trials, metric=metric, mode=mode,
                     workers_per_trial=workers_per_trial, sampler=sampler, pruner=pruner, study=study, live=live,
                     block=block, fit_kwargs=fit_kwargs)


@overload
def predict(model: ModelLike | str, data: DataLike, *, batch_size: int | None = None,
            step_fn: Callable[..., Any] | None = None, output: str = "tensor", to: str | os.PathLike[str] | None = None,
            precision: str | None = None, live: LiveChoice = True, block: Literal[True] = True) -> Any: ...
@overload
def predict(model: ModelLike | str, data: DataLike, *, batch_size: int | None = None,
            step_fn: Callable[..., Any] | None = None, output: str = "tensor", to: str | os.PathLike[str] | None = None,
            precision: str | None = None, live: LiveChoice = True, block: Literal[False]) -> PredictHandle[Any]: ...
@overload
def predict(model: ModelLike | str, data: DataLike, *, batch_size: int | None = None,
            step_fn: Callable[..., Any] | None = None, output: str = "tensor", to: str | os.PathLike[str] | None = None,
            precision: str | None = None, live: LiveChoice = True, block: bool = True) -> Any: ...


def predict(model: ModelLike | str, data: DataLike, *, batch_size: int | None = None,
            step_fn: Callable[..., Any] | None = None, output: str = "tensor", to: str | os.PathLike[str] | None = None,
            precision: str | None = None, live: LiveChoice = True, block: bool = True) -> Any | PredictHandle[Any]:
    """Run ``model`` over ``data`` on every worker; the outputs come back here, in the dataset's order.

    Each rank predicts one contiguous block of the data, so every sample is
    predicted exactly once, whatever the length (no padding duplicates), and
    the blocks put one after the other are in the dataset's order. Runs in
    eval mode under ``torch.inference_mode()``, on the workers' devices.

    Args:
        model: an ``nn.Module`` (shipped to every rank), a zero-argument
            function returning one (built on each rank with the same seed), or
            the name an earlier ``dist_fit(..., keep="name")`` bound the
            trained module to on every worker: DDP; FSDP (its shards stay
            where they are, and every rank runs as many forwards); a
            pipeline, tensor-parallel or 2-D mesh fit (each model copy
            predicts its block; the last stage's, or ``tp`` rank 0's,
            outputs come back).
        data: a map-style ``Dataset``, a tuple of tensors, a ``DataLoader``
            over a dataset (its collate function and batch size are used), or
            a zero-argument function building one of these on each worker.
            A stream (``IterableDataset``): rank ``r`` of ``N`` predicts its
            samples ``r, r + N, ...``, and the call returns ``(outputs, ids)``,
            in the order the samples came, ``ids`` their places in the stream.
        batch_size: samples per forward on each rank (default: the
            DataLoader's, else 32).
        step_fn: ``step_fn(model, batch) -> what to keep`` (logits, an argmax,
            a dict of tensors). Default: ``model(x)`` for ``(x,)``/``(x, y)``
            batches, ``model(**batch)`` for dicts. Not for a kept pipeline
            (no rank holds the whole model).
        output: ``"tensor"``: tensors are concatenated into one, dicts of
            tensors into a dict of concatenated tensors, anything else is a
            list of the batches' outputs; ``"list"``: always that list.
        to: a directory, or a file name ending in ``.pt``: each rank writes
            its part there (``part-00000.pt``, ... or ``x.part-00000.pt``, ...;
            ``torch.load`` reads each: ``{"kind", "value", "rows", "first",
            "samples", "stride", "stream"}``) instead of sending it, for
            outputs larger than the kernel's memory; an index
            (``index.pt``, or ``x.pt`` itself) lists them in order. Returns
            the parts' paths, in the dataset's order.
        precision: ``"32-true"``, ``"bf16-mixed"`` (autocast), ``"16-mixed"`` (CUDA).
            Default: a kept model's fit precision, else ``"32-true"``.
        live: the progress while it runs: ``True`` (automatic: a progress bar
            in Jupyter, a line rewritten in place elsewhere), ``"widget"``,
            ``"text"``, or ``False`` (nothing).
        block: ``False`` returns a ``PredictHandle`` at once, a
            ``concurrent.futures.Future`` of the outputs (``.result()``,
            ``.done()``, ``.stop()``, ``.cancel()``, ``await handle``).

    Outputs travel back through ``/dev/shm`` on the kernel's host, as
    ``dist_fit``'s weights do. Kernel > Interrupt stops every rank and raises
    ``KeyboardInterrupt``: nothing half-done is returned.

    Raises:
        TypeError, ValueError: bad arguments, before any worker starts work.
        WorkerError: a rank failed; its message names the rank and the samples of the failing batch.
    """
    from nbddp.inference.checks import check_output, check_to

    return run_inference("nbddp.predict", model, data, batch_size, precision, live, block, output=check_output(output),
                      to=check_to(to), step_fn=step_fn)


@overload
def evaluate(model: ModelLike | str, data: DataLike, *, metrics: Mapping[str, Any],
             loss_fn: Callable[..., Any] | None = None, batch_size: int | None = None,
             step_fn: Callable[..., Any] | None = None, target_fn: Callable[..., Any] | None = None,
             precision: str | None = None, live: LiveChoice = True, block: Literal[True] = True) -> dict[str, Any]: ...
@overload
def evaluate(model: ModelLike | str, data: DataLike, *, metrics: Mapping[str, Any],
             loss_fn: Callable[..., Any] | None = None, batch_size: int | None = None,
             step_fn: Callable[..., Any] | None = None, target_fn: Callable[..., Any] | None = None,
             precision: str | None = None, live: LiveChoice = True, block: Literal[False]) -> PredictHandle[dict[str, Any]]: ...
@overload
def evaluate(model: ModelLike | str, data: DataLike, *, metrics: Mapping[str, Any],
             loss_fn: Callable[..., Any] | None = None, batch_size: int | None = None,
             step_fn: Callable[..., Any] | None = None, target_fn: Callable[..., Any] | None = None,
             precision: str | None = None, live: LiveChoice = True, block: bool = True) -> dict[str, Any] | PredictHandle[dict[str, Any]]: ...


def evaluate(model: ModelLike | str, data: DataLike, *, metrics: Mapping[str, Any],
             loss_fn: Callable[..., Any] | None = None, batch_size: int | None = None,
             step_fn: Callable[..., Any] | None = None, target_fn: Callable[..., Any] | None = None,
             precision: str | None = None, live: LiveChoice = True, block: bool = True) -> dict[str, Any] | PredictHandle[dict[str, Any]]:
    """Exact metric values over the whole of ``data``, computed on every worker; a dict ``name -> value``.

    Args:
        model, data, batch_size, precision, live, block: as for ``predict``;
            batches are ``(x, y)`` or ``(x1, ..., y)``, run as ``model(x1, ...)``,
            or dicts, run as ``model(**batch)`` with ``batch["labels"]`` the
            targets (Hugging Face style: an output's ``.logits`` go to the
            metrics, its ``.loss`` is reported as ``"loss"`` without ``loss_fn``).
        metrics: ``name -> metric``: a torchmetrics ``Metric`` (or any object
            with ``update(outputs, targets)`` and ``compute()``), which syncs
            its state over the ranks itself, so F1, AUROC or precision equal
            the one-process values; or a function ``(outputs, targets) -> one
            value per sample`` (or the batch's mean), averaged over every sample.
        loss_fn: ``loss_fn(outputs, targets)``, a batch mean, averaged over
            every sample as ``"loss"``.
        step_fn: ``step_fn(model, batch) -> outputs`` the metrics see
            (instead of the model on the batch's inputs).
        target_fn: ``target_fn(batch) -> targets`` (instead of ``y`` or
            ``batch["labels"]``).

    Every sample counts once (each rank evaluates its own block, no padding).
    Needs ``pip install "nbddp[metrics]"`` for torchmetrics.
    """
    from nbddp.inference.checks import check_metrics

    return run_inference("nbddp.evaluate", model, data, batch_size, precision, live, block,
                      metrics=check_metrics(metrics), loss_fn=loss_fn, step_fn=step_fn, target_fn=target_fn)


def export_checkpoint(path: str, out: str, trust_checkpoint: bool = False) -> str:
    """Turn a sharded checkpoint (a ``step-*`` directory of an FSDP fit) into one file that ``torch.load`` reads.

    The file holds ``{"model": full state dict, "optimizer": ..., "step": ..., "epoch": ...}``;
    ``plain_model.load_state_dict(torch.load(out)["model"])`` works without
    nbddp or a process group. Runs here, in the kernel. Returns ``out``.

    ``path`` is read without running code from it (tensors and plain data only, as
    ``torch.load(weights_only=True)``); a checkpoint that needs more raises
    ``UntrustedCheckpointError`` naming it, unless ``trust_checkpoint=True``.
    """
    from nbddp.worker.tasks.checkpoint_export import export

    if not isinstance(trust_checkpoint, bool):
        raise TypeError(f"export_checkpoint(trust_checkpoint=...) must be True or False, got {trust_checkpoint!r}")
    return export(os.path.abspath(os.fspath(path)), os.path.abspath(os.fspath(out)), trust_checkpoint)


def debug(rank: int | None = None, commands: list[str] | None = None) -> Any:
    """A pdb prompt on a failed rank's frame, or on a rank paused at ``breakpoint()``.

    Args:
        rank: the rank to debug, as the ``WorkerError`` or the live view named
            it; default: the one there is, or a list to choose from
            (``attach R``).
        commands: run these pdb commands without a prompt and return the
            transcript (scripts, headless runs, tests); a paused rank stays
            paused unless one of them is ``c``.

    Commands are pdb's own (``p``, ``pp``, ``l``, ``ll``, ``w``, ``u``, ``d``,
    ``n``, ``s``, any expression), ``c`` (resume), ``q`` (quit: a paused
    rank's work ends with an error), and ``list``, ``attach R``, ``detach``,
    ``cast ranks(0,1) CMD``, ``continue all``.

    Raises:
        TypeError: ``commands`` is not a list of strings.
        ValueError: ``rank`` is not a rank of the workers, or has nothing to debug.
        NothingToDebug: no rank is paused and none keeps a failure.
    """
    from nbddp.debugging.commands import debug as debug_on

    return debug_on(get_session(), rank, commands)


def clear_debug() -> str:
    """``%ddp debug --clear``: every rank drops the failure it keeps (and the memory its frames hold)."""
    from nbddp.debugging.commands import clear

    return clear(get_session())


__all__ = ["start", "stop", "status", "restart", "run", "dist_fit", "last_history", "report", "should_stop",
           "lightning_logger", "accelerate_tracker", "sweep", "predict", "evaluate",
           "export_checkpoint", "debug", "clear_debug", "detach", "attach", "sessions", "running", "kept"]
