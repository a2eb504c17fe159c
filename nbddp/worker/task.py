"""What every task that runs the person's code does around it, in one place.

Fits, ``nbddp.run`` calls, ``%%ddp`` cells, pushes, pulls and scripts all
run inside ``user_task``: the task is checked against this engine's
process-group generation, edited modules are reloaded, frameworks see this
generation's ranks (``worker.torchrun``), a heartbeat reports where the rank
is (``worker.monitor``; ``phase`` names the kind of task: ``"fit"``,
``"cell"``, ``"call"``, ``"script"``, ``"push"``), SIGTERM ends the engine
at once (``state.exit_on_sigterm``: a Slurm job being cancelled), and the
modules the task imported are noted for the next one.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from nbddp.worker import freshness, torchrun
from nbddp.worker.monitor import monitoring
from nbddp.worker.state import check_generation, exit_on_sigterm


@contextlib.contextmanager
def user_task(generation: int | None, phase: str = "call") -> Iterator[None]:
    check_generation(generation)
    freshness.reload_changed()
    try:
        with monitoring(phase), torchrun.user_code(generation), exit_on_sigterm():
            yield
    finally:
        freshness.note_imported()
