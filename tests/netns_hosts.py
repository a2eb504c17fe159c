"""A fake multi-host ipyparallel cluster on one Linux machine, for tests.

Multi-node DDP bugs come from things a single-host cluster never exercises:
engines that reach the controller through a non-loopback address, ranks that
must agree on a rendezvous address that is not ``127.0.0.1``, host names that
differ between ranks, gloo picking the wrong network interface. Real machines
are not available in CI, so this module fakes them with Linux network
namespaces:

* a namespace ``nbddp-<id>-br`` holds a bridge (a virtual switch);
* each fake host is a namespace ``nbddp-<id>-h<i>`` with ``lo`` up and one
  veth interface ``nb<id>h<i>`` plugged into the bridge, addressed
  ``10.213.<net>.<i+1>/24``;
* every process of a fake host also runs in its own UTS namespace with the
  host name ``nbddp-<id>-h<i>``, and sees an ``/etc/hosts`` (through
  ``ip netns exec``'s ``/etc/netns/<ns>/`` overlay) naming every fake host.

Everything, addresses included, lives inside the namespaces: the root
namespace gets no interface, address or route, so a test cannot disturb the
machine's real network, and the fake hosts cannot reach it either.

The controller runs on host 0 and listens on host 0's address only (not
``0.0.0.0``); engines are started on the chosen hosts with ``--file`` pointing
at the engine connection file, as ``ipengine`` on a real remote host would.

How the client reaches the controller: the test process stays in the root
namespace, which has no route to ``10.213.x.x``. The client side therefore
runs in a subprocess started inside host 0's namespace
(:meth:`FakeCluster.run_in_host`). The alternatives were rejected:

* ``setns(2)`` on the test process (``os.setns`` only exists from Python
  3.12; ``ctypes`` works on 3.11) switches only the calling *thread*, while
  pyzmq's I/O threads, which own the sockets, stay where they were created;
  switching the whole process back and forth under pytest is fragile.
* A second controller listener reachable from the root namespace would need
  a veth end with an address and a route in the root namespace (a change to
  the real machine), and ipyparallel binds all its sockets to one ``--ip``.

A subprocess is also what a real notebook kernel on a head node is: a client
process on one of the hosts.

Every process started here is killed by its pid (its process group, which it
leads), and then every process still inside one of *our* namespaces (the
engines' nannies, leftovers of ``run_in_host``) is killed: such a namespace
is created by this module under a random name, so whatever runs in it was
started by this module. Then the namespaces are deleted, which destroys the
bridge and the veth pairs with them. This happens even if the body raised.

Requires root, ``ip`` from iproute2 (``apt-get install -y iproute2`` in CI
images that lack it), and a kernel allowing network namespaces, bridges and
veth pairs. Use :func:`netns_available` to skip cleanly elsewhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FakeCluster", "FakeHost", "add_engine", "fake_hosts", "fake_network", "host_command", "netns_available"]

_NETNS_ETC = Path("/etc/netns")
_KILL_GRACE_S = 5.0
_POLL_S = 0.05
_REGISTERED = re.compile(r"Completed registration with id (\d+)")

# Runs first in every fake-host process (after ``ip netns exec``): moves the
# process into a new UTS namespace, sets the fake host name there, then execs
# the real command. The unshare is checked before ``sethostname``: setting the
# name without it would rename the real machine. With ``_PRIVATE_SHM`` set
# (``fake_hosts(private_shm=True)``) the process also gets a mount namespace of
# its own, made a slave of the real one (nothing propagates back), with its
# host's folder bound on /dev/shm (the value is its path: the host's memory,
# shared by its engines and outliving them), or a fresh tmpfs (the value
# ``1``: a host that lost its memory). Either way a host that does not share
# the kernel's /dev/shm.
_PRIVATE_SHM = "NETNS_HOSTS_PRIVATE_SHM"
_TRAMPOLINE = """\
import ctypes, os, socket, sys
CLONE_NEWUTS, CLONE_NEWNS, MS_BIND, MS_REC, MS_SLAVE = 0x04000000, 0x00020000, 0x1000, 0x4000, 0x80000
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(CLONE_NEWUTS) != 0:
    sys.exit("netns_hosts: unshare(CLONE_NEWUTS) failed: "
             + os.strerror(ctypes.get_errno()))
