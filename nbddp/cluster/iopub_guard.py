"""Keep the client's output channel alive whatever a worker publishes on it.

ipyparallel's client reads the engines' output (``stream``, ``status``,
``comm_*`` messages) on one ZMQ stream in its IO thread. If the handler of
one message raises, pyzmq skips re-arming the stream's edge-triggered
socket, and no later message is read: every cell's output is lost from then
on, and each call waits out ``nbddp.cells.rank_output.OUTPUT_WAIT_S`` for output that never
comes (2 s per ``nbddp.run`` instead of 15 ms; bare ``view.execute(...,
block=True)`` hangs). Measured with ipyparallel 9.2: a progress bar on a
worker (tqdm in an engine is an ipywidget, so the engine opens a comm) sent
``comm_open`` to a kernel whose shell is IPython's terminal one; the handler
asks for ``get_ipython().kernel``, which only a Jupyter kernel's shell has.

``harden(client)`` wraps the handler so that a message it cannot handle is
logged once and dropped, and every other message still arrives.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import zmq
    from ipyparallel import Client

# the client's handler of one output message, as its ZMQ stream hands it over (copy=False: frames)
Dispatch = Callable[[list["zmq.Frame"]], Any]

log = logging.getLogger("nbddp")
HARDEN_TIMEOUT_S = 10.0


def guarded(dispatch: Dispatch) -> Dispatch:
    """``dispatch`` that logs (once per kind of failure) and drops a message it raised on."""
    seen: set[str] = set()

    def dispatch_iopub(msg: list[zmq.Frame]) -> None:
        try:
            dispatch(msg)
        except Exception as exc:  # noqa: BLE001 - a raise here would stop every later message
            kind = f"{type(exc).__name__}: {exc}"
            if kind not in seen:
                seen.add(kind)
                log.warning("nbddp: dropped a worker's output message that ipyparallel could not handle (%s); "
                            "later output still arrives", kind)

    return dispatch_iopub


def harden(client: Client) -> None:
    """Make ``client``'s output stream survive a message its handler raises on (in the client's IO thread)."""
    stream = getattr(client, "_iopub_stream", None)
    loop = getattr(client, "_io_loop", None)
    if stream is None or loop is None:  # another ipyparallel: nothing we know how to wrap
        return
    done = threading.Event()

    def rewire() -> None:
        stream.on_recv(guarded(client._dispatch_iopub), copy=False)
        done.set()

    loop.add_callback(rewire)
    if not done.wait(HARDEN_TIMEOUT_S):
        log.warning("nbddp: could not guard the client's output stream within %.0f s", HARDEN_TIMEOUT_S)
