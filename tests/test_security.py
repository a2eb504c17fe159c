"""Security defaults (issue 4, row 7) on one machine.

Nothing nbddp started listens on a non-loopback address (controller,
engines, their nannies, the reaper, the process group's store and gloo
pairs, read while a fit runs), and the connection files are 0600.
"""

from __future__ import annotations

import contextlib
import glob
import ipaddress
import os
import stat
import threading
from typing import Iterator

import psutil
import pytest

import nbddp
from faultkit import Net, regression_data

pytestmark = pytest.mark.timeout(180)


def _nbddp_processes(session) -> list[psutil.Process]:
    pids = set(session.workers.all_pids()) | {p.pid for p in session.placements}
    if session.workers.reaper.pid is not None:
        pids.add(session.workers.reaper.pid)
    procs = {}
    for pid in pids:
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            continue
        for q in [p, *p.children(recursive=True)]:
            procs[q.pid] = q
    return list(procs.values())


def _listening(procs: list[psutil.Process]) -> list[tuple[int, str, int]]:
    found = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.Error:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN or (c.type.name == "SOCK_DGRAM" and not c.raddr):
                found.append((p.pid, c.laddr.ip, c.laddr.port))
    return found


@contextlib.contextmanager
def listening_while(session, every: float = 0.3) -> Iterator[list[tuple[int, str, int]]]:
    """Every (pid, address, port) our processes listen on, sampled while the block runs (and its group exists)."""
    seen: list[tuple[int, str, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.extend(_listening(_nbddp_processes(session)))
            done.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield seen
    finally:
        done.set()
        sampler.join()


def test_nothing_listens_beyond_loopback(workers):
    with listening_while(workers) as seen:
        h = nbddp.dist_fit(Net(delay=0.02), regression_data(), batch_size=16, epochs=1, live=False)
    assert h.status == "completed"
    procs = _nbddp_processes(workers)
    seen.extend(_listening(procs))
    kinds = {" ".join(p.cmdline()[1:3]) for p in procs if p.is_running()}
    assert any("ipyparallel.controller" in k for k in kinds) and any("ipyparallel.engine" in k for k in kinds), kinds
    sockets = set(seen)
    assert sockets, "no listening socket seen at all: the check looks at the wrong processes"
    exposed = [s for s in sockets if not ipaddress.ip_address(s[1]).is_loopback]
    assert not exposed, f"listening on non-loopback addresses (pid, address, port): {sorted(exposed)}"


def test_connection_files_are_private(workers):
    cluster = workers.workers.cluster
    security = os.path.join(cluster.profile_dir, "security")
    files = glob.glob(os.path.join(security, f"ipcontroller-{cluster.cluster_id}-*.json"))
    assert files, f"no connection files for cluster {cluster.cluster_id} in {security}"
    for path in files:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        assert mode == 0o600, f"{path} has mode {oct(mode)}, want 0o600"


def test_process_group_store_is_a_private_file(workers):
    """On one host the rendezvous is a file store (no TCP listener), never a TCP store."""
    group = workers.group
    assert group.init_method.startswith("file:///"), group.init_method
    assert os.path.exists(group.init_method[len("file://"):])
    assert nbddp.run(_socket_ifname) == ["lo", "lo"]
    assert group.master_addr == "127.0.0.1"


def _socket_ifname():
    import os

    return os.environ.get("GLOO_SOCKET_IFNAME")


def _shm_modes(prefix: str) -> dict[str, int]:
    modes = {}
    for path in glob.glob(os.path.join("/dev/shm", glob.escape(prefix) + "*")):
        try:
            modes[os.path.basename(path)] = stat.S_IMODE(os.stat(path).st_mode)
        except FileNotFoundError:  # a pooled file released between the listing and the stat
            pass
    return modes


def test_every_shared_memory_file_of_a_fit_is_owner_only(workers):
    """Listed while a fit runs: the process-group store and the stack dumps name the person's files and functions."""
    prefix = workers.file_prefix
    seen: dict[str, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            seen.update(_shm_modes(prefix))
            done.wait(0.1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        h = nbddp.dist_fit(Net(delay=0.02), regression_data(), batch_size=16, epochs=1, live=False)
    finally:
        done.set()
        sampler.join()
    assert h.status == "completed"
    kinds = {name[len(prefix):].split("-")[1] for name in seen}
    assert {"pg", "w0", "w1"} <= kinds, sorted(seen)  # the store and every rank's stack file were among them
    shared = {name: oct(mode) for name, mode in seen.items() if mode != 0o600}
    assert not shared, f"files other users could read: {shared}"
    assert not [n for n in _shm_modes(prefix) if n.endswith("-probe")], "the probe's token file outlived the probe"


def test_the_reaper_removes_the_probe_token_on_a_clean_stop_too(tmp_path):
    import secrets

    from nbddp.cluster import reaper

    prefix = f"nbddp-test{secrets.token_hex(4)}"
    token = os.path.join("/dev/shm", f"{prefix}-probe")
    with open(os.open(token, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write("x" * 32)
    assert reaper.main(os.getpid(), str(tmp_path / "gone"), prefix, interval=0.01) == 0  # no pid file: a clean stop
    assert not os.path.exists(token)