shm = os.environ.pop("NETNS_HOSTS_PRIVATE_SHM", "")
if shm:
    fresh = shm == "1"
    if (libc.unshare(CLONE_NEWNS) != 0 or libc.mount(None, b"/", None, MS_REC | MS_SLAVE, None) != 0
            or (libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, b"mode=1777") if fresh else
                libc.mount(shm.encode(), b"/dev/shm", None, MS_BIND, None)) != 0):
        sys.exit("netns_hosts: a private /dev/shm failed: " + os.strerror(ctypes.get_errno()))
if os.readlink("/proc/self/ns/uts") == sys.argv[2]:
    sys.exit("netns_hosts: still in the root UTS namespace, not renaming")
socket.sethostname(sys.argv[1])
os.execv(sys.argv[3], sys.argv[3:])
"""


@dataclass(frozen=True)
class FakeHost:
    """One fake host: a network namespace with one address.

    Attributes:
        index: position in :attr:`FakeCluster.hosts`.
        namespace: the network namespace name (``ip netns exec`` accepts it).
        address: the host's IPv4 address, without prefix length.
        interface: the name of its veth interface (for ``GLOO_SOCKET_IFNAME``
            or ``NCCL_SOCKET_IFNAME``).
        hostname: what ``socket.gethostname()`` returns on this host.
    """

    index: int
    namespace: str
    address: str
    interface: str
    hostname: str


@dataclass
class FakeCluster:
    """What :func:`fake_hosts` yields: the fake hosts and the cluster on them.

    Attributes:
        run_id: the random part of every name of this run.
        bridge_namespace: the namespace holding the bridge.
        hosts: the fake hosts; the controller runs on ``hosts[0]``.
        profile_dir: the IPython profile directory of the controller (and, in
            this fake, of the engines, which read the same connection file).
        cluster_id: the ipyparallel cluster id.
        controller_pid: pid of the controller process.
        engine_pids: host index -> pids of the engines started on that host.
        engine_ids: host index -> ipyparallel engine ids registered from that
            host, in start order (read from the engines' logs).
        client_file: the client connection file,
            ``<profile_dir>/security/ipcontroller-<cluster_id>-client.json``.
        engine_file: the engine connection file.
        log_dir: where the controller's and engines' output goes.
        host_shm: host index -> the folder its engines see as /dev/shm
            (``private_shm``): the host's memory, outliving its engines.
    """

    run_id: str
    bridge_namespace: str
    hosts: tuple[FakeHost, ...]
    profile_dir: Path
    cluster_id: str
    controller_pid: int = 0
    engine_pids: dict[int, list[int]] = field(default_factory=dict)
    engine_ids: dict[int, list[int]] = field(default_factory=dict)
    client_file: Path = Path()
    engine_file: Path = Path()
    log_dir: Path = Path()
    host_shm: dict[int, Path] = field(default_factory=dict)
    _made_etc_netns: bool = field(default=False, repr=False)

    @property
    def namespaces(self) -> list[str]:
        """Every namespace of this run: the hosts', then the bridge's."""
        return [h.namespace for h in self.hosts] + [self.bridge_namespace]

    @property
    def addresses(self) -> list[str]:
        """The hosts' addresses, in host order."""
        return [h.address for h in self.hosts]

    def describe(self) -> dict[str, object]:
        """A JSON-able description, also given to ``run_in_host`` scripts."""
        return {
            "run_id": self.run_id,
            "profile_dir": str(self.profile_dir),
            "cluster_id": self.cluster_id,
            "client_file": str(self.client_file),
            "engine_file": str(self.engine_file),
            "controller_pid": self.controller_pid,
            "hosts": [vars(h) for h in self.hosts],
            "engine_pids": {str(k): v for k, v in self.engine_pids.items()},
            "engine_ids": {str(k): v for k, v in self.engine_ids.items()},
        }

    def namespace_pids(self) -> dict[str, list[int]]:
        """The pids of every process now inside one of this run's namespaces."""
        return {ns: _netns_pids(ns) for ns in self.namespaces}

    def run_in_host(
        self,
        host_index: int,
        source: str | os.PathLike[str],
        *,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float = 120.0,
        check: bool = False,
    ) -> subprocess.CompletedProcess[str]:
        """Run Python on a fake host, as a process of that host would run.

        This is how a test reaches the controller (see the module docstring):
        put the client side in a script and run it on host 0.

        Args:
            host_index: which host (``0`` holds the controller).
            source: Python code as a ``str``, or a script as a path object
                (``pathlib.Path``). A ``str`` is always taken as code.
            args: command-line arguments for the code (``sys.argv[1:]``).
            env: variables added to (overriding) this process's environment.
                ``NBDDP_FAKE_HOSTS`` is always set to :meth:`describe` as JSON.
            timeout: seconds before the script's process group is killed and
                ``subprocess.TimeoutExpired`` is raised.
            check: raise ``subprocess.CalledProcessError`` on a non-zero exit.

        Returns:
            The finished process, with ``stdout`` and ``stderr`` as text.
        """
        host = self._host(host_index)
        if isinstance(source, str):
            py_args = ["-c", source]
        else:
            py_args = [os.fspath(source)]
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        full_env["NBDDP_FAKE_HOSTS"] = json.dumps(self.describe())
        cmd = host_command(host, [sys.executable, *py_args, *args])
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=full_env,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, out, err) from None
        result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
        if check:
            result.check_returncode()
        return result

    def _host(self, host_index: int) -> FakeHost:
        if not 0 <= host_index < len(self.hosts):
            raise IndexError(
                f"host_index={host_index} is out of range: this fake cluster has "
                f"{len(self.hosts)} hosts (0..{len(self.hosts) - 1})."
            )
        return self.hosts[host_index]


