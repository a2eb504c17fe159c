"""The kernel's answers and profile requests through torch.distributed's own store, across hosts.

On one host the kernel hands rank 0 a synchronous callback's answer
(``epoch_answer.py``) or ``handle.profile``'s request (``profile_spec.py``)
in a small owner-only file in ``/dev/shm``. A rank 0 on another host (SSH,
MPI, Slurm: there the kernel is on the login node) cannot see that file,
but across hosts every rank already meets at the ``TCPStore`` rank 0
listens on (``tcp://master:port``, ``session/process_group.py``). The kernel
connects to it as one more client (``KernelStore``) and sets a key; rank 0
waits on the same key in its default group's store (``rank_store``): a
blocking wait, no polling (``fit/rank0_store.py`` says when each is used).

Keys name the fit (a token the kernel draws per fit, in
``FitLaunch.channel``), the group's generation and the point (the record's
index), so an answer is never taken for another fit, another launch or
another point; rank 0 deletes a key once it took it.
"""

from __future__ import annotations

import json
import threading
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store

#: how long the kernel tries to reach rank 0's store before it gives up (and the fit falls back to the file's
#: behaviour, with a notice): the kernel never hangs on a store it cannot reach
CONNECT_TIMEOUT_S = 5.0


def answer_key(channel: str, generation: int, seq: int) -> str:
    """The key of the kernel's answer to record ``seq`` of fit ``channel`` in group ``generation``."""
    return f"nbddp/{channel}/g{generation}/answer/{seq}"


def asked_key(channel: str) -> str:
    """The counter of fit ``channel``'s ``handle.profile`` requests: the latest request's id (``store.add``)."""
    return f"nbddp/{channel}/profile-asked"


def request_key(channel: str, request: int) -> str:
    """The key of fit ``channel``'s request ``request`` (``{"id": n, "steps": k}``), set before the counter moves."""
    return f"nbddp/{channel}/profile/{request}"


def dumps(value: dict[str, Any]) -> str:
    return json.dumps(value)


def loads(raw: bytes) -> Any:
    """A value the kernel set (None: not a JSON object, e.g. half of something else's key)."""
    try:
        data = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) else None


class KernelStore:
    """The kernel's client of rank 0's ``TCPStore`` (one group generation's: ``host:port``).

    ``connect`` raises ``OSError`` naming the address when the store does not
    answer within ``timeout_s``; the callers fall back and say why.
    """

    def __init__(self, host: str, port: int, generation: int, timeout_s: float = CONNECT_TIMEOUT_S):
        self.host, self.port, self.generation, self.timeout_s = host, port, generation, timeout_s
        self.lock = threading.Lock()  # the hooks thread (answers) and a cell (handle.profile) share the client
        self.store = self._connect()

    def _connect(self) -> Any:
        import torch.distributed as dist

        try:
            return dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                 timeout=timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - torch raises RuntimeError/DistNetworkError/TimeoutError alike
            raise OSError(f"rank 0's torch.distributed store at {self.host}:{self.port} did not answer within "
                          f"{self.timeout_s:.0f} s ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                          ) from e

    def set(self, key: str, value: dict[str, Any]) -> None:
        with self.lock:
            self.store.set(key, dumps(value))

    def ask(self, channel: str, request: int, value: dict[str, Any]) -> None:
        """Set profile request ``request`` of fit ``channel``, then move the counter rank 0 reads to it."""
        with self.lock:
            self.store.set(request_key(channel, request), dumps(value))
            self.store.add(asked_key(channel), request - int(self.store.add(asked_key(channel), 0)))

    def delete(self, key: str) -> None:
        """Remove ``key`` if it is still there (best effort: the group may be gone with its store)."""
        with self.lock:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - a store that went away has no key left to remove
                pass


def rank_store() -> Store:
    """This rank's view of the group's store, without torch's own ``default_pg`` prefix (the kernel's keys are
    set on the bare ``TCPStore``)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


def wait_value(store: Store, key: str, timeout_s: float) -> dict[str, Any] | None:
    """Rank 0: block until the kernel sets ``key``, take its value and delete it; None after ``timeout_s``."""
    try:
        store.wait([key], timedelta(seconds=timeout_s))
    except Exception:  # noqa: BLE001 - torch's timeout (DistStoreError), or the store gone: no answer
        return None
    value = loads(store.get(key))
    store.delete_key(key)
    return value


def newest_request(store: Store, channel: str, seen: int) -> dict[str, Any] | None:
    """Rank 0, at a reduction: fit ``channel``'s newest profile request if its id is above ``seen``, taken (its key
    deleted); else None.

    One round trip when nothing is asked (``add(counter, 0)`` reads the counter and never waits). The
    kernel sets the request's key before it moves the counter and removes none while the fit runs, so the
    ``check`` before ``get`` keeps ``get`` (which waits for a missing key) from ever waiting: a request
    already taken (a relaunched rank 0 counts from 0 again) is passed over.
    """
    newest = int(store.add(asked_key(channel), 0))
    if newest <= seen:
        return None
    key = request_key(channel, newest)
    if not store.check([key]):
        return None
    value = loads(store.get(key))
    store.delete_key(key)
    return value
