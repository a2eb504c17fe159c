"""A private, real Slurm for tests: slurmctld and a Jupyter kernel on one fake host, a slurmd on each other one.

Built on ``netns_hosts.fake_network`` (Linux network namespaces on a private
bridge, nothing added to the machine's own network):

* host 0 is the login node: slurmctld runs there, and so does the "notebook"
  (:meth:`PrivateSlurm.start_kernel`: a real ipykernel, reached from the test
  process over ``ipc`` sockets, since the test process has no route into the
  namespaces). nbddp's controller therefore runs on host 0 too, where the
  kernel is, and must listen on an address the nodes reach;
* hosts 1.. are compute nodes ``n1``, ``n2``...: each slurmd runs in its
  host's network namespace, with that host's name and its own ``/dev/shm``
  (a node's shared memory is its own; the file system is shared, as a
  cluster's home directories are). Jobs' processes are slurmd's children, so
  engines started by ``srun`` live on those hosts.

munged runs with a private key and socket; Slurm reads one private
``slurm.conf`` (``SLURM_CONF``), with state, spool, pid and log files in one
private folder and free ports. Accounting is off, as on many small clusters:
``sacct`` knows nothing, ``squeue --states=all`` and ``scontrol show job``
know finished jobs for ``MinJobAge`` seconds.

Every process is started here and stopped here by its pid (SIGTERM, then
SIGKILL); whatever is left inside the namespaces (slurmstepd, job steps) is
killed by ``fake_network`` before the namespaces are deleted, and the
private folder is removed.

Requires root, ``ip`` (iproute2) and Debian's ``slurmctld slurmd slurm-client
munge`` packages (``scripts/test.sh`` installs them as root);
:func:`slurm_available` says why not elsewhere.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kernel_cells import Kernel
from netns_hosts import FakeCluster, FakeHost, fake_network, host_command, netns_available

__all__ = ["LoginKernel", "PrivateSlurm", "private_slurm", "slurm_available"]

PACKAGES = "slurmctld slurmd slurm-client munge"
_BINARIES = ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo", "munged", "mungekey")
_STOP_GRACE_S = 5.0

# A compute node's process: into the host's network namespace, then a new mount and UTS namespace
# with the host's name and a private /dev/shm, then exec. (`ip netns exec` would remount /sys, which
# hides the cgroup mounts slurmd needs.)
_NODE_TRAMPOLINE = r"""
import ctypes, os, socket, sys
libc = ctypes.CDLL(None, use_errno=True)
def check(ret, what):
    if ret != 0:
        sys.exit(f"slurm_cluster: {what} failed: " + os.strerror(ctypes.get_errno()))