def netns_available() -> tuple[bool, str]:
    """Whether :func:`fake_hosts` can work here, and if not, why.

    Creates a probe namespace holding a bridge, then deletes it: being root
    is not enough inside some containers, which refuse ``ip netns add``.

    Returns:
        ``(True, "")`` or ``(False, reason)``, the reason ready for
        ``pytest.skip``.
    """
    if not sys.platform.startswith("linux"):
        return False, f"network namespaces need Linux, this is {sys.platform}"
    if os.geteuid() != 0:
        return False, "network namespaces need root (run the netns tests as root)"
    if shutil.which("ip") is None:
        return False, "`ip` not found: install iproute2 (apt-get install -y iproute2)"
    probe = f"nbddp-probe-{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", probe)
    except RuntimeError as e:
        return False, f"`ip netns add` failed: {e}"
    try:
        _ip("-n", probe, "link", "add", "nbprobe", "type", "bridge")
    except RuntimeError as e:
        return False, f"cannot create a bridge in a network namespace: {e}"
    finally:
        with contextlib.suppress(RuntimeError):
            _ip("netns", "del", probe)
    return True, ""


@contextlib.contextmanager
def fake_hosts(
    n_hosts: int = 2,
    engines_per_host: int = 1,
    profile_dir: str | os.PathLike[str] | None = None,
    *,
    engine_hosts: Sequence[int] | None = None,
    engine_env: Mapping[str, str] | None = None,
    start_timeout: float = 60.0,
    private_shm: bool = False,
) -> Iterator[FakeCluster]:
    """Start a controller and engines on ``n_hosts`` fake hosts.

    Args:
        n_hosts: number of fake hosts (1 to 250).
        engines_per_host: engines started on each host of ``engine_hosts``.
        profile_dir: the IPython profile directory to use (created if
            missing; pass pytest's ``tmp_path / "profile"``). ``None`` makes a
            temporary one, deleted on exit.
        engine_hosts: the hosts that get engines; all hosts by default. Pass
            e.g. ``[1, 2]`` to keep the controller's host free of engines.
        engine_env: variables added to the engines' environment (not the
            controller's).
        start_timeout: seconds to wait for the controller's connection files,
            then again for every engine to be registered with the controller
            (a Client connecting then sees them all in ``ids`` at once).
        private_shm: give every host a /dev/shm of its own (a folder bound on
            /dev/shm in each engine's own mount namespace), shared by that
            host's engines and outliving them, as a machine's memory outlives
            its processes: nbddp then sees the engines as not sharing the
            kernel's file system. Removed on exit.

    Yields:
        The running :class:`FakeCluster`. On exit, even after an error, every
        process is killed and every namespace deleted.

    Raises:
        ValueError: on an invalid argument.
        RuntimeError: if a command fails, or the controller or an engine does
            not come up in time (the message ends with the tail of its log).
    """
    if not 1 <= n_hosts <= 250:
        raise ValueError(f"n_hosts must be between 1 and 250, got {n_hosts}")
    if engines_per_host < 0:
        raise ValueError(f"engines_per_host must be >= 0, got {engines_per_host}")
    hosts_with_engines = list(
        range(n_hosts) if engine_hosts is None else dict.fromkeys(engine_hosts)
    )
    bad = [i for i in hosts_with_engines if not 0 <= i < n_hosts]
    if bad:
        raise ValueError(
            f"engine_hosts={list(engine_hosts or [])} names hosts {bad} that do not "
            f"exist: with n_hosts={n_hosts} the hosts are 0..{n_hosts - 1}."
        )

    # the hosts' memory goes last, once every process in the namespaces is gone (fake_network's exit)
    with contextlib.ExitStack() as memory, fake_network(n_hosts, profile_dir) as cluster, \
            contextlib.ExitStack() as stack:
        procs: list[subprocess.Popen[bytes]] = []
        stack.callback(_stop_processes, cluster, procs)
        controller = _start_controller(cluster, procs, start_timeout)
        if private_shm:
            for i in hosts_with_engines:
                cluster.host_shm[i] = Path(tempfile.mkdtemp(prefix=f"netns-shm-h{i}-"))
                cluster.host_shm[i].chmod(0o1777)
                memory.callback(shutil.rmtree, cluster.host_shm[i], True)
        _start_engines(
            cluster, procs, controller, hosts_with_engines, engines_per_host, engine_env,
            start_timeout,
        )  # fmt: skip
        yield cluster


