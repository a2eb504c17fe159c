"""No orphans (issue 4, row 4): a real Jupyter kernel starts workers, then dies or restarts.

Every engine, nanny, controller and reaper it started must be gone within
15 s: the kernel cannot clean up after a SIGKILL, so this is the engines'
kernel watchdog and the reaper process at work.
"""

from __future__ import annotations

import json
import os
import signal
import time

import psutil
import pytest

pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_workers, pytest.mark.faults, pytest.mark.notebook]

START = """
import json, psutil, nbddp
from nbddp.session.session import get_session
nbddp.start(n=2, backend="gloo")
s = get_session()
pids = set(s.workers.all_pids()) | {p.pid for p in s.placements} | {s.workers.reaper.pid}
for pid in list(pids):
    pids |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
print("NBDDP-PIDS", json.dumps(sorted(pids)))
"""


def _start_workers_in(kc) -> list[int]:
    out: list[str] = []

    def hook(msg):
        if msg["msg_type"] == "stream":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            out.append("\n".join(msg["content"]["traceback"]))

    reply = kc.execute_interactive(START, timeout=180, output_hook=hook)
    text = "".join(out)
    assert reply["content"]["status"] == "ok", text
    line = next(l for l in text.splitlines() if l.startswith("NBDDP-PIDS"))
    pids = json.loads(line.split(" ", 1)[1])
    assert len(pids) >= 4, pids  # 2 engines, a controller, the reaper (and nannies)
    return pids


def _wait_gone(pids: list[int], timeout: float) -> tuple[float, list[str]]:
    t0 = time.monotonic()
    while True:
        alive = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{pid}: {' '.join(p.cmdline()[:3])}")
            except psutil.Error:
                pass
        if not alive or time.monotonic() - t0 > timeout:
            return time.monotonic() - t0, alive
        time.sleep(0.1)


def _kill_leftovers(pids: list[int]) -> None:
    for pid in pids:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


@pytest.mark.parametrize("how", ["SIGKILL", "restart"])
def test_workers_do_not_outlive_their_kernel(how):
    from faultkit import record_time
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    km.start_kernel(env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    kc = km.client()
    kc.start_channels()
    pids: list[int] = []
    try:
        kc.wait_for_ready(timeout=120)
        pids = _start_workers_in(kc)
        kernel_pid = km.provisioner.process.pid
        assert kernel_pid not in pids
        t0 = time.monotonic()
        if how == "SIGKILL":
            os.kill(kernel_pid, signal.SIGKILL)
        else:
            km.restart_kernel(now=False)  # what Kernel > Restart does: ask, then kill if needed
        took, alive = _wait_gone(pids, timeout=15 + (time.monotonic() - t0))
        assert not alive, f"still running {took:.1f} s after the kernel {how}: {alive}"
        record_time(f"kernel {how}: workers gone", gone_s=took)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
        _kill_leftovers(pids)
