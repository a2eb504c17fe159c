"""A real IPython kernel driven through jupyter_client, and the processes a test must see gone.

Tests of what happens to workers when their kernel dies (``test_orphans.py``,
``test_sessions_kernel.py``) drive a kernel the way a notebook does: run a
cell, read what it printed, kill or restart the kernel. They share this one
way of doing it, so a change in how jupyter_client reports a cell's output is
fixed once.
"""

from __future__ import annotations

import json
import os
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Kernel:
    """A kernel started in the repository (``env``: extra variables), its pid known, closed by ``close()``."""

    def __init__(self, **env: str):
        from jupyter_client.manager import KernelManager

        self.km = KernelManager(kernel_name="python3")
        self.km.start_kernel(env=dict(os.environ, PYTHONPATH=ROOT, **env), cwd=ROOT)
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

    def cell(self, code: str, timeout: float = 240) -> str:
        """Execute ``code`` as a cell; what it printed (tracebacks included). A cell that fails fails the test."""
        out: list[str] = []

        def hook(msg: dict) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        text = "".join(out)
        assert reply["content"]["status"] == "ok", text
        return text

    def run(self, code: str, timeout: float = 240) -> dict | None:
        """Execute ``code``; the JSON its last ``NBDDP-OUT`` line printed (None when it printed none)."""
        lines = [l for l in self.cell(code, timeout).splitlines() if l.startswith("NBDDP-OUT")]
        return json.loads(lines[-1].split(" ", 1)[1]) if lines else None

    def close(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


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
