"""A ``predict``/``evaluate`` call in flight: one task per rank, watched in a thread, the outputs put together.

Like ``fit/fit_run.py``'s ``FitRun``, in small: the ranks' tasks are watched
by ``nbddp.execution.rank_tasks.RankTasks`` (a rank that raises is a ``WorkerError``
naming it at once; stalls are seen; a dead controller is named), and the
calling cell waits with ``nbddp.execution.work.wait_interruptibly`` or gets a
``PredictHandle`` (``block=False``).

On the kernel's host, a predict returning tensors gets one shared output
file, created here before the ranks start (``shipping/output_file.py``) and
mapped as the value at the end (``outputs_back.py``).

Kernel > Interrupt: the first asks every rank to stop (SIGINT, a flag on the
rank, looked at before each batch), the second kills the ranks (they are
replaced). Either way the call raises ``KeyboardInterrupt`` and returns
nothing: outputs some ranks already sent are removed unread. So are they when
a rank fails.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, TypeVar

from nbddp.execution.handle import WorkHandle
from nbddp.execution.rank_tasks import RankTasks
from nbddp.execution.send import to_ranks
from nbddp.execution.work import Work
from nbddp.inference.checks import PredictPlan
from nbddp.inference.outputs_back import put_together
from nbddp.inference.progress import ProgressLine, total_batches
from nbddp.protocol.messages import PredictLaunch, PredictResult
from nbddp.shipping import output_file
from nbddp.shipping import pickling as shipping

if TYPE_CHECKING:
    from nbddp.protocol.placement import Placement
    from nbddp.session.session import Session

HARD_STOP_WAIT_S = 30.0
T = TypeVar("T")  # what the call returns: predict's outputs, evaluate's dict of values


class PredictRun(Work):
    session: Session  # the sources its parcels carry are the session's (SessionLike does not hold them)

    def __init__(self, session: Session, plan: PredictPlan, live: str):
        """``live``: the progress view, ``"widget"``, ``"text"`` or ``"off"`` (``inference/progress.py``)."""
        super().__init__(session, f"a {plan.what}")
        self.plan = plan
        copies = session.world_size // plan.mp  # every rank of a model copy reads the copy's batches
        total = total_batches(plan.n, copies, plan.launch.batch_size)
        self.progress = ProgressLine(plan.what, total * plan.mp if total is not None else None, live)
        self.tasks: RankTasks | None = None
        self.value: Any = None
        self.error: BaseException | None = None
        self.stop_requested = False
        self.hard_stopped = False
        self.timings: dict[str, float] = {"ship_s": plan.ship_s}
        self.started_at = time.perf_counter() - plan.ship_s
        self.thread: threading.Thread | None = None

    # ---- the work protocol (Session.running, nbddp.execution.work) -------------------
    def launch(self) -> None:
        """Start every rank's task and the watcher (call holding the session's lock, after ``ensure_ready``)."""
        from nbddp.worker.tasks.predict import evaluate_task, predict_task

        s = self.session
        launch = self.plan.launch
        task = predict_task if launch.task == "predict" else evaluate_task
        try:
            if shares_file(launch, s.placements):
                self.plan.launch = launch = replace(launch, out_file=output_file.create(s.file_prefix))
            s.follow_kernel_paths()
            ars = to_ranks(s.client, s.placements, task,
                           lambda p: (s.sources.attach(self.plan.parcels[p.local], p), launch))
        except BaseException:
            self._discard_outputs()
            self.plan.discard()
            raise
        self.tasks = RankTasks(s, ars, self.plan.what)
        s.running = self
        self.thread = threading.Thread(target=self._watch, name="nbddp-predict-watch", daemon=True)
        self.thread.start()

    def request_stop(self) -> None:
        """Every rank stops before its next batch; the call then raises ``KeyboardInterrupt``."""
        tasks, workers = self.tasks, self.session.workers
        if self.finished or self.stop_requested or tasks is None:  # (tasks: set by launch, before it is running)
            return
        self.stop_requested = True
        tasks.stopping()  # a rank that cannot take the stop is killed after a grace
        if workers is not None:
            workers.signal([p.engine_id for p in self.session.placements], signal.SIGINT)

    def hard_stop(self, reason: str = "a second interrupt") -> None:
        """Kill every rank now (the supervisor replaces them)."""
        if self.finished:
            return
        self.hard_stopped = True
        self.session.supervisor.kill_ranks([p.rank for p in self.session.placements])
        self.done_event.wait(HARD_STOP_WAIT_S)

    # ---- watcher thread --------------------------------------------------------------
    def _watch(self) -> None:
        try:
            tasks = self.tasks
            assert tasks is not None, "launch() sets the tasks before it starts the watcher"
            results = tasks.wait(on_tick=lambda: self.progress.tick(tasks.ars))
            self.value = self._finish(results)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting cell / handle
            self.error = exc
        finally:
            self._discard_outputs()
            self.release_workers()
            self.plan.discard()
            self.progress.finish(self.status)
            self.set_done()

    @property
    def status(self) -> str:
        if self.stop_requested or self.hard_stopped:
            return "interrupted, nothing returned"
        return "failed" if self.error is not None else "done"

    def _finish(self, results: dict[int, PredictResult]) -> Any:
        if any(r.status != "completed" for r in results.values()):
            self.stop_requested = True
            return None
        t0 = time.perf_counter()
        # the ranks that hold outputs (all, or one per model copy: a pipeline's last stage, tp rank 0), in order
        holders = [results[r] for r in sorted(results) if results[r].outputs is not None or results[r].path]
        if self.plan.launch.task == "evaluate":
            value = shipping.unpack(next(r.values for r in results.values() if r.values is not None))
        elif self.plan.launch.to:
            value = write_index(self.plan.launch.to, holders)
        else:
            parts = [shipping.unpack(r.outputs, copy=False) for r in holders]
            value = put_together(parts, holders, self.plan.launch.out_file, self.plan.launch.output)
        self.timings.update(predict_s=max(r.timings.get("predict_s", 0.0) for r in results.values()),
                            pack_s=max(r.timings.get("pack_s", 0.0) for r in results.values()),
                            setup_s=max(r.timings.get("setup_s", 0.0) for r in results.values()),
                            load_s=time.perf_counter() - t0, total_s=time.perf_counter() - self.started_at)
        return value

    def _discard_outputs(self) -> None:
        """Remove every rank's output file, read or not (a failed or stopped call returns none of them), and the
        shared file's name (a value mapping it keeps its memory)."""
        if self.plan.launch.out_file:
            output_file.remove(self.plan.launch.out_file)
        for result in (self.tasks.results.values() if self.tasks is not None else ()):
            for parcel in (getattr(result, "outputs", None), getattr(result, "values", None)):
                if parcel is not None:
                    parcel.discard()

    def result(self) -> Any:
        if self.stop_requested or self.hard_stopped:
            raise KeyboardInterrupt(f"{self.plan.what} was interrupted: it returns nothing (no rank's outputs are "
                                    "kept); call it again to run it whole")
        if self.error is not None:
            raise self.error
        return self.value