CLONE_NEWNET, CLONE_NEWNS, CLONE_NEWUTS, MS_REC, MS_SLAVE = 0x40000000, 0x00020000, 0x04000000, 0x4000, 0x80000
fd = os.open("/run/netns/" + sys.argv[1], os.O_RDONLY)
check(libc.setns(fd, CLONE_NEWNET), "setns(net)")
os.close(fd)
check(libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare(mount, uts)")
check(libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None), "mount --make-rslave /")
check(libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"mode=1777"), "mount tmpfs /dev/shm")
socket.sethostname(sys.argv[2])
os.execv(sys.argv[3], sys.argv[3:])
"""


def slurm_available() -> tuple[bool, str]:
    """Whether :func:`private_slurm` can run here, and if not, why (ready for ``pytest.skip``)."""
    ok, why = netns_available()
    if not ok:
        return False, why
    missing = [b for b in _BINARIES if shutil.which(b, path=os.environ.get("PATH", "") + ":/usr/sbin") is None]
    if missing:
        return False, (f"Slurm is not installed ({', '.join(missing)} missing): as root, "
                       f"`apt-get install -y --no-install-recommends {PACKAGES}` (scripts/test.sh does it)")
    return True, ""


@dataclass
class PrivateSlurm:
    """What :func:`private_slurm` yields.

    Attributes:
        network: the fake hosts; ``hosts[0]`` is the login node.
        root: the private folder (configuration, state, logs, munge socket).
        conf: the ``slurm.conf``; ``env`` has ``SLURM_CONF`` pointing at it.
        nodes: Slurm node name -> its fake host.
        partition: the default partition, holding every node.
        urgent: a partition of a higher priority tier over the same nodes: a job there preempts the
            default partition's jobs (``PreemptMode=CANCEL``: they end PREEMPTED).
        pids: process name -> pid of what was started (munged, slurmctld, slurmd-n1, ...).
    """

    network: FakeCluster
    root: Path
    conf: Path
    nodes: dict[str, FakeHost]
    partition: str = "debug"
    urgent: str = "urgent"  # a higher tier: its jobs preempt (cancel) the default partition's, state PREEMPTED
    env: dict[str, str] = field(default_factory=dict)
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def login(self) -> FakeHost:
        return self.network.hosts[0]

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` as run on the login node (its namespace, /etc/hosts and host name)."""
        return host_command(self.login, [_which(argv[0]), *argv[1:]])

    def run(self, *argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
        """A Slurm client command (``squeue``, ``scancel``, ``sbatch``, ``scontrol``...) on the login node."""
        done = subprocess.run(self.command(argv), capture_output=True, text=True, env={**os.environ, **self.env},
                              timeout=timeout, cwd=self.root)  # (a job's slurm-N.out lands in the private folder)
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): {done.stderr.strip()}")
        return done

    def jobs(self, all_states: bool = False) -> list[dict[str, str]]:
        """``squeue``'s jobs: id, name, state, reason, nodes (pending and running ones; every one known with ``all_states``)."""
        argv = ["squeue", "-h", "-o", "%i|%j|%T|%r|%N"] + (["--states=all"] if all_states else [])
        rows = [line.split("|") for line in self.run(*argv).stdout.splitlines() if line.strip()]
        return [dict(zip(("id", "name", "state", "reason", "nodes"), row)) for row in rows]

    def wait_for(self, condition, timeout: float, what: str, interval: float = 0.2):
        """Poll ``condition()`` until it returns something true; return it, or fail naming ``what``."""
        deadline = time.monotonic() + timeout
        while True:
            got = condition()
            if got or time.monotonic() > deadline:
                if not got:
                    raise AssertionError(f"gave up after {timeout:.0f} s waiting for {what}; squeue: {self.jobs(True)}")
                return got
            time.sleep(interval)

    def log_tails(self, lines: int = 15) -> str:
        out = []
        for path in sorted(self.root.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(text))
        return "\n".join(out)


