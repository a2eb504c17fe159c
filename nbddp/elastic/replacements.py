"""A lost rank on a cluster nbddp cannot start engines on (attached, SSH): wait for its launcher's replacement.

nbddp starts engines only for clusters it started itself. On a cluster it
attached to (``nbddp.start(profile=..., cluster_id=...)``: ``ipcluster`` on
SSH hosts, engines started by hand or by a service manager), a heal outside
an elastic fit says which engines to start and stops. During an elastic fit
(``dist_fit(max_restarts=...)``) the heal waits up to ``WAIT_S`` instead, for
an engine that whoever runs the cluster starts again (``ipengine
--file=<ipcontroller-...-engine.json>`` on the lost host or another one,
``systemd``'s ``Restart=``, ...); the fit then goes on from the snapshot
copy on another host (``worker/checkpoints/peer_copies.py``).
"""

from __future__ import annotations

import time

from nbddp.cluster.engines import Workers
from nbddp.protocol.errors import ClusterError

WAIT_S = 300.0  # how long an elastic fit on an attached cluster waits for a lost engine's replacement
POLL_S = 0.1


def await_replacements(workers: Workers, missing: int, want: int, timeout: float = WAIT_S) -> None:
    """Until ``want`` engines are registered (``missing`` of them new), or a ``ClusterError`` saying what to start."""
    deadline = time.monotonic() + timeout
    while len(workers.ids) < want:
        if time.monotonic() > deadline:
            raise ClusterError(
                f"{missing} engine(s) of this attached cluster died during an elastic fit (max_restarts) and no "
                f"replacement registered within {timeout:.0f} s; nbddp cannot start engines on a cluster it did not "
                f"start. Start {missing} with `ipengine --file=<ipcontroller-...-engine.json>` (or `ipcluster engines "
                f"-n {missing}`) where the lost one ran, and the fit goes on; or call nbddp.restart()"
            )
        time.sleep(POLL_S)
