"""``run(..., block=False)``, ``run_cell(..., block=False)`` and ``%%ddp --noblock``: calls the cell does not wait for.

The call is launched as a blocking one is (``nbddp.execution.calls.call_on_ranks``:
one task per rank, under the session's lock, the workers held until it
ends); a thread (``nbddp-call-wait``) waits for it with the same fault
contract and turns the ranks' replies into the value: one entry per rank,
in rank order, as ipyparallel's ``AsyncResult.get()`` gives them.

What the ranks print is not written under whichever cell happens to run
then: the handle keeps it, as ``%%px --noblock`` does, and
``display_outputs()`` prints it labelled ``[rank N]`` (``stdout`` and
``stderr`` give it by rank), then shows the figures and other displays of the
ranks ``displays=`` chose.
"""

from __future__ import annotations

import threading
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Callable, cast

from nbddp.cells.rank_displays import publish
from nbddp.cells.rank_output import output_of, write
from nbddp.cells.reported_call import watch_reports
from nbddp.reports.inbox import ReportInbox
from nbddp.execution.calls import RankCall, call_on_ranks
from nbddp.execution.contracts import SessionLike
from nbddp.execution.handle import WorkHandle
from nbddp.protocol.placement import Placement
from nbddp.shipping import pickling as shipping

if TYPE_CHECKING:
    from nbddp.execution.calls import Targets
    from nbddp.fit.history import History
    from nbddp.session.session import Session

OUTPUT_WAIT_S = 2.0  # for the last output of ranks that ended (engine output comes in 0.2 s batches)


class CallHandle(WorkHandle[list[Any]]):
    """A call on the ranks in flight: a ``concurrent.futures.Future`` of each rank's value, in rank order.

    Besides what every nbddp handle offers (``nbddp/execution/handle.py``):
    ``ranks`` (those it runs on), ``stdout``/``stderr`` (rank -> what it
    printed so far), ``display_outputs()``, and ``history``: once the call
    ended, the ``History`` of what it reported (``nbddp.report``; None if
    nothing), also ``nbddp.last_history()``. A call whose code asks
    ``nbddp.should_stop()`` takes ``stop()`` at one step on every rank and
    returns its values. Stopped (``stop()``,
    ``cancel()``, Kernel > Interrupt while waiting), the ranks get
    ``KeyboardInterrupt`` as in a blocking cell and the call returns nothing.
    """

    def __init__(self, call: RankCall, reports: ReportInbox, cleanup: Callable[[], None] | None = None,
                 shown: Collection[int] | None = ()):
        """``reports``: the call's report batches, listened to since before its tasks were sent."""
        super().__init__(call, call.what)
        self._call = call
        self._reports = reports
        self._cleanup = cleanup
        self.history: History | None = None  # what the call reported (nbddp.report), once it ended
        self._shown = None if shown is None else set(shown)  # whose rich output display_outputs() shows
        self.ranks = sorted(call.tasks.ars)
        self._thread = threading.Thread(target=self.settle, args=(self._finish,), name="nbddp-call-wait", daemon=True)
        self._thread.start()

    def _finish(self) -> list[Any]:
        try:
            # what the call reports (nbddp.report) is kept as .history, with no view: this cell has moved on
            results, self.history = watch_reports(cast("Session", self._call.session), self._call, self._reports,
                                                  None, False, None)
        finally:
            if self._cleanup is not None:
                self._cleanup()
            for ar in self._call.tasks.ars.values():
                try:
                    ar.wait_for_output(OUTPUT_WAIT_S)
                except Exception:  # noqa: BLE001 - output is best effort (a dead engine's task may have none)
                    pass
        return unpacked(results)

    @property
    def stdout(self) -> dict[int, str]:
        """Rank -> what that rank's call printed on stdout so far."""
        return {rank: output_of(ar, "stdout") for rank, ar in sorted(self._call.tasks.ars.items())}

    @property
    def stderr(self) -> dict[int, str]:
        """Rank -> what that rank's call printed on stderr so far."""
        return {rank: output_of(ar, "stderr") for rank, ar in sorted(self._call.tasks.ars.items())}

    def display_outputs(self) -> None:
        """Print what every rank printed so far, labelled ``[rank N]``, rank by rank (stderr on stderr), then
        publish the rich output (figures, HTML) of the ranks ``displays=`` chose, as ipyparallel's does."""
        for kind, texts in (("stdout", self.stdout), ("stderr", self.stderr)):
            for rank, text in texts.items():
                for line in text.splitlines():
                    write(kind, f"[rank {rank}] {line}\n")
        for rank, ar in sorted(self._call.tasks.ars.items()):
            if self._shown is None or rank in self._shown:
                for content in getattr(ar, "outputs", None) or []:
                    metadata = {**(content.get("metadata") or {}), "nbddp": {"rank": rank}}
                    publish(content.get("data") or {}, metadata, content.get("transient") or None, update=False)

    def __repr__(self) -> str:
        return f"<CallHandle {self.what} on ranks {self.ranks}: {self.state()}>"


def unpacked(results: dict[int, shipping.Parcel | None]) -> list[Any]:
    """Each rank's packed value, unpacked, in rank order (None stays None); every file removed."""
    try:
        return [None if parcel is None else shipping.unpack(parcel) for _, parcel in sorted(results.items())]
    finally:
        for parcel in results.values():
            if parcel is not None:
                parcel.discard()


def start_call(session: SessionLike, what: str, fn: Callable[..., Any],
               args_for: Callable[[Placement], tuple[Any, ...]], ranks: Targets = None,
               cleanup: Callable[[], None] | None = None, shown: Collection[int] | None = ()) -> CallHandle:
    """Launch ``fn(*args_for(p))`` on ``ranks`` (each must return a ``Parcel`` or None) and hand back its handle;
    ``cleanup()`` runs once the call ended (or failed to launch); ``shown``: whose rich output
    ``display_outputs()`` publishes (None: every rank's)."""
    reports = ReportInbox()
    try:
        call = call_on_ranks(session, what, fn, args_for, ranks, listen=reports.attach)
    except BaseException:
        reports.close()
        if cleanup is not None:
            cleanup()
        raise
    return CallHandle(call, reports, cleanup, shown)
