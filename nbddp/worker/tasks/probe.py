"""What an engine reports about itself: host, pid, addresses, GPUs, versions.

Joining the process group is ``process_group.py``'s.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from nbddp.protocol.host import address_towards, pid_alive
from nbddp.protocol.placement import Probe
from nbddp.protocol.session_record import detached_marker
from nbddp.worker.engine.rank_state import STATE


def probe(engine_id: int, controller_host: str, token_path: str, token: str, kernel_pid: int,
          file_prefix: str = "") -> Probe:
    """Describe this engine: host, pid, reachable address, GPUs, same host as the kernel, versions.

    ``same_host_as_kernel`` is decided by reading a token file the kernel just
    wrote (same file system, so shared-memory shipping works), not by
    comparing host names, which containers and clusters make unreliable.
    """
    import psutil
    import torch

    try:
        with open(token_path) as f:
            same = f.read() == token
    except OSError:
        same = False
    address = address_towards(controller_host)
    interfaces = {}
    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family == socket.AF_INET:
                interfaces[name] = a.address
    if same and kernel_pid > 0:  # 0: an attached cluster's engines, which outlive the kernel
        _watch_kernel(kernel_pid, detached_marker(file_prefix) if file_prefix else "")
    return Probe(
        engine_id=engine_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        address=address,
        cuda_devices=torch.cuda.device_count() if torch.cuda.is_available() else 0,
        same_host_as_kernel=same,
        python=sys.version.split()[0],
        torch_version=torch.__version__,
        interfaces=interfaces,
    )


def _watch_kernel(kernel_pid: int, marker: str = "", interval: float = 0.5) -> None:
    """Exit this engine when the kernel that started it dies (no orphans), unless the session was detached.

    Only for engines on the kernel's host, where its pid means something.
    A daemon thread: it costs one wake-up every ``interval`` seconds. The
    ``marker`` file (``nbddp.start(detach=True)``, ``%ddp detach``) says the
    session outlives the kernel: then the reaper ends the engines after the
    session's ``keep_alive`` instead (``nbddp/cluster/idle_watch.py``).
    """
    if STATE.watchdog is not None and STATE.watchdog.is_alive():
        return

    def _watch() -> None:
        while True:
            time.sleep(interval)
            if not pid_alive(kernel_pid) and not (marker and os.path.exists(marker)):
                os._exit(0)

    STATE.watchdog = threading.Thread(target=_watch, name="nbddp-kernel-watchdog", daemon=True)
    STATE.watchdog.start()