@contextlib.contextmanager
def fake_network(
    n_hosts: int, profile_dir: str | os.PathLike[str] | None = None
) -> Iterator[FakeCluster]:
    """The fake hosts alone, with no process on them (``fake_hosts`` starts ipyparallel there).

    For tests that run something else on the hosts (``tests/slurm_cluster.py``
    starts a Slurm): start processes with :func:`host_command`. On exit every
    process left inside the namespaces is killed, then the namespaces are
    deleted, even if the body raised.
    """
    if not 1 <= n_hosts <= 250:
        raise ValueError(f"n_hosts must be between 1 and 250, got {n_hosts}")
    run_id = secrets.token_hex(3)
    net = secrets.randbelow(256)
    prefix = f"nbddp-{run_id}"
    hosts = tuple(
        FakeHost(
            index=i,
            namespace=f"{prefix}-h{i}",
            address=f"10.213.{net}.{i + 1}",
            interface=f"nb{run_id}h{i}",
            hostname=f"{prefix}-h{i}",
        )
        for i in range(n_hosts)
    )
    with contextlib.ExitStack() as stack:
        if profile_dir is None:
            profile = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix=prefix)))
        else:
            profile = Path(profile_dir)
        profile.mkdir(parents=True, exist_ok=True)
        cluster = FakeCluster(
            run_id=run_id,
            bridge_namespace=f"{prefix}-br",
            hosts=hosts,
            profile_dir=profile,
            cluster_id=prefix,
            log_dir=profile / "log",
        )
        cluster.log_dir.mkdir(exist_ok=True)
        # Registered before anything is created, so a half-built network is
        # torn down too; runs after the processes' cleanup (LIFO).
        stack.callback(_delete_network, cluster)
        _create_network(cluster)
        stack.callback(_stop_processes, cluster, [])
        yield cluster


def _create_network(cluster: FakeCluster) -> None:
    """Bridge namespace, host namespaces, veth pairs, addresses, /etc/hosts."""
    br_ns, bridge = cluster.bridge_namespace, f"nb{cluster.run_id}br"
    _ip("netns", "add", br_ns)
    _ip("-n", br_ns, "link", "add", bridge, "type", "bridge")
    _ip("-n", br_ns, "link", "set", bridge, "up")
    cluster._made_etc_netns = not _NETNS_ETC.exists()
    hosts_file = "127.0.0.1 localhost\n" + "".join(
        f"{h.address} {h.hostname}\n" for h in cluster.hosts
    )
    for h in cluster.hosts:
        port = f"nb{cluster.run_id}b{h.index}"
        _ip("netns", "add", h.namespace)
        # Created directly in the two namespaces: never visible in the root one.
        _ip("link", "add", "name", h.interface, "netns", h.namespace,
            "type", "veth", "peer", "name", port, "netns", br_ns)  # fmt: skip
        _ip("-n", br_ns, "link", "set", port, "master", bridge, "up")
        _ip("-n", h.namespace, "link", "set", "lo", "up")
        _ip("-n", h.namespace, "addr", "add", f"{h.address}/24", "dev", h.interface)
        _ip("-n", h.namespace, "link", "set", h.interface, "up")
        etc = _NETNS_ETC / h.namespace
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text(hosts_file)


