"""nbddp across hosts: attaching to a running cluster, and DDP over fake network hosts.

The end-to-end test builds three fake hosts with Linux network namespaces
(``netns_hosts.fake_hosts``): the controller and the "notebook" on host 0,
one engine on each of hosts 1 and 2, started from the engine connection
file as ``ipengine`` on a remote machine would be. The notebook side runs
inside host 0's namespace (``run_in_host``), attaches with
``nbddp.start(profile=<profile dir>, cluster_id=...)`` and trains; its final
weights must equal the same fit on the suite's one-machine ``workers``.

The other tests need no namespaces: they check how ``profile=`` is resolved
and what the errors say.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import psutil
import pytest

import nbddp
from netns_hosts import fake_hosts, netns_available
from nbddp.cluster.engines import ClusterError, Workers

_AVAILABLE, _WHY_NOT = netns_available()
needs_netns = pytest.mark.skipif(not _AVAILABLE, reason=f"netns tests skipped: {_WHY_NOT}")

# The model, data and fit options, built the same way in the test process
# (one machine) and in the fake-host "notebook" (exec'd from this string).
_BUILD = r"""
import torch

FIT = dict(epochs=3, batch_size=16, shuffle=False, seed=0, optimizer=torch.optim.SGD, lr=0.05, live=False)


