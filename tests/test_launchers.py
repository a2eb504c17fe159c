"""The ipyparallel launchers the README names, started for real: MPI (``mpiexec`` from the ``mpich`` wheel) and
SSH (a real ``sshd`` on two fake hosts, ``tests/netns_hosts.py``).

``nbddp.start(cluster=ipp.Cluster(engines="mpi", n=2))`` has ipyparallel run ``mpiexec -n 2 python -m
ipyparallel.engine``; each engine takes its id from MPI (``mpi4py``), and nbddp forms its own gloo group over
them and trains. The SSH test starts Debian's ``sshd`` in two network namespaces with a key made for the test
(no password), and ipyparallel's SSH launcher starts one engine on each over ssh. The commands are those of
docs/multi-node.md's MPI and SSH sections.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp


def _mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (the ``mpich`` wheel puts it in the venv's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def _mpi_missing() -> str | None:
    if _mpiexec() is None:
        return "no mpiexec (pip install mpich: the test extra has it)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "no mpi4py (the test extra has it)"
    return None


def pmi_rank() -> str | None:
    """The rank MPI's launcher gave this engine's process."""
    return os.environ.get("PMI_RANK")


@pytest.mark.fresh_workers  # stops the suite's workers: its own come from mpiexec
@pytest.mark.skipif(_mpi_missing() is not None, reason=f"MPI test skipped: {_mpi_missing()}")
def test_mpi_launcher_starts_two_engines_and_a_fit_trains_on_them():
    import ipyparallel as ipp
    from traitlets.config import Config

    nbddp.stop()
    config = Config()
    config.MPILauncher.mpi_cmd = [_mpiexec()]
    try:
        nbddp.start(cluster=ipp.Cluster(engines="mpi", n=2, config=config), backend="gloo")
        assert sorted(nbddp.run(pmi_rank)) == ["0", "1"]  # both engines are processes of one mpiexec job
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        before = [p.detach().clone() for p in model.parameters()]
        history = nbddp.dist_fit(model, (x, y), epochs=1, batch_size=8, loss_fn=F.cross_entropy, live=False)
        assert history.status == "completed" and len(history.ranks) == 2
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trained weights came back
    finally:
        nbddp.stop()


# ---- SSH: ipyparallel's SSH launcher against a real sshd on two fake hosts --------------------------------------

# The notebook, on fake host 0 (the controller's): the commands of docs/multi-node.md's SSH section, with the
# test's key and hosts. argv[1]: the private key.
_SSH_NOTEBOOK = r"""
import json, os, sys
import ipyparallel as ipp, torch, torch.nn as nn, torch.nn.functional as F
from traitlets.config import Config
import nbddp

info = json.loads(os.environ["NBDDP_FAKE_HOSTS"])
hosts = [h["address"] for h in info["hosts"]]
options = ["-i", sys.argv[1], "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o",
           "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR"]
c = Config()
c.SSHEngineSetLauncher.engines = {hosts[1]: 1, hosts[2]: 1}
c.SSHLauncher.ssh_args = options
c.SSHLauncher.scp_args = options
c.SSHLauncher.remote_python = sys.executable
c.SSHEngineSetLauncher.remote_python = sys.executable
cluster = ipp.Cluster(engines="ssh", n=2, controller_ip=hosts[0], profile_dir=info["profile_dir"], config=c)
nbddp.start(cluster=cluster, backend="gloo")
try:
    x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
    history = nbddp.dist_fit(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), (x, y), epochs=1,
                             batch_size=8, loss_fn=F.cross_entropy, live=False)
    print("RESULT", json.dumps({"status": history.status, "hosts": [r["host"] for r in history.ranks]}))
finally:
    nbddp.stop()
"""

_SSHD_CONFIG = """ListenAddress {address}
Port 22
HostKey {folder}/host_key
AuthorizedKeysFile {folder}/authorized_keys
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
UsePAM no
PidFile {folder}/sshd-{index}.pid
Subsystem sftp {sftp}
"""

SSHD, SFTP = "/usr/sbin/sshd", "/usr/lib/openssh/sftp-server"


def _ssh_missing() -> str | None:
    from netns_hosts import netns_available

    ok, why = netns_available()
    if not ok:
        return why
    if not (os.access(SSHD, os.X_OK) and os.access(SFTP, os.X_OK) and shutil.which("ssh-keygen")):
        return "no sshd (Debian's openssh-server: scripts/test.sh installs it as root)"
    return None


@pytest.mark.netns
@pytest.mark.skipif(_ssh_missing() is not None, reason=f"SSH test skipped: {_ssh_missing()}")
def test_ssh_launcher_starts_an_engine_on_each_of_two_hosts_and_a_fit_trains(tmp_path):
    """Three fake hosts (network namespaces): the notebook and the controller on host 0, a real sshd on hosts 1
    and 2 that takes only the key made here (no password). ipyparallel's SSH launcher copies the connection
    file over scp and starts one engine per host over ssh; nbddp trains on them. About 55 s and 23 CPU-seconds:
    engine starts over ssh, torch imports and the fit, in processes of their own."""
    import subprocess

    from netns_hosts import fake_network, host_command

    for name in ("client_key", "host_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / name)], check=True)
    (tmp_path / "authorized_keys").write_text((tmp_path / "client_key.pub").read_text())
    os.chmod(tmp_path / "authorized_keys", 0o600)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation folder
    with fake_network(3, tmp_path / "profile") as net:
        daemons = []
        try:
            for index in (1, 2):
                config = tmp_path / f"sshd-{index}.conf"
                text = _SSHD_CONFIG.format(address=net.hosts[index].address, folder=tmp_path, index=index, sftp=SFTP)
                if os.environ.get("PYTHONPATH"):  # a checkout on the path (not installed): the engines need it too
                    text += f"SetEnv PYTHONPATH={os.environ['PYTHONPATH']}\n"
                config.write_text(text)
                daemons.append(subprocess.Popen(host_command(net.hosts[index], [SSHD, "-D", "-e", "-f", str(config)]),
                                                stderr=open(tmp_path / f"sshd-{index}.log", "w")))
            done = net.run_in_host(0, _SSH_NOTEBOOK, args=[str(tmp_path / "client_key")], timeout=240)
        finally:
            for daemon in daemons:
                daemon.terminate()
                daemon.wait(10)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(done.stdout.split("RESULT", 1)[1])
    assert result["status"] == "completed"
    assert sorted(result["hosts"]) == [net.hosts[1].hostname, net.hosts[2].hostname]  # one rank on each host
    logs = "".join((tmp_path / f"sshd-{i}.log").read_text() for i in (1, 2))
    assert "Accepted publickey for" in logs and "Accepted password" not in logs
