"""Which snapshot step a fit can resume from when its pieces are spread over hosts: one rule for both sides.

An elastic fit's snapshot is a set of files in a ``/dev/shm`` folder of the
same path on every host (``worker/checkpoints/peer_copies.py`` and
``worker/checkpoints/shard_copies.py``): one file for a replicated (DDP) fit, a DCP folder of
one file per rank plus ``.metadata`` and ``loop.pt`` for a sharded one. After
a lost host, or a lost Slurm job whose new nodes hold only part of it, no
host may hold a whole step, yet the hosts together may: the relaunch copies
the missing files to the hosts that lack them. The kernel (``elastic/job_loss.py``:
what survived a lost job) and the workers (the relaunch itself) must pick
the same step, so both call ``newest_covered``.

A host's *listing* is ``{step: {"path": ..., "have": [names], "needs": [names] or None}}``,
names relative to the snapshot folder: what this host holds of that step,
and every file a resume reads (known where its ``.metadata`` is; ``None``
elsewhere).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

# one host's listing: step (an int, or its str once the listing travelled as JSON) -> {"path", "have", "needs"}
Listing = Mapping[Any, dict[str, Any]]


def newest_covered(listings: Sequence[Listing]) -> int | None:
    """The newest step whose every needed file is on some host (None: no step can be put together)."""
    steps: set[int] = set()
    for listing in listings:
        steps.update(int(s) for s in listing)
    for step in sorted(steps, reverse=True):
        entries = [listing.get(step) or listing.get(str(step)) for listing in listings]
        have = {name for e in entries if e for name in e["have"]}
        needs = [set(e["needs"]) for e in entries if e and e.get("needs") is not None]
        if needs and all(n <= have for n in needs):
            return step
    return None


def path_of(listings: Sequence[Listing], step: int) -> str:
    """The snapshot's path (the same on every host) as the listings give it."""
    for listing in listings:
        entry = listing.get(step) or listing.get(str(step))
        if entry:
            return entry["path"]
    raise KeyError(f"no host lists step {step}")
