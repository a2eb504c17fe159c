"""Checks that tests/netns_hosts.py fakes several hosts well enough for DDP.

Two fake hosts with one engine each: the engines must see different host
names, reach the controller from their own namespace address (never
127.0.0.1), and run a gloo all_reduce over the veth interfaces. Afterwards no
namespace, link or process of the run may remain.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
from pathlib import Path

import psutil
import pytest

from netns_hosts import FakeCluster, fake_hosts, netns_available

_AVAILABLE, _WHY_NOT = netns_available()
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=f"netns tests skipped: {_WHY_NOT}")

# The client side. It runs on host 0 (the root namespace has no route to the
# fake hosts), reads the cluster from $NBDDP_FAKE_HOSTS and prints one JSON
# line. Functions are shipped by ipyparallel from this script's __main__.
_CLIENT_SCRIPT = r"""
import json, os
import ipyparallel as ipp

info = json.loads(os.environ["NBDDP_FAKE_HOSTS"])
controller_ip = info["hosts"][0]["address"]
n_engines = sum(len(p) for p in info["engine_pids"].values())


def probe(controller_ip):
    # The address this engine uses to reach the controller: the kernel picks
    # the source address of a (never sent) UDP datagram by routing.
    import os, socket
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((controller_ip, 9))
        ip = s.getsockname()[0]
    return {"hostname": socket.gethostname(), "ip": ip, "pid": os.getpid()}


def free_port(ip):
    import socket
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def all_reduce(rank, world_size, init_method, ifname):
    import os
    from datetime import timedelta
    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    import torch
    import torch.distributed as dist
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t)
        return t.item()
    finally:
        dist.destroy_process_group()
        del os.environ["GLOO_SOCKET_IFNAME"]


with ipp.Client(info["client_file"]) as rc:
    ids_at_connect = sorted(rc.ids)  # fake_hosts waits until the hub has them all
    rc.wait_for_engines(n_engines, timeout=30)
    ids = sorted(rc.ids)
    probes = {i: rc[i].apply_sync(probe, controller_ip) for i in ids}
    iface = {h["address"]: h["interface"] for h in info["hosts"]}
    master_ip = probes[ids[0]]["ip"]
    init_method = f"tcp://{master_ip}:{rc[ids[0]].apply_sync(free_port, master_ip)}"
    # One AsyncResult per engine, so that a dead rank is reported at once.
    ars = [
        rc[e].apply_async(all_reduce, rank, len(ids), init_method, iface[probes[e]["ip"]])
        for rank, e in enumerate(ids)
    ]
    reduced = [ar.get(timeout=120) for ar in ars]

