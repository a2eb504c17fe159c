"""No orphans (issue 4, row 4): a real Jupyter kernel starts workers, then dies or restarts.

Every engine, nanny, controller and reaper it started must be gone within
15 s: the kernel cannot clean up after a SIGKILL, so this is the engines'
kernel watchdog and the reaper process at work.
"""

from __future__ import annotations

import time

import pytest

from kernel_cells import HELPERS, Kernel, described, kill, wait_gone

pytestmark = [pytest.mark.timeout(300), pytest.mark.fresh_workers, pytest.mark.faults, pytest.mark.notebook]

START = HELPERS + """
import nbddp
nbddp.start(n=2, backend="gloo")
out(session_pids())
"""


def _start_workers_in(kernel: Kernel) -> list[int]:
    pids = kernel.run(START, timeout=180)
    assert len(pids) >= 4, pids  # 2 engines, a controller, the reaper (and nannies)
    return pids


@pytest.mark.parametrize("how", ["SIGKILL", "restart"])
def test_workers_do_not_outlive_their_kernel(how):
    from faultkit import record_time

    kernel = Kernel()
    pids: list[int] = []
    try:
        pids = _start_workers_in(kernel)
        assert kernel.pid not in pids
        t0 = time.monotonic()
        if how == "SIGKILL":
            kernel.kill()
        else:
            kernel.km.restart_kernel(now=False)  # what Kernel > Restart does: ask, then kill if needed
        left = wait_gone(pids, timeout=15 + (time.monotonic() - t0))
        took = time.monotonic() - t0
        assert not left, f"still running {took:.1f} s after the kernel {how}: {described(left)}"
        record_time(f"kernel {how}: workers gone", gone_s=took)
    finally:
        kernel.close()
        kill(pids)