def build():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(192, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return model, (x, y)
"""

# The notebook on host 0. argv[1]: where to save the trained weights.
_NOTEBOOK = _BUILD + r"""
import json, os, sys, time
import ipyparallel as ipp
import nbddp
from nbddp.session.session import get_session
from nbddp.protocol.placement import TopologyError

info = json.loads(os.environ["NBDDP_FAKE_HOSTS"])
attach = dict(profile=info["profile_dir"], cluster_id=info["cluster_id"])
out = {}

try:  # the fake hosts have no GPU: refused before any process group exists
    nbddp.start(backend="nccl", **attach)
except TopologyError as e:
    out["nccl_error"] = str(e)
out["running_after_nccl"] = nbddp.status()["running"]

try:
    nbddp.start(interface="nbnope0", **attach)
except TopologyError as e:
    out["interface_error"] = str(e)

t0 = time.perf_counter()
out["status"] = nbddp.start(n=2, backend="gloo", **attach)
out["start_s"] = time.perf_counter() - t0


def socket_env():
    import os, socket
    return socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME")


out["socket_env"] = nbddp.run(socket_env)
model, data = build()
t0 = time.perf_counter()
history = nbddp.dist_fit(model, data, **FIT)
out["fit_s"] = time.perf_counter() - t0
out["epoch_losses"] = [e["loss"] for e in history.epochs]
torch.save(model.state_dict(), sys.argv[1])

nbddp.stop()
with ipp.Client(info["client_file"]) as rc:
    out["ids_after_stop"] = sorted(rc.ids)
print("RESULT " + json.dumps(out))
"""


def _build() -> tuple[object, tuple, dict]:
    ns: dict = {}
    exec(_BUILD, ns)  # noqa: S102 - our own constant, shared with the fake-host notebook
    model, data = ns["build"]()
    return model, data, ns["FIT"]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_dist_fit_across_fake_hosts_equals_one_machine(workers, tmp_path: Path) -> None:
    """A fit across two fake hosts gives the weights of the same fit on one machine.

    It cannot be faster: it builds the namespaced network, starts a controller and engines
    inside it and a client process beside them, and runs the one-machine fit too.
    """
    import torch

    model, data, fit = _build()
    nbddp.dist_fit(model, data, **fit)
    local = model.state_dict()

    weights = tmp_path / "netns-weights.pt"
    with fake_hosts(n_hosts=3, engines_per_host=1, profile_dir=tmp_path / "profile", engine_hosts=[1, 2]) as cluster:
        engine_pids = [p for ps in cluster.engine_pids.values() for p in ps]
        done = cluster.run_in_host(0, _NOTEBOOK, args=[os.fspath(weights)], timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
        [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        out = json.loads(line.removeprefix("RESULT "))
        # The notebook process has exited: engines it attached to must not follow it
        # (engines nbddp starts itself watch the kernel and exit with it; these may not).
        time.sleep(1.5)  # three periods of that watchdog
        assert [pid for pid in engine_pids if _alive(pid)] == engine_pids
        all_ids = sorted(i for ids in cluster.engine_ids.values() for i in ids)
        hosts = {h.hostname: h for h in cluster.hosts}

    # nccl on engines without GPUs: a clear error, nothing left running
    assert "backend='nccl' needs GPUs" in out["nccl_error"] and "see none" in out["nccl_error"]
    assert out["running_after_nccl"] is False
    assert "start(interface='nbnope0')" in out["interface_error"] and "has no such network interface" in out["interface_error"]

    status = out["status"]
    assert status["owned"] is False and status["world_size"] == 2 and status["backend"] == "gloo"
    assert status["hosts"] == sorted([cluster.hosts[1].hostname, cluster.hosts[2].hostname])
    rank0 = status["ranks"][0]
    assert rank0["engine"] == min(all_ids)
    master = status["master"]
    assert master.startswith(f"tcp://{hosts[rank0['host']].address}:"), master
    assert "127.0.0.1" not in master and "0.0.0.0" not in master
    # every rank's gloo traffic on its own host's veth interface
    assert sorted(map(tuple, out["socket_env"])) == sorted((h.hostname, h.interface) for h in cluster.hosts[1:])

    remote = torch.load(weights)
    assert remote.keys() == local.keys()
    for name in local:
        torch.testing.assert_close(remote[name], local[name], rtol=1e-5, atol=1e-6, msg=f"parameter {name}")
    assert out["ids_after_stop"] == all_ids  # nbddp.stop() left the attached engines registered
    print(f"\nnetns: attach+group {out['start_s']:.2f} s, dist_fit {out['fit_s']:.2f} s")


# The notebook on host 0 again, with rank 0 on host 1: a synchronous callback and handle.profile reach rank 0
# through the group's TCPStore (protocol/store_channel.py). argv[1]: the folder for the profile's trace.
_SYNC_NOTEBOOK = _BUILD + r"""
import glob, json, os, sys, warnings
import nbddp
from nbddp.callbacks.base import Callback
from nbddp.session.session import get_session
from nbddp.protocol.notes import shm_dir

info = json.loads(os.environ["NBDDP_FAKE_HOSTS"])
out = {"status": nbddp.start(n=2, backend="gloo", profile=info["profile_dir"], cluster_id=info["cluster_id"])}


class LowerThenStop(Callback):
    def __init__(self):
        self.seen = []

    def on_epoch_end(self, record):
        self.seen.append(record["epoch"])
        if record["epoch"] == 0:
            self.handle.set_lr(0.01)
        return "stop" if record["epoch"] == 1 else None


cb = LowerThenStop()
model, data = build()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    h = nbddp.dist_fit(model, data, **{**FIT, "log_every": 1}, callbacks=[cb])
out["notices"] = [str(w.message) for w in caught]
out["fit"] = dict(status=h.status, stop_reason=h.stop_reason, epochs=[e["epoch"] for e in h.epochs], seen=cb.seen,
                  lrs={str(e): sorted({s["lr"] for s in h.steps if s["epoch"] == e}) for e in range(3)},
                  samples=[r["samples"] for r in h.ranks], answer_points=h.timings.get("answer_points"),
                  answer_wait_s=h.timings.get("answer_wait_s"))

g = torch.Generator().manual_seed(1)
x = torch.randn(16000, 8, generator=g)
handle = nbddp.dist_fit(torch.nn.Linear(8, 1), (x, x.sum(1, keepdim=True)), epochs=1, batch_size=4, lr=0.01,
                        optimizer=torch.optim.SGD, live=False, block=False, log_every=1)
try:
    profile = handle.profile(steps=3, dir=sys.argv[1])
    out["running_after_profile"] = not handle.done()
finally:
    out["profiled_fit"] = handle.stop().status
out["profile"] = dict(ranks=profile["ranks"], path=profile["path"],
                      steps=[profile["breakdown"][r]["steps"] for r in profile["ranks"]])
session = get_session()
out["rank0_local"] = session.placements[0].local  # False: the answers went through the store, not a file
prefix = session.file_prefix
out["shm_files"] = sorted(glob.glob(os.path.join(shm_dir(), glob.escape(prefix) + "*answer*"))
                          + glob.glob(os.path.join(shm_dir(), glob.escape(prefix) + "*request*")))
nbddp.stop()
print("RESULT " + json.dumps(out))
"""


@needs_netns
@pytest.mark.netns
@pytest.mark.slow
def test_synchronous_callbacks_and_profile_reach_rank_0_on_another_host(tmp_path: Path) -> None:
    """No rank on the kernel's host (Slurm's login node): the answers and the profile request cross hosts.

    It cannot be faster: it builds the namespaced network and starts a controller, two engines and a
    client process in it, then runs two fits over the veth pairs.
    """
    traces = tmp_path / "traces"
    with fake_hosts(n_hosts=3, engines_per_host=1, profile_dir=tmp_path / "profile", engine_hosts=[1, 2],
                    private_shm=True) as cluster:  # no engine sees the kernel's /dev/shm: no file can reach rank 0
        done = cluster.run_in_host(0, _SYNC_NOTEBOOK, args=[os.fspath(traces)], timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    [line] = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert out["status"]["master"].startswith("tcp://") and cluster.hosts[0].hostname not in out["status"]["hosts"]
    assert out["rank0_local"] is False

    fit = out["fit"]
    assert not [n for n in out["notices"] if "asynchronously" in n or "rank 0 runs on" in n], out["notices"]
    assert fit["status"] == "completed" and fit["stop_reason"] == "LowerThenStop.on_epoch_end returned 'stop'"
    assert fit["epochs"] == [0, 1] and fit["seen"] == [0, 1]  # stopped right there: epoch 2 of 3 never trained
    assert fit["samples"] == [2 * 96, 2 * 96]  # both ranks trained exactly two epochs of 96 samples each
    assert fit["lrs"] == {"0": [0.05], "1": [0.01], "2": []}  # set_lr taken by every rank from epoch 1 on
    assert fit["answer_points"] == 2 and fit["answer_wait_s"] > 0  # the ranks waited: the hooks were synchronous

    assert out["running_after_profile"] is True and out["profiled_fit"] == "interrupted"
    assert out["profile"]["ranks"] == [0, 1] and out["profile"]["steps"] == [3, 3]
    assert Path(out["profile"]["path"]).parent == traces and Path(out["profile"]["path"]).is_file()
    assert out["shm_files"] == []  # nothing went through /dev/shm
    print(f"\nnetns: rank 0's wait per synchronous point {fit['answer_wait_s'] / fit['answer_points'] * 1e3:.1f} ms")


# ---- attaching: how profile= is resolved (no processes needed) -----------------------------
# Workers.attach is what nbddp.start(profile=..., cluster_id=...) calls; called directly here so
# that the suite's running workers (which make start() refuse a second cluster) do not matter.


def test_attach_to_missing_profile_dir_says_so(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"cannot attach with profile=.*no cluster was started with this profile"):
        Workers.attach(os.fspath(tmp_path / "nowhere"), None, None)


def test_attach_lists_the_cluster_ids_found(tmp_path: Path) -> None:
    security = tmp_path / "security"
    security.mkdir()
    (security / "ipcontroller-abc-client.json").write_text("{}")
    with pytest.raises(ClusterError, match=r"cluster ids found there: abc; pass cluster_id=\.\.\."):
        Workers.attach(os.fspath(tmp_path), "xyz", None)


def test_attach_to_missing_connection_file(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match=r"no such connection file.*ipcontroller-<cluster_id>-client.json"):
        Workers.attach(os.fspath(tmp_path / "ipcontroller-x-client.json"), None, None)


@pytest.mark.faults  # waits out ipyparallel's 10 s connection timeout
def test_attach_with_a_stale_connection_file_names_the_file(tmp_path: Path) -> None:
    # a connection file whose controller is gone (nothing listens on the port)
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    security = tmp_path / "security"
    security.mkdir()
    client_file = security / "ipcontroller-gone-client.json"
    client_file.write_text(json.dumps({
        "key": "0" * 32, "signature_scheme": "hmac-sha256", "unpack": "json", "pack": "json",
        "location": "127.0.0.1", "interface": "tcp://127.0.0.1", "ssh": "",
        **{k: port for k in ("registration", "control", "mux", "task", "iopub", "notification", "broadcast")},
        "task_scheme": "leastload",
    }))
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"could not attach to a running cluster .*ipcontroller-gone-client\.json.*still running"):
        Workers.attach(os.fspath(tmp_path), "gone", None)
    assert time.monotonic() - t0 < 30


def test_attach_argument_types() -> None:
    with pytest.raises(TypeError, match=r"start\(profile=\.\.\.\) must be a profile name or a path, got int 3"):
        Workers.attach(3, None, None)
    with pytest.raises(TypeError, match=r"start\(cluster_id=\.\.\.\) must be a str, got int 7"):
        Workers.attach(None, 7, None)


@pytest.mark.fresh_workers
def test_attach_by_profile_dir_to_a_running_cluster_and_leave_it_running(tmp_path: Path) -> None:
    """The ``ipcluster start --profile-dir=... --cluster-id=...`` route: found by its cluster file."""
    import logging

    import ipyparallel as ipp

    nbddp.stop()  # one session per kernel: the suite's workers make room (the next `workers` user restarts them)
    cluster = ipp.Cluster(n=2, profile_dir=os.fspath(tmp_path), cluster_id="attachme", delay=0,
                          log_level=logging.WARNING)
    cluster.start_controller_sync()
    try:
        assert (tmp_path / "security" / "cluster-attachme.json").exists()
        with pytest.raises(ClusterError, match=r"the attached cluster \(profile=.*\) has no engines registered"):
            nbddp.start(profile=os.fspath(tmp_path), cluster_id="attachme")
        cluster.start_engines_sync(2)
        st = nbddp.start(n=2, profile=os.fspath(tmp_path), cluster_id="attachme")
        assert st["owned"] is False and st["world_size"] == 2 and st["backend"] == "gloo"
        assert st["master"].startswith("file://")  # one host: a file store, no TCP listener
        assert nbddp.run(_rank_and_world) == [(0, 2), (1, 2)]
        nbddp.stop()
        with cluster.connect_client_sync() as rc:
            assert len(rc.ids) == 2  # nbddp.stop() only left the attached cluster
            view = rc[:]
            view.use_cloudpickle()  # plain ipyparallel: ship the test's function by value
            assert view.apply_sync(_rank_and_world) == [(-1, -1), (-1, -1)]  # and its process group
    finally:
        nbddp.stop()
        cluster.stop_cluster_sync()


def _rank_and_world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_initialized():
        return -1, -1
    return dist.get_rank(), dist.get_world_size()


def test_the_documented_slurm_template_asks_for_gpus(tmp_path: Path) -> None:
    """docs/multi-node.md's Slurm recipe, rendered by ipyparallel's own Slurm launcher (no sbatch needed)."""
    import re

    import ipyparallel as ipp
    from traitlets.config import Config

    doc = (Path(__file__).parent.parent / "docs" / "multi-node.md").read_text()
    template = re.search(r'SLURM_GPU_TEMPLATE = """(.*?)"""', doc, re.S).group(1)
    c = Config()
    c.SlurmEngineSetLauncher.batch_template = template
    c.SlurmEngineSetLauncher.queue = "gpu"
    c.SlurmEngineSetLauncher.timelimit = "04:00:00"
    c.SlurmEngineSetLauncher.namespace = {"nodes": 4, "gpus_per_node": 4, "cpus_per_task": 8}
    cluster = ipp.Cluster(engines="slurm", n=16, controller_ip="10.1.2.3", config=c, profile_dir=os.fspath(tmp_path))
    launcher = cluster.engine_launcher_class(config=cluster.config, profile_dir=os.fspath(tmp_path), cluster_id="lab",
                                             work_dir=os.fspath(tmp_path), log=cluster.log, parent=cluster)
    launcher.write_batch_script(16)
    script = Path(launcher.batch_file).read_text()
    for line in ["#SBATCH --ntasks=16", "#SBATCH --nodes=4", "#SBATCH --gpus-per-node=4", "#SBATCH --ntasks-per-node=4",
                 "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00", "#SBATCH --job-name=ipengine-lab"]:
        assert line in script.splitlines(), script
    assert re.search(r"(?m)^srun .*-m ipyparallel\.engine", script), script
    assert "{" not in script, script  # every variable filled in
