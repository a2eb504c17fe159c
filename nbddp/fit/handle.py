"""FitHandle: a fit that runs while the notebook stays usable (``block=False``), and what callbacks act through."""

from __future__ import annotations

import os
from typing import Any, Callable, Protocol

from nbddp.callbacks.base import hook_stop
from nbddp.callbacks.epoch_answers import Answers
from nbddp.callbacks.fit_hooks import FitHooks
from nbddp.execution.handle import WorkHandle
from nbddp.execution.work import Interruptible
from nbddp.fit.history import History
from nbddp.live.state import LiveState
from nbddp.profiling.requests import ProfileRequests
from nbddp.protocol.errors import NbddpError


class HandledFit(Interruptible, Protocol):
    """What a handle acts on: the fit in flight (``fit_run.FitRun``, which imports this module to make one)."""

    hooks: FitHooks
    requests: ProfileRequests
    live_state: LiveState

    @property
    def finished(self) -> bool: ...

    @property
    def history(self) -> History: ...

    def request_stop(self, reason: str | None = None) -> None: ...

    def when_done(self, fn: Callable[[], None]) -> None: ...

    def outcome(self) -> History: ...

    def notices_once(self) -> None: ...


class FitHandle(WorkHandle[History]):
    """Returned by ``dist_fit(..., block=False)``, and given to every callback
    (``info.handle`` in ``on_fit_start``, ``self.handle`` on a ``Callback``).

    The training and the dashboard go on in the background; the model gets
    the trained weights when training ends (or is stopped). A
    ``concurrent.futures.Future`` whose value is the ``History``:
    ``done``, ``result`` (``wait``), ``exception``, ``cancel``,
    ``add_done_callback``, ``stop`` and ``await handle``, as every nbddp
    handle (``nbddp/execution/handle.py``).

    ``result()``, ``wait()``, ``exception()`` and ``stop()`` called from one
    of the fit's own callbacks raise ``NbddpError`` (the fit cannot end while
    its hook waits for it); ``stop()`` there is the hook's own stop.
    """

    def __init__(self, run: HandledFit):
        super().__init__(run, "training")
        self._run = run
        run.when_done(lambda: self.settle(run.outcome))

    def check_waiter(self, method: str) -> None:
        self._not_from_a_hook(method)

    def before_result(self) -> None:
        self._run.notices_once()  # the workers' notices, raised in the thread that takes the result

    def stop(self, wait: bool = True) -> History | None:
        """Stop every rank at the same step (as the Stop button does); with ``wait``, return the History.

        From a callback's hook it is the hook's own stop (as returning
        ``"stop"``) and returns None at once: in ``on_epoch_end`` the fit ends
        after that epoch with ``status="completed"``.
        """
        stop = hook_stop()
        if stop is not None:
            stop("FitHandle.stop() from a callback")
            return None
        return super().stop(wait)

    def request_stop(self) -> None:
        stop = hook_stop()
        if stop is not None:  # cancel() from a hook: the hook's own stop
            stop("FitHandle.cancel() from a callback")
            return
        self._run.request_stop()

    def set_lr(self, lr: float) -> None:
        """Set every parameter group's learning rate on every rank, from the next optimizer step on.

        Taken at the fit's next synchronous point: call it from a callback's
        ``on_epoch_end`` (or ``on_validation_end``), and the next epoch trains
        with ``lr`` on every rank (``History.steps`` shows it). A scheduler
        goes on from there (``StepLR`` and ``ReduceLROnPlateau`` scale the new
        rate; a ``LambdaLR`` or ``OneCycleLR`` sets its own again at its next
        step, as in plain PyTorch).

        Raises:
            NbddpError: the fit has ended, or no callback of it defines
                ``on_epoch_end``/``on_validation_end`` (nothing would take it).
            TypeError, ValueError: ``lr`` is not a finite number >= 0.
        """
        self._answers("set_lr").set_lr(lr)

    def save_checkpoint(self, path: str) -> str:
        """Ask every rank to write the fit's checkpoint into the folder ``path`` before it trains on.

        Taken at the fit's next synchronous point (a callback's
        ``on_epoch_end``/``on_validation_end``), through the fit's own
        checkpoint code: ``step-<N>.pt`` in ``path`` (a sharded folder under
        FSDP) with the optimizer, scheduler and RNG states, the newest few
        kept; ``dist_fit(..., resume=path)`` continues from it. Returns the
        folder, made absolute.

        Raises:
            NbddpError: the fit has ended, or has no synchronous callback.
            TypeError, ValueError: ``path`` is not a folder path.
        """
        return self._answers("save_checkpoint").save_checkpoint(path)

    def _not_from_a_hook(self, method: str) -> None:
        if hook_stop() is not None:
            raise NbddpError(f"handle.{method}() was called from one of this fit's callbacks; it waits for the fit, "
                             "and the fit waits for the callback. Call it from a cell; from a hook, return 'stop', "
                             "or use handle.set_lr / handle.save_checkpoint")

    def _answers(self, method: str) -> Answers:
        run = self._run
        answers = run.hooks.answers
        if run.finished:
            raise NbddpError(f"handle.{method}(): this fit has ended ({self.status}); nothing would take it")
        if answers is None:
            raise NbddpError(f"handle.{method}() is taken by the ranks at a synchronous callback point, and this "
                             "fit has none: call it from a callback's on_epoch_end(record) (or "
                             "on_validation_end), e.g. dist_fit(..., callbacks=[MyCallback()]) with "
                             f"def on_epoch_end(self, record): self.handle.{method}(...)")
        return answers

    def profile(self, steps: int = 10, dir: str | os.PathLike[str] | None = None) -> dict[str, Any]:
        """Trace the next ``steps`` optimizer steps on every rank with torch.profiler while the fit goes on.

        Every rank starts at the same step (the request rides in the next
        record's reduction); the call returns once every rank's trace is in,
        merged into one Chrome/Perfetto file: a dict like ``History.profile``
        (``path``, ``ranks``, ``top_ops``, ``breakdown``, ``hta``, ``rank_traces``,
        ``summary``). The fit
        does not stop. The file goes into ``dir`` (made owner-only if missing),
        or a new private temporary folder.

        Raises:
            NbddpError: the fit has ended, or it ended before any traced step,
                or this is called from one of the fit's callbacks.
            ValueError: ``steps`` is not a whole number >= 1.
        """
        self._not_from_a_hook("profile")
        run = self._run
        if run.finished:
            raise NbddpError(f"handle.profile(steps={steps!r}): this fit has ended ({self.status}); profile a running "
                             "fit (dist_fit(..., block=False)), or trace a fit from its start with "
                             "dist_fit(..., profile=True)")
        request = run.requests.ask(steps, None if dir is None else os.fspath(dir))
        result = run.requests.wait(request, None)
        if result is None:
            raise NbddpError(f"handle.profile(steps={steps}): the fit ended ({self.status}) before its ranks traced a "
                             "step; ask for fewer steps, or earlier")
        return result

    @property
    def history(self) -> History:
        """What has arrived so far (the full History once training ended)."""
        return self._run.history

    @property
    def status(self) -> str:
        """starting, training, validating, stopping, then completed, interrupted or failed."""
        return self._run.live_state.status

    def __repr__(self) -> str:
        steps = self._run.history.steps
        where = f"step {steps[-1]['step']}" if steps else "starting"
        return f"<FitHandle {self.status}, {where}>"
