"""A real IPython kernel driven through jupyter_client, and the processes a test must see gone.

Every test that drives a kernel the way a notebook does (run a cell, read what
it showed, answer its prompts, interrupt, kill or restart it) goes through
``Kernel``: ``test_orphans.py``, ``test_sessions_kernel.py``,
``test_debug_kernel.py``, ``test_handles_kernel.py``, ``test_packaging.py``
and the Slurm login node (``slurm_cluster.py``). A change in how
jupyter_client reports a cell is fixed here once.

A value a test needs from the kernel (pids, figures) travels in the
``execute_reply`` (a cell calls ``out(value)`` of ``HELPERS``, read back as a user
expression),
not in printed text: ipykernel sends a cell's stream output on another socket
than its reply, and on a loaded machine a line printed last can arrive after
the reply and the idle status that end the wait (ipykernel's own
``kernelbase.py`` says so, "on rare occasions, the flush doesn't seem to make
it to the clients"). The suite's CI lost a run to that once.
"""

from __future__ import annotations

import ast
import glob
import json
import os
import queue
import re
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# the value a cell set as NBDDP_OUT, as JSON; popped, so a cell that sets none gives None
_OUT = "__import__('json').dumps(globals().pop('NBDDP_OUT', None))"

HELPERS = '''
def session_pids():
    """Every process of this kernel's nbddp session: engines, controller, reaper and their children."""
    import psutil
    from nbddp.session.session import get_session
    s = get_session()
    pids = set(s.workers.all_pids()) | {p.pid for p in s.placements} | {s.workers.reaper.pid}
    for pid in list(pids):
        try:
            pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.Error:  # (a killed engine's launcher is listed until the next heal forgets it)
            pass
    return sorted(pids)

def out(value):
    """Hand ``value`` to the test: as NBDDP_OUT in a kernel (Kernel.run), as a printed line in a plain process."""
    import json
    global NBDDP_OUT
    NBDDP_OUT = value
    print("NBDDP-OUT", json.dumps(value), flush=True)
'''
"""Kernel code for a test's cells: ``session_pids()``, what must end with the session; ``out(value)``."""

SESSION = HELPERS + """
from nbddp.session.session import get_session
out([get_session().file_prefix, session_pids()])
"""
"""A cell giving ``[prefix, pids]`` of the kernel's session: what ``none_left`` checks."""


@dataclass
class Reply:
    """What one cell did, as a notebook shows it.

    ``text``: its streams, the text of its displays, its traceback (no colour codes) and the prompts it asked with
    the lines answered, in order. ``displays``: every display's data (``display_data``, ``update_display_data``,
    ``execute_result``). ``messages``: every IOPub message that arrived while it ran, its own or an earlier cell's
    (a task that cell left running). ``value``: what it gave ``out()`` (``HELPERS``).
    """

    msg_id: str
    status: str = ""
    text: str = ""
    displays: list[dict] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    value: Any = None
    ename: str = ""
    evalue: str = ""
    seconds: float = 0.0

    def take(self, msg: dict) -> None:
        """Add one IOPub message; only the cell's own count towards its text and displays."""
        self.messages.append(msg)
        if msg["parent_header"].get("msg_id") != self.msg_id:
            return
        kind, content = msg["header"]["msg_type"], msg["content"]
        if kind == "stream":
            self.text += content["text"]
        elif kind == "error":
            self.text += ANSI.sub("", "\n".join(content["traceback"])) + "\n"
        elif kind in ("display_data", "update_display_data", "execute_result"):
            self.displays.append(content["data"])
            self.text += content["data"].get("text/plain", "") + "\n"

    @property
    def shown(self) -> list[str]:
        """The plain text of each display, in order."""
        return [d.get("text/plain", "") for d in self.displays]


def streamed(messages: list[dict]) -> str:
    """The stream text of ``messages``, whichever cell printed it."""
    return "".join(m["content"]["text"] for m in messages if m["header"]["msg_type"] == "stream")


