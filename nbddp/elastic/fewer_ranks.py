"""An elastic fit that goes on with fewer ranks when no replacement can start: ``dist_fit(min_workers=N)``.

torchrun's ``--nnodes=MIN:MAX`` lets a job go on with as few as MIN nodes;
it restarts the workers with the new world size and leaves the batch to the
script, so the global batch shrinks with the world. Here the fit goes on in
the same call and keeps its global batch (``batch_size x world x
grad_accum``): on ``world`` ranks out of the ``data_world`` it began with,
each rank reads ``data_world // world`` of the original shards and
accumulates that many times more micro-batches per step
(``worker/data/fewer_ranks.py``), so every step sees the samples it would
have seen, and the weights stay those of the unbroken fit up to the order of
the floating-point sums. DDP's snapshot is one file any rank reads; FSDP's
is a DCP folder, which DCP reshards for the fewer ranks as they load it.
A pipeline or tensor-parallel fit, and a stream, are refused.

The rule, exact by construction: the fit goes on with the largest number of
the surviving workers that divides ``data_world`` (3 survivors of 4 ranks:
2 ranks, each reading 2 shards; the third waits outside the group), and only
when that number is at least ``min_workers``. A ``min_workers`` that no such
number can meet is refused when the fit starts.

When: the supervisor's heal could not bring the lost rank back (its engine
could not be started, an attached cluster's replacement did not register
within ``elastic.replacements.WAIT_S``, a Slurm engine's job did not start
within ``queue_timeout``). The workers are not grown back during the fit;
the session's next call first heals back to the size the fit began with
(``Supervisor.regrow_to``).
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

from nbddp.elastic.contracts import Relaunchable, RestartLedger
from nbddp.protocol.errors import ClusterError, WorkerError
from nbddp.protocol.parallel_settings import settings_of
from nbddp.protocol.strategy_settings import StrategyChoice


def check_min_workers(min_workers: int | None, max_restarts: int, world: int, strategy: StrategyChoice,
                      stream: bool) -> int | None:
    """``dist_fit(min_workers=...)`` checked against the running workers: the number, or None (not set).

    Raises:
        TypeError / ValueError: naming the value, what was wrong and the fix.
    """
    if min_workers is None:
        return None
    if isinstance(min_workers, bool) or not isinstance(min_workers, numbers.Integral):
        raise TypeError(f"dist_fit(min_workers=...) must be an int (the fewest ranks a fit may go on with), got "
                        f"{type(min_workers).__name__} {min_workers!r}")
    if min_workers < 1:
        raise ValueError(f"dist_fit(min_workers={min_workers}): a fit needs at least 1 rank; give 1 to {world}, "
                         "or leave it out to always wait for a replacement")
    if min_workers > world:
        raise ValueError(f"dist_fit(min_workers={min_workers}) is above the {world} workers running; give 1 to "
                         f"{world}, or start more workers first (nbddp.start(n={min_workers}))")
    if max_restarts < 1:
        raise ValueError(f"dist_fit(min_workers={min_workers}) takes effect only in a fit that restarts after a lost "
                         "rank; pass max_restarts=N (N >= 1) too, or leave min_workers out")
    settings_of(strategy).require("fewer_ranks", "min_workers=...", "Leave min_workers out (a lost rank is then "
                                  "replaced)")
    if stream:
        raise ValueError("dist_fit(min_workers=...) needs map-style data: a stream's position cannot be dealt out "
                         "again to fewer ranks. Leave min_workers out (a lost rank is then replaced), or give a "
                         "map-style Dataset")
    usable = [d for d in divisors(world) if min_workers <= d < world]
    if min_workers < world and not usable:
        raise ValueError(f"dist_fit(min_workers={min_workers}) with {world} workers: a fit keeps its global batch on "
                         f"fewer ranks only when their number divides {world} (each then reads {world} // n of the "
                         f"shards), and no such number from {min_workers} to {world - 1} does. Pass "
                         f"min_workers={max(d for d in divisors(world) if d < world)}, or leave it out")
    return int(min_workers)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def going_on_with(data_world: int, alive: int, min_workers: int) -> int:
    """How many ranks the fit goes on with: the largest divisor of ``data_world`` not above ``alive``; 0 when
    that is below ``min_workers``."""
    best = max(d for d in divisors(data_world) if d <= max(alive, 1))
    return best if best >= min_workers and alive >= 1 else 0


def reason(failed: BaseException) -> str:
    """The heal's error in a few words (the live view's line)."""
    words = str(failed.__cause__ or failed).split("; ")[0].split(". ")[0]
    return words if len(words) <= 160 else words[:157] + "..."


def go_on(recovery: RestartLedger, run: Relaunchable, lost: WorkerError, failed: ClusterError,
          event: dict[str, Any]) -> None:
    """After a heal that could not replace the lost rank: relaunch on the survivors, or fail naming min_workers.

    Raises:
        ClusterError: ``failed`` itself, when the workers are all there (the heal failed otherwise).
        WorkerError: ``lost``, noted, when fewer than ``min_workers`` could go on.
    """
    s, cfg, minimum = run.session, run.config, recovery.policy.min_workers
    assert minimum is not None, "only a fit with min_workers goes on with fewer ranks (Recovery.relaunch)"
    if s.workers is None or s.supervisor.closing:  # nbddp.stop() meanwhile: nothing to go on with
        raise failed
    before, alive = s.world_size, list(s.workers.ids)
    if len(alive) >= before:
        raise failed
    world = going_on_with(cfg.data_world, len(alive), minimum)
    if not world:
        lost.with_note(f"nbddp: no replacement for the lost rank could start ({reason(failed)}), and going on "
                       f"with the {len(alive)} worker(s) left would be below min_workers={minimum} (a fit of "
                       f"{cfg.data_world} goes on with a number of ranks that divides {cfg.data_world}). The session "
                       f"heals back to {cfg.data_world} workers before its next call")
        s.supervisor.regrow_to = cfg.data_world
        raise lost from failed
    first = cfg.grad_accum * before // cfg.data_world  # the person's grad_accum (before: on `before` ranks)
    accum = first * (cfg.data_world // world)
    s.form_group(reprobe=True, engines=alive[:world])
    run.reconfigure(dataclasses.replace(cfg, grad_accum=accum), world)
    event.update(world_size=world, grad_accum=accum, no_replacement=reason(failed))
    run.show_restart(going_line(event, cfg.data_world), replace_last=True)


def going_line(event: dict[str, Any], data_world: int, start_step: int | None = None) -> str:
    """The live view's line: what was lost, why it was not replaced, how the fit goes on (and from where)."""
    resumed = f"; resumed from step {start_step}" if start_step is not None else ""
    return (f"rank {event['rank']} lost at step {event['step_lost_at']} ({event['cause']}); no replacement could "
            f"start ({event['no_replacement']}); going on with {event['world_size']} of {data_world} ranks, "
            f"accumulating {event['grad_accum']} batches per step{resumed}")
