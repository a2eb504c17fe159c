"""The one owner of killing and replacing ranks.

Fits, ``%%ddp`` cells, ``run``, scripts and ``stop()`` all end broken ranks
through here, so the rules live in one place:

* ``kill(ranks)`` SIGKILLs engines by pid (no signal breaks a rank stuck in a
  gloo/NCCL collective, so nothing gentler is tried);
* ``recover(engine_ids)`` kills, then heals in the background: replaces the
  dead or killed engines and forms the group again as a new generation. A
  group that saw a failure is never reused;
* while the session is closing (``stop()``), ``recover`` only kills: a stop
  never starts engines, and a heal under way is cancelled at its next step.

The heal runs in the ``nbddp-heal`` thread holding the session's lock, so no
fit, cell or ``status()`` sees half a heal. Callers wait for it through the
session's condition, which releases the lock while waiting.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

from nbddp.cluster.engines import Workers
from nbddp.cluster.slurm.queue import JobState
from nbddp.elastic.replacements import await_replacements
from nbddp.execution.contracts import SpareLike
from nbddp.execution.send import silent_engines
from nbddp.protocol.errors import ClusterError, SlurmError
from nbddp.session.process_group import GroupState
from nbddp.session.start_options import StartOptions

PEER_SETTLE_S = 0.3  # a peer of a killed rank may go down with it; let that show before pinging
PING_TIMEOUT_S = 5.0


class HealCancelled(Exception):
    """``stop()`` was called while a heal was under way."""


class Supervised(Protocol):
    """What the supervisor reads and does of its session (``session.py``'s ``Session``, which imports this module)."""

    workers: Workers | None
    group: GroupState | None
    options: StartOptions | None
    lock: threading.RLock
    cond: threading.Condition

    @property
    def world_size(self) -> int: ...

    def form_group(self, reprobe: bool, engines: list[int] | None = None) -> None: ...


class Supervisor:
    def __init__(self, session: Supervised):
        self.session = session
        self.closing = False
        self._again = False
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.spare: SpareLike | None = None  # an elastic fit's warm spare engine (elastic/spare.py), taken by a heal
        # the last heal's phases in seconds (ping_s, spare_s, start_s, group_s) and how many engines it started
        # afresh (started: 0 when a warm spare replaced the lost rank); bench_elastic.py reports them
        self.last_heal: dict[str, float] = {}
        # an elastic fit on a cluster nbddp cannot start engines on: a heal waits this long for a replacement
        # that the cluster's own launcher starts (nbddp/elastic/replacements.py); 0: it stops with the fix
        self.await_engines_s = 0.0
        # a fit went on with fewer ranks (dist_fit(min_workers=...)): the next call's heal brings this many back
        self.regrow_to: int | None = None

    @property
    def healing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- killing ------------------------------------------------------------
    def kill_ranks(self, ranks: list[int]) -> list[int]:
        """SIGKILL these ranks' engines now; return their engine ids."""
        by_rank = self.session.group.by_rank() if self.session.group else {}
        ids = [by_rank[r].engine_id for r in ranks if r in by_rank]
        workers = self.session.workers
        if ids and workers is not None:  # (ranks are known only while there are workers)
            workers.kill(ids)
        return ids

    def replace_ranks(self, ranks: list[int]) -> None:
        """Kill these ranks' engines now and start replacing them in the background."""
        self.recover(self.kill_ranks(ranks))

    def recover(self, killed: list[int], job_wait: dict[str, Any] | None = None) -> None:
        """After any failure: the engines ``killed`` are gone; heal in the background (unless closing).

        ``job_wait``: how a new Slurm job is waited for (``Workers.add_engines``'s ``wait``): an elastic fit
        whose job was lost waits as long as the person's ``queue_timeout``, shown in its live view.
        """
        if self.closing or self.session.workers is None:
            return
        if self.healing:  # the heal under way pings every engine: it finds these dead ones too
            self._again = True
            return
        self._again = False
        self._error = None
        self._thread = threading.Thread(target=self._heal_thread, args=(list(killed), job_wait), name="nbddp-heal",
                                        daemon=True)
        self._thread.start()

    def regrow(self) -> None:
        """Start the heal back to ``regrow_to`` workers, once, after a fit that went on with fewer ranks.

        The next call waits for it; if the engines still cannot be started, it raises that heal's error
        (what to start, or ``nbddp.restart()``), and the call after it tries again.
        """
        if self.regrow_to and not self.healing and not self.closing:
            self.recover([])

    def controller_lost(self, problem: str, what: str) -> ClusterError:
        """The controller is gone, so no result can come back and no engine can be replaced.

        Kills the engines this session started (they would wait for a controller that never
        answers); returns the error to raise. ``nbddp.restart()`` starts afresh.
        """
        workers = self.session.workers
        killed = ""
        if workers is not None and workers.owned:
            workers.kill_all()
            killed = " The engines this kernel started were stopped."
        return ClusterError(f"{problem} while {what} ran, so its results cannot come back.{killed} "
                            "Run nbddp.restart() to start fresh workers (or nbddp.stop()).")

    def job_lost(self, job: JobState, what: str | None = None) -> SlurmError:
        """The Slurm job holding the engines is over (``job``: its ``nbddp.cluster.slurm.queue.JobState``).

        Its engines are gone with it, so nothing is healed: a replacement would
        be another job in the queue that nobody asked for. ``nbddp.restart()``
        submits a new one.
        """
        from nbddp.cluster.slurm.watch import ended_words

        during = f" while {what} ran" if what else ""
        return SlurmError(f"{ended_words(job)}{during}; the workers were in that job, so they are gone. "
                          "Run nbddp.restart() (%ddp restart) to submit a new job, or nbddp.stop().",
                          job.job_id, job.state)

    # ---- healing ------------------------------------------------------------
    def _heal_thread(self, killed: list[int], job_wait: dict[str, Any] | None = None) -> None:
        s = self.session
        with s.lock:
            try:
                self._heal(killed, job_wait)
                while self._again and not self.closing:  # more ranks were killed while this heal ran
                    self._again = False
                    self._heal([])
            except HealCancelled:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported at the next call
                self._error = exc
            finally:
                s.cond.notify_all()

    def _check_cancelled(self) -> None:
        if self.closing:
            raise HealCancelled()

    def _heal(self, killed: list[int], job_wait: dict[str, Any] | None = None) -> None:
        """Replace ``killed`` engines and dead or unresponsive ones; form the group again."""
        s = self.session
        workers, options = s.workers, s.options
        assert workers is not None and options is not None, "a heal runs only on started workers (stop() cancels it)"
        want = max(s.world_size, self.regrow_to or 0) or (options.n or 2)
        lap = _Laps()
        workers.forget_dead(killed)
        if killed:
            time.sleep(PEER_SETTLE_S)
        unresponsive = silent_engines(workers.client, workers.ids, PING_TIMEOUT_S)  # dead or stuck: replaced
        alive = [eid for eid in workers.ids if eid not in unresponsive]
        extra = sorted(alive)[want:]  # keep the world size stable
        if unresponsive or extra:
            workers.kill(unresponsive + extra)
            workers.forget_dead(unresponsive + extra)
        self._check_cancelled()
        lap("ping_s")
        missing = want - len(workers.ids)
        to_start = missing
        if missing > 0 and self.spare is not None and self.spare.take() is not None:
            to_start -= 1  # the warm spare is a rank from now on
        lap("spare_s")
        if to_start > 0 and not workers.can_add_engines and self.await_engines_s:
            await_replacements(workers, to_start, want, self.await_engines_s)
        elif to_start > 0:
            workers.add_engines(to_start, want, wait=job_wait)
        lap("start_s", started=max(0, to_start))
        self._check_cancelled()
        s.form_group(reprobe=bool(killed or unresponsive or missing))
        self.regrow_to = None
        lap("group_s")
        self.last_heal = lap.phases

    def wait(self, raise_error: bool) -> None:
        """Wait for a heal under way (callers must not hold the session's lock)."""
        thread = self._thread
        if thread is not None:
            thread.join()
        if self.closing and self.spare is not None:  # a spare on its way stops at its next step
            self.spare.wait()
        self.raise_if_failed(raise_error)

    def raise_if_failed(self, raise_error: bool = True) -> None:
        error, self._error = self._error, None
        if error is not None and raise_error:
            raise ClusterError(
                f"replacing failed workers did not work: {type(error).__name__}: {error}. "
                "Run nbddp.restart() to start a fresh set."
            ) from error


class _Laps:
    """A heal's phases in seconds, each from the end of the one before (``Supervisor.last_heal``)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.monotonic()

    def __call__(self, name: str, **counts: int) -> None:
        now = time.monotonic()
        self.phases[name] = now - self._last
        self.phases.update(counts)
        self._last = now
