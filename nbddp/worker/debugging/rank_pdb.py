"""pdb on a rank, its lines read in the notebook: ``breakpoint()`` and post-mortems.

An engine runs its task in its main thread and has no stdin, so while a fit
or a cell runs it cannot take another task, and a plain ``breakpoint()``
returns at once. Here a rank that stops opens its own line to the kernel
instead: a TCP connection to the kernel's debug listener (``nbddp.debugging.rank_lines``,
loopback on one host), authenticated by a per-session token, and runs
``pdb.Pdb`` with that connection as its stdin and stdout. One design for
both cases: a breakpoint connects from inside the running task; a
post-mortem is an ordinary task on the idle rank (``postmortem.py``)
that connects the same way, so the kernel has one conversation to hold.

The line carries newline-delimited JSON: the rank sends ``hello`` (token,
rank, where), ``out`` (pdb's output), ``ask`` (pdb waits for a command) and
``end``; the kernel sends ``line`` (a command) or ``release`` (continue now,
no prompt could open; the reason is printed).

While pdb holds the rank, its heartbeat says ``paused`` (``worker/engine/heartbeat.py``):
the kernel neither counts it nor the ranks waiting for it as stalled. ``q``
raises ``DebuggerQuit`` in the person's code (the fit ends with "debugger
quit on rank R"); ``c`` with no breakpoints set closes the line.
``PYTHONBREAKPOINT=0`` skips breakpoints, another value calls that hook, as
plain Python does.
"""

from __future__ import annotations

import json
import os
import pdb
import socket
import sys
import threading
from typing import Any

from nbddp.protocol.messages import ENGINE_FRAME
from nbddp.worker.engine.heartbeat import BEAT
from nbddp.worker.engine.rank_state import STATE

CONNECT_TIMEOUT_S = 5.0


class DebuggerQuit(Exception):
    """``q`` at a breakpoint's prompt: the rank's work ends here."""


class Channel:
    """The rank's end of one debugger conversation (newline-delimited JSON over a socket)."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.reader = sock.makefile("r", encoding="utf-8", newline="\n")
        self.closed = False

    @classmethod
    def open(cls, kind: str, where: str, function: str, summary: str = "", rank: int | None = None) -> "Channel | str":
        """Connect to the kernel and say who is here (``rank``: as named to the person); on failure, why."""
        address = STATE.debug_address
        if address is None:
            return "this worker was given no debugger address (it joined without a kernel listening)"
        host, port, token = address
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            return f"the kernel's debugger at {host}:{port} cannot be reached ({exc})"
        sock.settimeout(None)
        channel = cls(sock)
        placement = STATE.placement
        if rank is None:
            rank = placement.rank if placement else -1
        channel.send(hello=token, rank=rank, pid=os.getpid(),
                     host=placement.host if placement else "", generation=STATE.generation, kind=kind,
                     where=where, function=function, summary=summary)
        return channel

    def send(self, **message: Any) -> None:
        if self.closed:
            return
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode("utf-8"))
        except OSError:
            self.closed = True

    def receive(self) -> dict[str, Any]:
        """The kernel's next message; ``release`` when the line is gone."""
        try:
            line = self.reader.readline()
        except OSError:
            line = ""
        if not line:
            return {"release": "the kernel closed the debugger connection"}
        return json.loads(line)

    def close(self, reason: str) -> None:
        if self.closed:
            return
        self.send(end=reason)
        self.closed = True
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass


