"""The kernel's end of the ranks' debugger lines: one listener, one ``RankLine`` per rank in pdb.

A rank that stops in pdb (``worker/debugging/rank_pdb.py``: a ``breakpoint()``, or a
post-mortem task) connects here and says who it is; from then on its pdb
reads and writes through that connection. The board is polled, never
threaded: the cell that waits for the work (``waiting``, ``jobs``), the fit's
watcher thread and ``nbddp.debug`` call ``poll()``, which accepts, checks
the token and reads what arrived, in microseconds when nothing did.

Security: on one host the listener binds ``127.0.0.1`` only (no new
non-loopback listener: ``tests/test_security.py``); with ranks on other
hosts it binds the controller's address, the one the workers already reach
(``docs/multi-node.md``). Either way a connection must present the
session's random token in its first line within ``HELLO_TIMEOUT_S``, or it
is closed.
"""

from __future__ import annotations

import hmac
import json
import secrets
import select
import socket
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from nbddp.shipping.source_lines import describe_where
from nbddp.execution.contracts import WorkLike
from nbddp.execution.send import on_engines
from nbddp.protocol.placement import Placement

if TYPE_CHECKING:
    from ipyparallel import Client

HELLO_TIMEOUT_S = 2.0


class RankLine:
    """One rank in pdb, as the kernel sees it: who, where, what it said, whether it waits for a command."""

    def __init__(self, sock: socket.socket, hello: dict[str, Any]):
        self.sock = sock
        self.rank = int(hello.get("rank", -1))
        self.pid = int(hello.get("pid", 0))
        self.host = str(hello.get("host", ""))
        self.kind = str(hello.get("kind", "breakpoint"))
        self.where = str(hello.get("where", "?"))
        self.function = str(hello.get("function", ""))
        self.summary = str(hello.get("summary", ""))
        self.generation = int(hello.get("generation", -1))
        self.since = time.monotonic()
        self.output: list[str] = []
        self.asked = False
        self.ended = ""  # why the line closed ("" while open)
        self._buf = b""
        self.lock = threading.RLock()  # one reader at a time: the conversation, or a poll from the watcher

    def pump(self, timeout: float = 0.0) -> bool:
        """Read what arrived (waiting up to ``timeout``); False once the line closed."""
        with self.lock:
            return self._pump(timeout)

    def _pump(self, timeout: float) -> bool:
        if self.ended:
            return False
        try:
            ready, _, _ = select.select([self.sock], [], [], timeout)
            if not ready:
                return True
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._end("the rank's debugger connection closed")
            return False
        self._buf += data
        self.drain()
        return not self.ended

    def drain(self) -> None:
        """Take every complete message in the buffer."""
        while b"\n" in self._buf and not self.ended:
            line, self._buf = self._buf.split(b"\n", 1)
            try:
                message = json.loads(line.decode("utf-8"))
            except ValueError:
                self._end("the rank sent something that is not a debugger message")
                return
            if isinstance(message, dict):
                self._take(message)

    def _take(self, message: dict[str, Any]) -> None:
        if "out" in message:
            self.output.append(str(message["out"]))
        if message.get("ask"):
            self.asked = True
        if "end" in message:
            self._end(str(message["end"]))

    def _end(self, reason: str) -> None:
        self.ended = reason or "ended"
        self.asked = False
        try:
            self.sock.close()
        except OSError:
            pass

    def wait_ask(self, timeout: float | None = None) -> bool:
        """Until pdb asks for a command (True) or the line closes (False); ``timeout``: False when it passed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.asked:
            if not self.pump(0.05):
                return False
            if deadline is not None and time.monotonic() > deadline:
                return False
        return True

    def take_output(self) -> str:
        text, self.output = "".join(self.output), []
        return text

    def _send(self, **message: Any) -> None:
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode("utf-8"))
        except OSError:
            self._end("the rank's debugger connection closed")

    def send_line(self, line: str) -> None:
        """One command for pdb (it must be waiting for one)."""
        self.asked = False
        self._send(line=line)

    def release(self, reason: str) -> None:
        """Let the rank go on without a prompt (it prints ``reason``)."""
        if not self.ended:
            self.asked = False
            self._send(release=reason)

    def describe(self) -> str:
        what = "paused at breakpoint()" if self.kind == "breakpoint" else f"failed: {self.summary}"
        return (f"rank {self.rank} (pid {self.pid}): {what} at {describe_where(self.where)}"
                + (f" in {self.function}" if self.function else ""))


class DebugBoard:
    """The listener, and the ranks now in pdb (by rank); ``current()`` is the work that holds the workers."""

    def __init__(self, current: Callable[[], WorkLike | None] = lambda: None) -> None:
        self.token = secrets.token_hex(16)
        self.current = current
        self.listener: socket.socket | None = None
        self.lines: dict[int, RankLine] = {}
        self.auto_release: tuple[WorkLike, str] | None = None  # (work, reason): breakpoints of that work go on at once
        self.notes: list[RankLine] = []  # ranks let go by auto_release, to be reported by the waiting cell
        self._pending: list[tuple[socket.socket, float, bytes]] = []
        self._lock = threading.RLock()

    def announce(self, client: Client, placements: list[Placement], controller_host: str) -> None:
        """Tell every rank where to connect (after each new process group): loopback unless ranks are remote."""
        from nbddp.worker.tasks.debugging import set_debugger_address as set_address

        address = self.address(controller_host) if any(not p.local for p in placements) else None
        if address is None:  # one host (or the controller's address is not this machine's): loopback only
            address = self.address("127.0.0.1")
        reach = [p.engine_id for p in placements if p.local or (address and address[0] != "127.0.0.1")]
        unreached = [p.engine_id for p in placements if p.engine_id not in reach]  # they say "no prompt could open"
        try:
            if reach and address is not None:
                on_engines(client, reach, set_address, *address)
            if unreached:
                on_engines(client, unreached, set_address, None)
        except Exception:  # noqa: BLE001 - an engine lost right after joining: the next call's fault path tells
            pass

    def address(self, host: str) -> tuple[str, int, str] | None:
        """(host, port, token) for the workers; the listener opens on first use (None: cannot bind ``host``)."""
        with self._lock:
            if self.listener is not None and self.listener.getsockname()[0] != host:
                self.close()
            if self.listener is None:
                try:
                    sock = socket.create_server((host, 0), backlog=64)
                except OSError:
                    return None
                sock.setblocking(False)
                self.listener = sock
            return host, self.listener.getsockname()[1], self.token

    def close(self) -> None:
        """Stop listening; every rank still in pdb is let go."""
        with self._lock:
            for line in self.lines.values():
                line.release("the workers are stopping")
                line._end("closed")
            self.lines.clear()
            for sock, _, _ in self._pending:
                sock.close()
            self._pending.clear()
            if self.listener is not None:
                self.listener.close()
                self.listener = None

    def poll(self) -> list[RankLine]:
        """Accept and read what arrived; return the ranks in pdb, by rank."""
        with self._lock:
            self._accept()
            self._read_hellos()
            for rank, line in list(self.lines.items()):
                if line.lock.acquire(blocking=False):  # else the conversation is reading it right now
                    try:
                        line.pump(0.0)
                    finally:
                        line.lock.release()
                if line.ended:
                    del self.lines[rank]
            return [self.lines[r] for r in sorted(self.lines)]

    def _accept(self) -> None:
        if self.listener is None:
            return
        while True:
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, OSError):
                return
            sock.setblocking(True)
            self._pending.append((sock, time.monotonic() + HELLO_TIMEOUT_S, b""))

    def _read_hellos(self) -> None:
        waiting = []
        for sock, deadline, buf in self._pending:
            try:
                ready, _, _ = select.select([sock], [], [], 0)
                chunk = sock.recv(65536) if ready else b""
            except OSError:
                chunk, ready = b"", [sock]
            if ready and not chunk:
                sock.close()
                continue
            buf += chunk
            if b"\n" not in buf:
                if time.monotonic() < deadline and len(buf) < 65536:
                    waiting.append((sock, deadline, buf))
                else:
                    sock.close()
                continue
            first, rest = buf.split(b"\n", 1)
            self._admit(sock, first, rest)
        self._pending = waiting

    def _admit(self, sock: socket.socket, first: bytes, rest: bytes) -> None:
        try:
            hello = json.loads(first.decode("utf-8"))
        except ValueError:
            hello = {}
        if not isinstance(hello, dict) or not hmac.compare_digest(str(hello.get("hello", "")), self.token):
            sock.close()  # not one of our ranks
            return
        try:
            line = RankLine(sock, hello)
        except (TypeError, ValueError):  # a hello with the token but not from this version of nbddp
            sock.close()
            return
        line._buf = rest
        line.drain()
        old = self.lines.get(line.rank)
        if old is not None and old.pid == line.pid:
            old._end("replaced")
        self.lines[line.rank] = line
        release = self.auto_release
        if release is not None and line.kind == "breakpoint" and release[0] is self.current():
            line.release(release[1])
            self.notes.append(line)

    def let_go(self, work: WorkLike, reason: str) -> None:
        """``work`` is stopping: its paused ranks go on, and so does any breakpoint it reaches later."""
        self.auto_release = (work, reason)
        self.release(reason, kind="breakpoint")

    def release(self, reason: str, kind: str | None = None) -> list[int]:
        """Let every rank in pdb (of ``kind``) go on; the ranks released."""
        with self._lock:
            released = []
            for rank, line in self.lines.items():
                if kind is None or line.kind == kind:
                    line.release(reason)
                    released.append(rank)
            return released

    def paused(self) -> list[dict[str, Any]]:
        """The ranks paused at a breakpoint, for the live view and the stall guard."""
        return [{"rank": line.rank, "where": describe_where(line.where), "function": line.function,
                 "since": line.since} for line in self.poll() if line.kind == "breakpoint"]

    def take_notes(self) -> list[RankLine]:
        with self._lock:
            notes, self.notes = self.notes, []
            return notes
