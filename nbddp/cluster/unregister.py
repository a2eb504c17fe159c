"""Tell the controller that engines are gone, instead of waiting for it to notice.

ipyparallel's controller unregisters an engine on its own after ten missed heartbeats (10 s at
nbddp's 1 s period). When nbddp already knows an engine is dead (its Slurm job ended, or nbddp
killed it), that wait is pure loss: a lost Slurm job's recovery spent about 10 s of its 31-36 s
in it. The controller takes the same ``unregistration_request`` an engine sends when it shuts
down cleanly; the client lists the engine as gone once the controller's notification arrives,
and tasks still outstanding on it fail after the controller's registration timeout, as for an
engine that missed its heartbeats.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ipyparallel import Client

FLUSH_MS = 1000  # how long closing the socket may wait for the requests to leave


def unregister(client: Client, endpoint: tuple[str, int | None], engine_ids: list[int]) -> bool:
    """Ask the controller at ``endpoint`` (host, registration port) to unregister ``engine_ids`` now.

    False where it cannot be asked (no port known). A socket of its own, not the client's query
    socket: that one belongs to the thread that made the client, and a heal runs on another. Where
    the port cannot be reached from here (a controller behind an SSH tunnel), the requests are
    dropped when the socket closes, within ``FLUSH_MS``, and the heartbeats drop the engines 10 s later.
    """
    import zmq

    host, port = endpoint
    if not engine_ids or port is None:
        return False
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    try:
        if client.curve_serverkey:
            sock.curve_serverkey = client.curve_serverkey
            sock.curve_secretkey = client.curve_secretkey
            sock.curve_publickey = client.curve_publickey
        sock.connect(f"tcp://{host}:{port}")
        for eid in engine_ids:
            client.session.send(sock, "unregistration_request", content={"id": int(eid)})
    finally:
        sock.close(linger=FLUSH_MS)
    return True