class _Out:
    """pdb's stdout: buffered, sent before each question and at the end."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.parts: list[str] = []

    def write(self, text: str) -> int:
        self.parts.append(text)
        return len(text)

    def flush(self) -> None:
        if self.parts:
            text, self.parts = "".join(self.parts), []
            self.channel.send(out=text)


class _In:
    """pdb's stdin: each line is asked of the kernel, which reads it from the notebook's input box."""

    def __init__(self, channel: Channel, out: _Out):
        self.channel, self.out = channel, out
        self.interrupted = False
        self.released = ""

    def readline(self) -> str:
        self.out.flush()
        if self.released or self.channel.closed:
            return "c\n"
        self.channel.send(ask=True)
        try:
            reply = self.channel.receive()
        except KeyboardInterrupt:  # SIGINT forwarded to a cell: continue, then raise it in the person's code
            self.interrupted = True
            return "c\n"
        if "release" in reply:
            self.released = reply["release"] or "released"
            return "c\n"
        return str(reply.get("line", "")) + "\n"


class RankPdb(pdb.Pdb):
    """pdb whose stdin and stdout are the kernel's line; ``kind`` is ``"breakpoint"`` or ``"post-mortem"``."""

    def __init__(self, channel: Channel, kind: str, where: str):
        out = _Out(channel)
        self.stdin_line = _In(channel, out)
        # typeshed asks for whole IO[str] objects; pdb (cmd.Cmd) reads stdin.readline() and writes and flushes stdout
        super().__init__(stdin=self.stdin_line, stdout=out, nosigint=True, readrc=False)  # type: ignore[arg-type]
        self.channel, self.kind, self.where = channel, kind, where
        self.quit_asked = False

    def interaction(self, frame: Any, traceback: Any) -> None:
        BEAT.pause(self.where)
        try:
            super().interaction(frame, traceback)
        finally:
            BEAT.resume()
            self.stdout.flush()
        released = self.stdin_line.released
        if self.quit_asked and self.kind == "breakpoint" and not released:
            self.finish("quit")
            rank = STATE.placement.rank if STATE.placement else "?"
            raise DebuggerQuit(f"debugger quit on rank {rank} at {self.where}")
        if self.stdin_line.interrupted:
            self.finish("interrupted")
            raise KeyboardInterrupt(f"interrupted at the debugger prompt at {self.where}")

    def setup(self, f: Any, tb: Any) -> Any:
        """pdb's stack without the engine's own frames below the task (``w``, ``u`` stop at the task)."""
        result = super().setup(f, tb)
        engine = [i for i, (frame, _) in enumerate(self.stack) if frame.f_code.co_filename.endswith(ENGINE_FRAME)]
        cut = engine[-1] + 1 if engine else 0
        if cut < len(self.stack) and self.stack[cut][0].f_code.co_filename == "<string>":
            cut += 1  # ipyparallel's one-line module that calls the task
        if 0 < cut <= self.curindex:
            self.stack, self.curindex = self.stack[cut:], self.curindex - cut
        return result

    def do_quit(self, arg: str) -> Any:
        self.quit_asked = True
        return super().do_quit(arg)

    do_q = do_exit = do_quit

    def do_EOF(self, arg: str) -> Any:
        self.quit_asked = True
        return super().do_EOF(arg)

    def set_continue(self) -> None:
        super().set_continue()
        if not self.breaks:  # nothing can stop this rank again: the conversation is over
            self.finish("continued")

    def do_interact(self, arg: str) -> None:
        self.error("interact is not available on a worker: evaluate expressions at this prompt instead")

    def do_clear(self, arg: str) -> None:
        if not arg:  # pdb would ask for confirmation with input(), which the engine cannot read
            self.clear_all_breaks()
            self.message("Deleted all breakpoints")
            return
        super().do_clear(arg)

    def finish(self, reason: str) -> None:
        self.stdout.flush()
        self.channel.close(reason)
        if getattr(STATE, "debugger", None) is self:
            STATE.debugger = None


def describe_frame(frame: Any) -> tuple[str, str]:
    """(``file:line``, function) of a frame, by the kernel's file names."""
    return f"{frame.f_code.co_filename}:{frame.f_lineno}", frame.f_code.co_name


def breakpoint_hook(*args: Any, **kwargs: Any) -> Any:
    """``sys.breakpointhook`` on a worker: pdb over the kernel's line, or a note and on."""
    setting = os.environ.get("PYTHONBREAKPOINT")
    if setting == "0":
        return None
    if setting:  # the person's own debugger hook, as plain Python calls it
        return sys.__breakpointhook__(*args, **kwargs)
    frame = sys._getframe(1)
    current = STATE.debugger
    if current is not None and not current.channel.closed:  # breakpoints set with `b` keep the line open
        current.set_trace(frame)
        return None
    where, function = describe_frame(frame)
    if threading.current_thread() is not threading.main_thread():
        _headless(where, "it was called outside the task's main thread")
        return None
    channel = Channel.open("breakpoint", where, function)
    if isinstance(channel, str):
        _headless(where, channel)
        return None
    STATE.debugger = RankPdb(channel, "breakpoint", where)
    STATE.debugger.set_trace(frame)
    return None


def _headless(where: str, why: str) -> None:
    rank = STATE.placement.rank if STATE.placement else "?"
    print(f"nbddp: breakpoint() on rank {rank} at {where}: no debugger prompt could open ({why}); continuing",
          file=sys.stderr, flush=True)


def set_address(host: str | None, port: int = 0, token: str = "") -> None:
    """Where this worker's debugger connects (the kernel calls it for every new process group)."""
    STATE.debug_address = (host, port, token) if host else None
    sys.breakpointhook = breakpoint_hook


def end_of_task() -> None:
    """A task ended: a line still open (breakpoints were set) closes, tracing stops."""
    current = STATE.debugger
    if current is not None:
        STATE.debugger = None
        current.channel.close("the task ended")
        sys.settrace(None)