def shares_file(launch: PredictLaunch, placements: list[Placement]) -> bool:
    """Whether the ranks on this host write ``predict``'s outputs into one shared file (``shipping/output_file.py``):
    a predict returning tensors here (not ``to=``, not ``output="list"``)."""
    return launch.task == "predict" and not launch.to and launch.output == "tensor" and any(p.local for p in placements)


def write_index(to: str, results: list[PredictResult]) -> list[str]:
    """The parts' paths, in rank order (the dataset's, for map-style data), also saved as the index file (0600)."""
    import os

    import torch

    paths = [r.path for r in results]
    index = to if to.endswith(".pt") else os.path.join(to, "index.pt")
    fd = os.open(index, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        torch.save({"parts": paths, "first": [r.first for r in results], "samples": [r.samples for r in results],
                    "stride": [r.stride for r in results], "stream": any(r.stream for r in results)}, f)
    return paths


class PredictHandle(WorkHandle[T]):
    """Returned by ``predict``/``evaluate`` with ``block=False``: the call goes on while the notebook stays usable.

    A ``concurrent.futures.Future`` of the call's value, as every nbddp
    handle (``nbddp/execution/handle.py``): ``done``, ``result`` (``wait``),
    ``exception``, ``cancel``, ``add_done_callback``, ``stop`` and ``await
    handle``. Stopped, the call returns nothing: ``stop()`` returns None and
    ``result()`` raises ``KeyboardInterrupt``.
    """

    def __init__(self, run: PredictRun):
        super().__init__(run, run.plan.what)
        self._run = run
        run.when_done(lambda: self.settle(run.result))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds: shipping, the slowest rank's loop and packing, loading here, the whole call."""
        return dict(self._run.timings)

    def __repr__(self) -> str:
        return f"<PredictHandle {self._run.plan.what}: {'running' if not self.done() else self._run.status}>"