def _start_controller(
    cluster: FakeCluster,
    procs: list[subprocess.Popen[bytes]],
    timeout: float,
) -> subprocess.Popen[bytes]:
    """Start the controller on host 0, bound to host 0's address only.

    It checks hearts every second, as the controllers nbddp starts do (``HEARTBEAT_MS`` in
    nbddp/cluster/engines.py), not every 3 s (ipyparallel's default): the hub accepts an engine only
    after its heart answered, so each fake cluster took 6.7 s to start instead of 2.7.
    """
    host = cluster.hosts[0]
    security = cluster.profile_dir / "security"
    cluster.client_file = security / f"ipcontroller-{cluster.cluster_id}-client.json"
    cluster.engine_file = security / f"ipcontroller-{cluster.cluster_id}-engine.json"
    log = cluster.log_dir / "netns-controller.log"
    proc = _spawn(
        host,
        ["-m", "ipyparallel.controller", f"--profile-dir={cluster.profile_dir}",
         f"--cluster-id={cluster.cluster_id}", f"--ip={host.address}",
         f"--location={host.address}", "--log-level=INFO", "--HeartMonitor.period=1000"],  # fmt: skip
        log,
        None,
    )
    procs.append(proc)
    cluster.controller_pid = proc.pid
    _wait_for(
        lambda: _is_json(cluster.client_file) and _is_json(cluster.engine_file),
        proc,
        log,
        timeout,
        what=f"the controller's connection files in {security}",
    )
    return proc


def _start_engines(
    cluster: FakeCluster,
    procs: list[subprocess.Popen[bytes]],
    controller: subprocess.Popen[bytes],
    engine_hosts: Sequence[int],
    per_host: int,
    env: Mapping[str, str] | None,
    timeout: float,
) -> None:
    """Start the engines like ``ipengine --file=...`` on a remote host, wait."""
    started: list[tuple[int, subprocess.Popen[bytes], Path]] = []
    for i in engine_hosts:
        host = cluster.hosts[i]
        for j in range(per_host):
            log = cluster.log_dir / f"netns-engine-h{i}-{j}.log"
            proc = _spawn(
                host,
                ["-m", "ipyparallel.engine", f"--profile-dir={cluster.profile_dir}",
                 f"--cluster-id={cluster.cluster_id}", f"--file={cluster.engine_file}",
                 "--log-level=INFO"],  # fmt: skip
                log,
                {**(env or {}), **_memory_env(cluster, i)},
            )
            procs.append(proc)
            cluster.engine_pids.setdefault(i, []).append(proc.pid)
            started.append((i, proc, log))
    deadline = time.monotonic() + timeout
    for i, proc, log in started:
        _wait_for(
            lambda log=log: _REGISTERED.search(_read(log)) is not None,
            proc,
            log,
            max(deadline - time.monotonic(), 0.0),
            what=f"engine pid {proc.pid} on host {i} ({cluster.hosts[i].namespace}) to register",
        )
        match = _REGISTERED.search(_read(log))
        assert match is not None
        cluster.engine_ids.setdefault(i, []).append(int(match.group(1)))
    # The engine logs "Completed registration" at once, but the hub counts it
    # (and a Client sees it) only after its first heartbeats, a second or two later.
    hub_log = cluster.log_dir / "netns-controller.log"
    for i, ids in cluster.engine_ids.items():
        for eid in ids:
            connected = re.compile(rf"(?m)Engine Connected: {eid}$")
            _wait_for(
                lambda connected=connected: connected.search(_read(hub_log)) is not None,
                controller,
                hub_log,
                max(deadline - time.monotonic(), 0.0),
                what=f"the controller to accept engine {eid} from host {i}",
            )


def add_engine(cluster: FakeCluster, host_index: int, *, private_shm: bool = False) -> subprocess.Popen[bytes]:
    """Start one more engine on a host of a running cluster, as a launcher restarting a lost one would.

    With ``private_shm`` it gets a fresh, empty /dev/shm (a host that lost its memory with its engine); else,
    in a ``fake_hosts(private_shm=True)`` cluster, the host's own (its memory outlived the lost engine). It is
    not waited for: the caller waits for what it needs (its registration). On the cluster's exit it is killed
    with everything else in the namespaces; the caller still reaps the returned process.
    """
    host = cluster._host(host_index)
    n = len(cluster.engine_pids.get(host_index, []))
    proc = _spawn(host, ["-m", "ipyparallel.engine", f"--profile-dir={cluster.profile_dir}",
                         f"--cluster-id={cluster.cluster_id}", f"--file={cluster.engine_file}", "--log-level=INFO"],
                  cluster.log_dir / f"netns-engine-h{host_index}-{n}.log",
                  {_PRIVATE_SHM: "1"} if private_shm else _memory_env(cluster, host_index))
    cluster.engine_pids.setdefault(host_index, []).append(proc.pid)
    return proc