@contextlib.contextmanager
def private_slurm(n_nodes: int = 2, cpus_per_node: int = 2, start_timeout: float = 60.0) -> Iterator[PrivateSlurm]:
    """Start munged, slurmctld (login node) and ``n_nodes`` slurmd (their own hosts); stop them all on exit."""
    root = Path(tempfile.mkdtemp(prefix="nbddp-slurm-"))
    os.chmod(root, 0o755)  # munge's socket: every folder up to it must be o+x
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        with fake_network(n_nodes + 1, root / "hosts") as network:
            slurm = PrivateSlurm(network, root, root / "slurm.conf",
                                 {f"n{i}": network.hosts[i] for i in range(1, n_nodes + 1)})
            slurm.env = {"SLURM_CONF": str(slurm.conf)}
            try:
                _start(slurm, procs, cpus_per_node, start_timeout)
                yield slurm
            finally:
                _stop(procs)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _start(slurm: PrivateSlurm, procs: dict[str, subprocess.Popen[bytes]], cpus: int, timeout: float) -> None:
    root = slurm.root
    socket_path = root / "munge.socket"
    subprocess.run([_which("mungekey"), "--create", f"--keyfile={root / 'munge.key'}"], check=True,
                   capture_output=True)
    procs["munged"] = _spawn([_which("munged"), "--foreground", f"--socket={socket_path}",
                              f"--key-file={root / 'munge.key'}", f"--pid-file={root / 'munged.pid'}",
                              f"--log-file={root / 'munged.log'}", f"--seed-file={root / 'munged.seed'}"],
                             root / "munged.out", {})
    _wait(lambda: socket_path.exists(), procs["munged"], timeout, "munged's socket", slurm)
    for sub in ("state", "spool", *[f"spool/{n}" for n in slurm.nodes]):
        (root / sub).mkdir()
    slurm.conf.write_text(_conf(slurm, socket_path, cpus))
    procs["slurmctld"] = _spawn(host_command(slurm.login, [_which("slurmctld"), "-D", "-f", str(slurm.conf)]),
                                root / "slurmctld.out", slurm.env)
    for name, host in slurm.nodes.items():
        argv = [sys.executable, "-c", _NODE_TRAMPOLINE, host.namespace, host.hostname,
                _which("slurmd"), "-D", "-f", str(slurm.conf), "-N", name]
        procs[f"slurmd-{name}"] = _spawn(argv, root / f"slurmd-{name}.out", slurm.env)
    slurm.pids.update({name: p.pid for name, p in procs.items()})

    def all_idle() -> bool:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{slurm.log_tails()}")
        done = slurm.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
        return sorted(states) == sorted(slurm.nodes) and set(states.values()) == {"idle"}

    _wait(all_idle, None, timeout, "every node to be idle in sinfo", slurm)


def _conf(slurm: PrivateSlurm, socket_path: Path, cpus: int) -> str:
    root, login = slurm.root, slurm.login
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={h.hostname} NodeAddr={h.address} CPUs={cpus} Sockets=1 "
        f"CoresPerSocket={cpus} ThreadsPerCore=1 RealMemory=1000 State=UNKNOWN"
        for name, h in slurm.nodes.items())
    return f"""\
ClusterName=nbddp
SlurmctldHost={login.hostname}({login.address})
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
SlurmdParameters=config_overrides
SchedulerParameters=batch_sched_delay=0
ReturnToService=2
MinJobAge=300
KillWait=30
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
{nodes}
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
PartitionName={slurm.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName={slurm.urgent} Nodes=ALL MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
"""


class LoginKernel(Kernel):
    """A real ipykernel on the login node: the notebook of these tests.

    Its environment has ``SLURM_CONF`` and a private ``IPYTHONDIR`` (so the
    controller's files, and the engines', live in the private folder), and
    not the test run's marker: what it starts belongs to it, not to the
    pytest process, and is checked by the tests themselves. It speaks over
    unix sockets: the test process has no route into the namespace.
    """

    def __init__(self, slurm: PrivateSlurm, **extra: str):
        where = slurm.root / "jupyter"
        tests = Path(__file__).resolve().parent
        env = {**os.environ, **slurm.env, "IPYTHONDIR": str(slurm.root / "ipython"),
               "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests)])}
        super().__init__(env=env, cwd=slurm.root, marked=False, spec_dir=where, ipc_dir=where / "ipc",
                         argv=slurm.command([sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"]),
                         **extra)


def _spawn(argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, **env}, start_new_session=True)


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM in reverse start order (slurmd, slurmctld, munged), then SIGKILL what is still there."""
    for proc in reversed(list(procs.values())):
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _STOP_GRACE_S
    for proc in procs.values():
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _wait(condition, proc: subprocess.Popen[bytes] | None, timeout: float, what: str, slurm: PrivateSlurm) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"gave up waiting for {what}: the process exited with {proc.returncode}\n"
                               f"{slurm.log_tails()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up waiting for {what} after {timeout:.0f} s\n{slurm.log_tails()}")
        time.sleep(0.05)


def _which(name: str) -> str:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin")
    return found or name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
