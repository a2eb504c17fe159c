"""As many forwards on every rank, when the model's forward is collective; the stop agreed before each.

A kept FSDP model all-gathers its parameters in every forward, a pipeline's
stages send activations to each other, a tensor-parallel layer all-reduces:
a rank that ran one forward fewer than its peers would leave them waiting
for ever. So before each batch every rank says, in one tiny all-reduce
(``batch_agreement.Agreement``), whether it has a batch, whether it was asked
to stop, or whether reading its data failed:

* while any rank has a batch, every rank runs a forward; a rank whose
  share has ended runs a dummy one (its last batch again, or the dataset's
  first sample when its block is empty) and drops the output. This is how
  the fit ends a stream (``worker/data/batch_agreement.py``), and it makes
  streams work here too: their ends differ by rank and are known only when
  they come;
* a stop asked on any rank (Kernel > Interrupt) stops every rank at the
  same batch;
* a rank whose data failed raises its error; the others raise
  ``PeerFailed`` instead of waiting in a forward that rank never joins.

A stream whose share is empty on some rank from the start has no batch to
run there, dummy or not: that is an error on every rank at once, naming it.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from nbddp.worker.data.batch_agreement import FAILED, HAVE, NONE, Agreement, PeerFailed
from nbddp.worker.engine.rank_state import STATE

STOP = 4  # added to a rank's slot when it was asked to stop (never with FAILED, which must be read as such)


class EmptyStreamShare(ValueError):
    """A rank's share of a stream holds no sample, and the model's forward needs every rank."""


def lockstep(loader: Any, dummy: Callable[[], Any] | None, what: str) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` pairs, as many on every rank; ``dummy()`` gives a batch to a rank with none yet
    (``None``: a stream, where a rank with no batch at the start is an error)."""
    p = STATE.placement
    agreement = Agreement(p.rank, p.world_size)
    local, last, started = iter(loader), None, False
    try:
        while True:
            batch, state, error = None, NONE, None
            try:
                batch = next(local, None)
                state = HAVE if batch is not None else NONE
            except Exception as exc:  # noqa: BLE001 - told to the others first, then raised on this rank
                error, state = exc, FAILED
            if state != FAILED and STATE.stop_requested:
                state += STOP
            states = agreement.wait(agreement.launch(state))  # PeerFailed where another rank failed
            if error is not None:
                raise error
            if any(s >= STOP for s in states):
                STATE.stop_requested = True
                return
            have = [s == HAVE for s in states]
            if not any(have):
                return
            if not started and not all(have):
                empty = [r for r, h in enumerate(have) if not h]
                if dummy is None:
                    raise _empty(empty, have, what) if p.rank in empty else \
                        PeerFailed(f"rank {', '.join(map(str, empty))} has no sample of the stream")
            started = True
            if batch is not None:
                last = batch
                yield batch, True
            else:
                if last is None and dummy is not None:  # (without a dummy, every rank had a first batch)
                    last = dummy()
                yield last, False
    finally:
        agreement.close()


def _empty(empty: list[int], have: list[bool], what: str) -> EmptyStreamShare:
    return EmptyStreamShare(
        f"{what}: rank {', '.join(map(str, empty))} got no sample of the stream, while rank "
        f"{', '.join(str(r) for r, h in enumerate(have) if h)} did. This model's forward runs on every rank together "
        "(a kept FSDP, pipeline or tensor-parallel model), and a rank whose share is empty has nothing to run. Rank r "
        "of N reads samples r, r + N, ...: give the stream at least as many samples as there are ranks (or data "
        "parallel copies), or predict with the notebook's model")
