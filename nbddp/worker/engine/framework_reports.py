"""HF ``Trainer`` reports through ``nbddp.report`` on the ranks, with no change to the person's code.

``install`` (at every task's start, cheap after the first) puts nbddp's
``TrainerCallback`` in ``transformers.trainer.DEFAULT_CALLBACKS``, the list
every ``Trainer`` starts its callbacks from: at once when transformers is
imported, else right after its ``trainer`` module is first imported (a
finder on ``sys.meta_path`` wraps that one module's loading). The callback
does nothing outside a task that reports (``report_channel.OPEN`` empty):

* ``on_log``: the numbers of the Trainer's logs (``loss``, ``grad_norm``,
  ``learning_rate``, ``eval_*``...) reported at ``state.global_step``; the
  Trainer's own loss is already a mean over the ranks, so the mean of the
  reports is that same value;
* ``on_step_end``: ``should_stop(global_step)`` sets
  ``control.should_training_stop``, so every rank ends at the agreed step.

Lightning and accelerate take a logger object instead
(``worker/tasks/report_loggers.py``): they have no list every run reads.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import numbers
import sys
from types import ModuleType
from typing import Any

from nbddp.worker.engine.report_channel import OPEN

TRAINER_MODULE = "transformers.trainer"
_STATE: dict[str, Any] = {"callback": None, "finder": None}


def trainer_callback() -> type:
    """nbddp's ``TrainerCallback`` class (made once, on first use: it subclasses transformers' own)."""
    if _STATE["callback"] is None:
        from transformers import TrainerCallback

        class NbddpReportCallback(TrainerCallback):
            """Reports the Trainer's logs to nbddp's live view; ends training at nbddp's agreed stop step."""

            def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
                       **kwargs: Any) -> None:
                if not OPEN or not logs:
                    return
                values = {k: v for k, v in logs.items() if isinstance(v, numbers.Real)}
                if values:
                    channel = OPEN[-1]
                    # never before this rank's last step (a second train() counts from 0 again: it joins the last)
                    step = max(int(state.global_step), channel.last_step or 0)
                    channel.report(step, "mean", values)

            def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if OPEN and OPEN[-1].should_stop(int(state.global_step)):
                    control.should_training_stop = True

        _STATE["callback"] = NbddpReportCallback
    return _STATE["callback"]


def _patch(trainer_module: ModuleType) -> None:
    callbacks = getattr(trainer_module, "DEFAULT_CALLBACKS", None)
    if isinstance(callbacks, list):
        cls = trainer_callback()
        if cls not in callbacks:
            callbacks.append(cls)


class _AfterTrainerImport(importlib.abc.MetaPathFinder):
    """Finds ``transformers.trainer`` as Python would, and patches it right after it is executed."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != TRAINER_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = spec.loader if spec is not None else None
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            try:
                _patch(module)
            except Exception:  # noqa: BLE001 - the Trainer still works, without the live view
                pass

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Make every ``Trainer`` built on this rank report (see the module docstring)."""
    module = sys.modules.get(TRAINER_MODULE)
    if module is not None:
        _patch(module)
        return
    if _STATE["finder"] is None:
        finder = _AfterTrainerImport()
        _STATE["finder"] = finder
        sys.meta_path.insert(0, finder)