print("RESULT " + json.dumps(
    {"probes": {str(k): v for k, v in probes.items()}, "reduced": reduced,
     "init_method": init_method, "ids_at_connect": ids_at_connect}
))
"""


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_nothing_left(cluster: FakeCluster, pids: set[int]) -> None:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [ns for ns in cluster.namespaces if ns in listed], listed
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"nb{cluster.run_id}" not in links
    assert not [ns for ns in cluster.namespaces if Path("/etc/netns", ns).exists()]
    assert not [pid for pid in pids if _pid_alive(pid)]


@needs_netns
@pytest.mark.netns
def test_two_hosts_reach_controller_and_all_reduce(tmp_path: Path) -> None:
    real_hostname = socket.gethostname()
    with fake_hosts(n_hosts=2, engines_per_host=1, profile_dir=tmp_path / "profile") as cluster:
        assert cluster.client_file.exists() and cluster.engine_file.exists()
        started = {cluster.controller_pid, *(p for ps in cluster.engine_pids.values() for p in ps)}
        in_namespaces = {p for ps in cluster.namespace_pids().values() for p in ps}
        assert started <= in_namespaces  # every process runs inside a fake host

        result = cluster.run_in_host(0, _CLIENT_SCRIPT, timeout=240)
        assert result.returncode == 0, result.stderr[-3000:]
        [line] = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT ")]
        out = json.loads(line.removeprefix("RESULT "))
        in_namespaces |= {p for ps in cluster.namespace_pids().values() for p in ps}

    probes = out["probes"]
    by_address = {h.address: h for h in cluster.hosts}
    assert sorted(p["ip"] for p in probes.values()) == sorted(cluster.addresses)
    assert "127.0.0.1" not in {p["ip"] for p in probes.values()}
    for engine_id, p in probes.items():
        host = by_address[p["ip"]]
        assert p["hostname"] == host.hostname != real_hostname
        assert cluster.engine_ids[host.index] == [int(engine_id)]
        assert cluster.engine_pids[host.index] == [p["pid"]]
    assert out["ids_at_connect"] == sorted(i for ids in cluster.engine_ids.values() for i in ids)
    assert out["reduced"] == [3.0, 3.0]  # 1 + 2 on both ranks
    rank0 = probes[str(min(int(i) for i in probes))]  # rank 0: lowest engine id, any host
    assert out["init_method"].startswith(f"tcp://{rank0['ip']}:")

    assert socket.gethostname() == real_hostname
    _assert_nothing_left(cluster, started | in_namespaces)


@needs_netns
@pytest.mark.netns
def test_cleanup_when_the_body_raises(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="boom"):
        with fake_hosts(n_hosts=2, engines_per_host=1, engine_hosts=[1]) as cluster:
            assert list(cluster.engine_pids) == [1]
            pids = {p for ps in cluster.namespace_pids().values() for p in ps}
            raise RuntimeError("boom")
    _assert_nothing_left(cluster, pids)
    assert not cluster.profile_dir.exists()  # the temporary profile is gone


@needs_netns
@pytest.mark.netns
def test_run_in_host_errors_and_timeout(tmp_path: Path) -> None:
    with fake_hosts(n_hosts=1, engines_per_host=0, profile_dir=tmp_path) as cluster:
        with pytest.raises(IndexError, match=r"host_index=1 is out of range.*1 hosts"):
            cluster.run_in_host(1, "pass")
        script = tmp_path / "script.py"
        script.write_text("import sys; print(sys.argv[1]); sys.exit(3)")
        done = cluster.run_in_host(0, script, args=["hi"])
        assert (done.returncode, done.stdout) == (3, "hi\n")
        with pytest.raises(subprocess.CalledProcessError):
            cluster.run_in_host(0, script, args=["hi"], check=True)
        sleeper = "import time; time.sleep(60)  # sleeper"
        with pytest.raises(subprocess.TimeoutExpired):
            cluster.run_in_host(0, sleeper, timeout=1)
        pids = cluster.namespace_pids()[cluster.hosts[0].namespace]
        assert not [p for p in pids if _pid_alive(p) and sleeper in psutil.Process(p).cmdline()]
    _assert_nothing_left(cluster, set())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_hosts": 0}, "n_hosts must be between 1 and 250, got 0"),
        ({"engines_per_host": -1}, "engines_per_host must be >= 0, got -1"),
        ({"n_hosts": 2, "engine_hosts": [0, 2]}, r"names hosts \[2\] that do not exist"),
    ],
)
def test_fake_hosts_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        with fake_hosts(**kwargs):  # type: ignore[arg-type]
            pass


@needs_netns
@pytest.mark.netns
def test_start_failure_reports_log_and_cleans_up(tmp_path: Path) -> None:
    # An engine that cannot start (it imports a broken ipyparallel) must fail
    # setup with its log, and still leave nothing behind.
    (tmp_path / "ipyparallel").mkdir()
    (tmp_path / "ipyparallel" / "__init__.py").write_text("")
    match = r"(?s)engine pid \d+ on host 0 \((nbddp-\w+)-h0\) to register.*exited with 1.*No mod"
    with pytest.raises(RuntimeError, match=match) as failed:
        with fake_hosts(1, 1, tmp_path / "p", engine_env={"PYTHONPATH": os.fspath(tmp_path)}):
            pass
    run = re.search(match, str(failed.value))
    assert run is not None
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert run.group(1) not in listed