def _memory_env(cluster: FakeCluster, host_index: int) -> dict[str, str]:
    """What makes an engine see its host's memory as /dev/shm (nothing: the machine's own)."""
    shm = cluster.host_shm.get(host_index)
    return {_PRIVATE_SHM: os.fspath(shm)} if shm is not None else {}


def _spawn(
    host: FakeHost, py_args: list[str], log: Path, env: Mapping[str, str] | None
) -> subprocess.Popen[bytes]:
    """Start ``python <py_args>`` on ``host``, output to ``log``.

    ``start_new_session`` makes the process lead its own group, so it and its
    ordinary children can be killed by its pid alone.
    """
    with log.open("wb") as out:
        return subprocess.Popen(
            host_command(host, [sys.executable, *py_args]),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )


def host_command(host: FakeHost, argv: list[str]) -> list[str]:
    """``argv`` as run on ``host``: its network namespace, /etc/hosts, name.

    ``ip netns exec`` and the trampoline both ``exec``: the pid of the
    resulting process is the pid of ``argv``'s program.
    """
    root_uts = os.readlink("/proc/self/ns/uts")
    return ["ip", "netns", "exec", host.namespace, sys.executable, "-c", _TRAMPOLINE,
            host.hostname, root_uts, *argv]  # fmt: skip


def _wait_for(
    condition: Callable[[], bool],
    proc: subprocess.Popen[bytes], log: Path, timeout: float, what: str
) -> None:
    """Poll ``condition()`` until true; fail early if ``proc`` exits."""
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise RuntimeError(
                f"Gave up waiting for {what}: the process exited with "
                f"{proc.returncode}. Its log ({log}) ends with:\n{_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"Gave up waiting for {what} after {timeout:.0f} s. "
                f"Its log ({log}) ends with:\n{_tail(log)}"
            )
        time.sleep(_POLL_S)


def _stop_processes(cluster: FakeCluster, procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGTERM then SIGKILL what we started, then anything left in our namespaces."""
    for proc in reversed(procs):  # engines first, so they need not wait for the hub
        if proc.poll() is None:
            _kill_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + _KILL_GRACE_S
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        else:
            # The leader is gone; its group may not be.
            _kill_group(proc.pid, signal.SIGKILL)
    # Processes outside those groups (ipyparallel's nanny starts its own
    # session) or left by run_in_host: in a namespace of ours, hence ours.
    for _ in range(50):
        leftovers = [pid for pids in cluster.namespace_pids().values() for pid in pids]
        if not leftovers:
            return
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(_POLL_S)
    raise RuntimeError(f"processes {leftovers} survived SIGKILL in {cluster.namespaces}")


def _delete_network(cluster: FakeCluster) -> None:
    """Delete our namespaces (the veth pairs and the bridge go with them)."""
    errors = []
    for ns in cluster.namespaces:
        if (Path("/run/netns") / ns).exists() or (Path("/var/run/netns") / ns).exists():
            try:
                _ip("netns", "del", ns)
            except RuntimeError as e:
                errors.append(str(e))
        shutil.rmtree(_NETNS_ETC / ns, ignore_errors=True)
    if cluster._made_etc_netns:
        with contextlib.suppress(OSError):
            _NETNS_ETC.rmdir()  # only if empty: another run may use it now
    if errors:
        raise RuntimeError("Could not delete every namespace:\n" + "\n".join(errors))


def _kill_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _netns_pids(ns: str) -> list[int]:
    try:
        out = _ip("netns", "pids", ns)
    except RuntimeError:
        return []  # the namespace is gone
    return [int(p) for p in out.split()]


def _ip(*args: str) -> str:
    """Run ``ip args``; raise RuntimeError with its stderr on failure."""
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")
    return proc.stdout


def _is_json(path: Path) -> bool:
    """Whether ``path`` holds complete JSON (it may exist half-written)."""
    try:
        json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return False
    return True


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(_read(path).splitlines()[-lines:])
