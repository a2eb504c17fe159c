"""What every task that runs the person's code does around it, in one place.

Fits, ``nbddp.run`` calls, ``%%ddp`` cells, pushes, pulls and scripts all
run inside ``user_task``: the task is checked against this engine's
process-group generation, edited modules are reloaded, frameworks see this
generation's ranks (``worker/engine/torchrun.py``), a heartbeat reports where the rank
is (``worker/engine/heartbeat.py``; ``phase`` names the kind of task: ``"fit"``,
``"cell"``, ``"call"``, ``"script"``, ``"push"``), SIGTERM ends the engine
at once (``nbddp.worker.engine.rank_state.exit_on_sigterm``: a Slurm job being cancelled), and the
modules the task imported are noted for the next one. A failure of the
person's code is kept for ``%ddp debug`` (``worker/debugging/postmortem.py``) until the
rank's next fit; a debugger line still open when the task ends is closed.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

from nbddp.worker.debugging import rank_pdb as debugger
from nbddp.worker.tasks import module_reload as freshness
from nbddp.worker.debugging import postmortem
from nbddp.worker.engine import torchrun
from nbddp.protocol.messages import PUBLISH_KEYS
from nbddp.worker.engine.heartbeat import engine_publisher, monitoring
from nbddp.worker.engine.rank_state import STATE, check_generation, exit_on_sigterm
from nbddp.worker.engine import framework_reports
from nbddp.worker.engine.report_channel import reporting
from nbddp.protocol.reports import stop_note

REPORTING_PHASES = ("cell", "call", "script")  # the tasks whose code may call nbddp.report


@contextlib.contextmanager
def user_task(generation: int | None, phase: str = "call", trains: bool | None = None) -> Iterator[None]:
    """``trains``: the task trains (default: a fit), so a kept failure and the memory its frames hold go first."""
    check_generation(generation)
    if phase == "fit" if trains is None else trains:
        postmortem.clear()
    freshness.reload_changed()
    try:
        with monitoring(phase), torchrun.user_code(generation), exit_on_sigterm(), reports_open(phase):
            yield
    except BaseException as exc:
        publish_raised_at(time.time())
        postmortem.keep(exc)
        raise
    finally:
        debugger.end_of_task()
        freshness.note_imported()


@contextlib.contextmanager
def reports_open(phase: str) -> Iterator[None]:
    """``nbddp.report`` and ``should_stop`` act while a cell, call or script runs (a fit has its own reporter)."""
    if phase not in REPORTING_PHASES or STATE.placement is None:
        yield
        return
    framework_reports.install()
    rank = STATE.placement.rank
    with reporting(rank, stop_note(STATE.file_prefix) if STATE.file_prefix else None):
        yield


def publish_raised_at(when: float) -> None:
    """Tell the kernel when this rank raised (wall clock), before ipyparallel formats the traceback.

    When several ranks fail, the headline is the one that failed first; the
    task's end as the engine reports it comes after the traceback is
    formatted and the reply sent, which on a loaded machine can reorder ranks
    that raised half a second apart.
    """
    publish = engine_publisher()
    if publish is not None:
        try:
            publish({PUBLISH_KEYS["raised"]: when})
        except Exception:  # noqa: BLE001 - only an ordering hint: the task's own end time is the fallback
            pass