class Kernel:
    """A started kernel, ready for cells; ``close()`` shuts it down.

    ``env``: its whole environment (default: this process's, with the repository on ``PYTHONPATH``), ``extra``
    added to it. ``marked=False`` leaves out the suite's run marker (``conftest.RUN_MARKER``): a kernel whose
    workers outlive one test, or belong to a login node, is checked by its test, not by the per-test leak check.
    ``argv`` with ``spec_dir``: a kernelspec of its own there (another Python, a command in a namespace).
    ``ipc_dir``: unix sockets there instead of TCP (a kernel in a network namespace).
    """

    def __init__(self, *, env: dict[str, str] | None = None, cwd: str | Path = ROOT, marked: bool = True,
                 argv: list[str] | None = None, spec_dir: str | Path | None = None,
                 ipc_dir: str | Path | None = None, **extra: str):
        from jupyter_client.kernelspec import KernelSpecManager
        from jupyter_client.manager import KernelManager

        from conftest import RUN_MARKER

        base = dict(os.environ, PYTHONPATH=ROOT) if env is None else dict(env)
        if not marked:
            base.pop(RUN_MARKER, None)
        options: dict[str, Any] = {"kernel_name": "python3"}
        if argv is not None:
            if spec_dir is None:
                raise ValueError("a kernel with its own argv needs spec_dir, a folder for its kernelspec")
            spec = Path(spec_dir) / "kernels" / "nbddp-test"
            spec.mkdir(parents=True, exist_ok=True)
            (spec / "kernel.json").write_text(json.dumps({"argv": argv, "display_name": "nbddp test",
                                                          "language": "python"}))
            options = {"kernel_name": "nbddp-test",
                       "kernel_spec_manager": KernelSpecManager(kernel_dirs=[str(spec.parent)])}
        if ipc_dir is not None:
            options["transport"] = "ipc"
        self.km = KernelManager(**options)
        if ipc_dir is not None:
            self.km.ip = str(ipc_dir)
        self.km.start_kernel(env={**base, **extra}, cwd=str(cwd))
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=120)
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def is_alive(self) -> bool:
        return self.km.is_alive()

    def send(self, code: str, allow_stdin: bool = False) -> str:
        """Start ``code`` as a cell without waiting for it (``finish`` waits); its message id."""
        return self.kc.execute(code, allow_stdin=allow_stdin, user_expressions={"out": _OUT})

    def finish(self, msg_id: str, timeout: float = 240, on_output: Callable[[dict, Reply], None] | None = None,
               answer: Callable[[str, Reply], str | None] | None = None) -> Reply:
        """Wait for the cell ``msg_id``: its reply and its idle status (every output it sent comes before that).

        ``on_output(msg, reply)`` sees each IOPub message as it arrives. ``answer(prompt, reply)`` answers each
        input request with a line (``None``: no answer, as when the test interrupts instead).
        """
        reply = Reply(msg_id)
        t0 = time.monotonic()
        replied = idle = False

        def take(msg: dict) -> None:
            nonlocal idle
            reply.take(msg)
            if on_output is not None:
                on_output(msg, reply)
            idle = idle or (msg["header"]["msg_type"] == "status" and msg["content"]["execution_state"] == "idle"
                            and msg["parent_header"].get("msg_id") == msg_id)

        while not (replied and idle):
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(f"the cell gave no reply within {timeout} s; it showed:\n{reply.text[-3000:]}")
            try:
                take(self.kc.iopub_channel.get_msg(timeout=0.05))
            except queue.Empty:
                pass
            if answer is not None:
                try:
                    request = self.kc.stdin_channel.get_msg(timeout=0)
                except queue.Empty:
                    pass
                else:
                    while True:  # what the cell printed before asking comes first
                        try:
                            take(self.kc.iopub_channel.get_msg(timeout=0.3))
                        except queue.Empty:
                            break
                    prompt = request["content"]["prompt"]
                    line = answer(prompt, reply)
                    if line is not None:
                        reply.text += f"{prompt}{line}\n"
                        self.kc.input(line)
            try:
                msg = self.kc.shell_channel.get_msg(timeout=0)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                replied = True
                content = msg["content"]
                reply.status = content["status"]
                reply.ename, reply.evalue = content.get("ename", ""), content.get("evalue", "")
                out = content.get("user_expressions", {}).get("out", {})
                if out.get("status") == "ok":
                    reply.value = json.loads(ast.literal_eval(out["data"]["text/plain"]))
        reply.seconds = time.monotonic() - t0
        return reply

    def execute(self, code: str, timeout: float = 240, on_output: Callable[[dict, Reply], None] | None = None,
                answer: Callable[[str, Reply], str | None] | None = None) -> Reply:
        """Run ``code`` as a cell and wait for it (``finish``); a cell that fails is a Reply, not an error."""
        return self.finish(self.send(code, allow_stdin=answer is not None), timeout, on_output, answer)

    def cell(self, code: str, timeout: float = 240) -> Reply:
        """Run ``code`` as a cell that must succeed (its traceback is the failure's message)."""
        reply = self.execute(code, timeout)
        assert reply.status == "ok", reply.text
        return reply

    def run(self, code: str, timeout: float = 240) -> Any:
        """Run ``code`` as a cell that must succeed; the value it gave ``out()`` (None when it gave none)."""
        return self.cell(code, timeout).value

    def interrupt(self) -> None:
        """Kernel > Interrupt (SIGINT to the kernel process)."""
        self.km.interrupt_kernel()

    def kill(self) -> None:
        """SIGKILL the kernel: no clean exit, as when it crashes."""
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.kc.stop_channels()
        try:
            self.km.shutdown_kernel(now=True)
        except Exception:  # noqa: BLE001 - already gone (killed by the test): nothing left to shut down
            pass


def alive(pids: list[int]) -> list[int]:
    """The processes of ``pids`` still running (a zombie is not)."""
    running = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                running.append(pid)
        except psutil.Error:
            pass
    return running


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait up to ``timeout`` s for every process of ``pids`` to end; those still running."""
    deadline = time.monotonic() + timeout
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive(pids)


def described(pids: list[int]) -> list[str]:
    """``pid: command`` of each running process of ``pids`` (what a failure message names)."""
    out = []
    for pid in alive(pids):
        try:
            out.append(f"{pid}: {' '.join(psutil.Process(pid).cmdline()[:3])}")
        except psutil.Error:
            pass
    return out


def kill(pids: list[int]) -> None:
    """SIGKILL what is left of ``pids`` (the test started them; never by name)."""
    for pid in alive(pids):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def none_left(pids: list[int], prefix: str | None, timeout: float = 20.0) -> None:
    """No process of the kernel's workers, and no shared-memory file of its session, outlives it."""
    left = wait_gone(pids, timeout)
    named = described(left)
    kill(left)
    assert not left, f"the kernel's worker processes outlived it: {named or left}"
    deadline = time.monotonic() + 5
    files = glob.glob(f"/dev/shm/{prefix}*") if prefix else []
    while files and time.monotonic() < deadline:
        time.sleep(0.1)
        files = glob.glob(f"/dev/shm/{prefix}*")
    for path in files:
        os.unlink(path)
    assert not files, f"the kernel's shared-memory files outlived it: {files}"
