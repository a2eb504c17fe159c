"""``start(slurm=...)``: the workers as one Slurm job, through ipyparallel's own Slurm launcher.

What is asked (``SlurmRequest``) is checked here, before anything is
submitted: a bad ``nodes``, a ``time`` Slurm cannot parse, ``sbatch``
missing from ``PATH`` fail at once. Then ``cluster()`` builds an
``ipyparallel.Cluster`` whose engine launcher is ipyparallel's
``SlurmEngineSetLauncher`` (``SlurmEngines`` adds only Slurm's own words
when ``sbatch`` refuses, and per-job node counts), with a batch template that
asks for what ipyparallel's default one cannot (GPUs, tasks per node): one
engine per GPU, or per CPU slot without GPUs, spread evenly over the nodes.
The controller runs here, on the kernel's machine, on the address this
machine uses to reach the nodes (never ``0.0.0.0``).
"""

from __future__ import annotations

import ipaddress
import logging
import numbers
import re
import shlex
import shutil
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from nbddp.protocol.errors import SlurmError
from nbddp.cluster.slurm.queue import run_slurm

if TYPE_CHECKING:
    from ipyparallel import Cluster

CPU_WORKERS_PER_NODE = 2  # without GPUs, as nbddp.start() on one machine
COMMANDS = ("sbatch", "squeue", "scancel")
# sbatch options nbddp sets from its own arguments: given in `sbatch=` they would break the engines' layout
OWNED_OPTIONS = {"--ntasks": "-n N", "-n": "-n N", "--ntasks-per-node": "-n N and --nodes", "--nodes": "--nodes",
                 "-N": "--nodes", "--partition": "--partition", "-p": "--partition", "--time": "--time",
                 "-t": "--time", "--account": "--account", "-A": "--account", "--gpus-per-node": "--gpus-per-node",
                 "--job-name": "(nbddp names the job)", "-J": "(nbddp names the job)", "--output": "(nbddp sets it)",
                 "-o": "(nbddp sets it)", "--array": "(one job, not an array)", "-a": "(one job, not an array)",
                 "--wrap": "(nbddp writes the batch script)"}
_TIME = re.compile(r"\d+|\d+:\d+|\d+:\d+:\d+|\d+-\d+|\d+-\d+:\d+|\d+-\d+:\d+:\d+")
_NAME = re.compile(r"[^\s{}'\"]+")


@dataclass(frozen=True)
class SlurmRequest:
    """What ``start(slurm={...})`` / ``%ddp start --slurm ...`` asks Slurm for (``restart()`` asks again)."""

    partition: str | None = None
    nodes: int = 1
    gpus_per_node: int = 0
    time: str | None = None
    account: str | None = None
    sbatch: tuple[str, ...] = ()
    queue_timeout: float | None = None
    controller_ip: str | None = None

    def layout(self, n: int | None, backend: str | None) -> tuple[int, str]:
        """(engines, backend): one engine per GPU (or ``CPU_WORKERS_PER_NODE`` per node), spread evenly."""
        per_node_max = self.gpus_per_node or None
        if n is None:
            n = self.nodes * (self.gpus_per_node or CPU_WORKERS_PER_NODE)
        if n < self.nodes or n % self.nodes:
            raise ValueError(f"start(n={n}) cannot be spread evenly over {self.nodes} Slurm node(s) (--nodes): "
                             f"use a multiple of {self.nodes}, e.g. n={self.nodes * max(1, n // self.nodes)}")
        if per_node_max is not None and n // self.nodes > per_node_max:
            raise ValueError(f"start(n={n}) over {self.nodes} node(s) is {n // self.nodes} engines per node, more than "
                             f"--gpus-per-node {per_node_max}: nbddp runs one engine per GPU. Use n<="
                             f"{self.nodes * per_node_max}, or more --nodes")
        if backend == "nccl" and not self.gpus_per_node:
            raise ValueError("start(backend='nccl', slurm=...) needs GPUs on the nodes: ask for them with "
                             "--gpus-per-node G (slurm={'gpus_per_node': G}), or use backend='gloo' on CPU nodes")
        return n, backend or ("nccl" if self.gpus_per_node else "gloo")

    def cluster(self, n: int, threads: int | None = None) -> Cluster:
        """An ``ipyparallel.Cluster`` (not started) whose engines are this request's Slurm job."""
        import ipyparallel as ipp
        from traitlets.config import Config

        from nbddp.cluster.engines import HEARTBEAT_MS
        from nbddp.cluster.slurm.launcher import SlurmEngines

        c = Config()
        c.SlurmEngines.batch_template = batch_template(self, threads)
        c.SlurmEngines.tasks_per_node = n // self.nodes
        c.SlurmEngines.submit_command = ["sbatch", *self.sbatch]
        return ipp.Cluster(engines=SlurmEngines, n=n, controller_ip=controller_address(self), config=c,
                           delay=0, log_level=logging.ERROR, shutdown_atexit=True,
                           controller_args=[f"--HeartMonitor.period={HEARTBEAT_MS}"])


# ``start(slurm=...)``: off (None, False), the defaults (True), a dict of SlurmRequest's fields, or a SlurmRequest
SlurmChoice: TypeAlias = "bool | Mapping[str, Any] | SlurmRequest | None"


def slurm_request(value: SlurmChoice, cluster: Cluster | None = None, attach: bool = False) -> SlurmRequest | None:
    """``start(slurm=...)`` checked: None/False -> None; True -> the defaults; a dict -> its settings.

    Raises before anything is submitted: TypeError/ValueError on a bad
    setting, ``SlurmError`` when Slurm's commands are not on ``PATH``.
    """
    if value is None or value is False:
        return None
    if cluster is not None or attach:
        raise ValueError("start(slurm=...) builds its own ipyparallel Cluster (ipyparallel's Slurm launcher), so it "
                         "cannot be combined with cluster=... or profile=/cluster_id=...: give one or the other")
    if isinstance(value, SlurmRequest):
        request = value
    elif value is True:
        request = SlurmRequest()
    elif isinstance(value, Mapping):
        request = _from_mapping(value)
    else:
        raise TypeError(f"start(slurm=...) must be True or a dict of Slurm settings (keys: "
                        f"{', '.join(SlurmRequest.__dataclass_fields__)}), got {type(value).__name__} {value!r}")
    require_commands()
    return request


def _from_mapping(value: Mapping[str, Any]) -> SlurmRequest:
    known = set(SlurmRequest.__dataclass_fields__)
    unknown = sorted(map(str, set(value) - known))
    if unknown:
        raise ValueError(f"start(slurm={{...}}) has no setting {', '.join(map(repr, unknown))}; "
                         f"the settings are {', '.join(sorted(known))}")
    v = dict(value)
    return SlurmRequest(
        partition=_name(v.get("partition"), "partition"), nodes=_count(v.get("nodes", 1), "nodes", 1),
        gpus_per_node=_count(v.get("gpus_per_node") or 0, "gpus_per_node", 0), time=check_time(v.get("time")),
        account=_name(v.get("account"), "account"), sbatch=check_sbatch_args(v.get("sbatch")),
        queue_timeout=_seconds(v.get("queue_timeout")), controller_ip=_address(v.get("controller_ip")))


def check_time(value: object) -> str | None:
    """A time limit in one of Slurm's formats ("minutes", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS",
    "UNLIMITED"/"INFINITE"), or an int of minutes; checked here because sbatch's own complaint comes late."""
    if value is None:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0:
        return str(int(value))
    text = value.strip() if isinstance(value, str) else None
    if text is not None and (_TIME.fullmatch(text) or text.upper() in ("UNLIMITED", "INFINITE")):
        return text
    raise ValueError(f"--time (slurm={{'time': ...}}) {value!r} is not a time Slurm can parse: use minutes (30), "
                     "MM:SS, HH:MM:SS (04:00:00), D-HH, D-HH:MM, D-HH:MM:SS (1-12:00:00) or UNLIMITED")


def check_sbatch_args(value: object) -> tuple[str, ...]:
    """Extra ``sbatch`` arguments (a string, split as a shell would, or a list), minus the ones nbddp owns."""
    if value is None:
        return ()
    if isinstance(value, str):
        try:
            args = shlex.split(value)
        except ValueError as exc:
            raise ValueError(f"--sbatch (slurm={{'sbatch': ...}}) {value!r} does not split like a shell line: {exc}") \
                from None
    elif isinstance(value, (list, tuple)) and all(isinstance(a, str) for a in value):
        args = list(value)
    else:
        raise TypeError(f"--sbatch (slurm={{'sbatch': ...}}) must be a string of sbatch arguments or a list of "
                        f"strings, got {type(value).__name__} {value!r}")
    for arg in args:
        flag = arg.split("=", 1)[0] if arg.startswith("--") else arg[:2]
        if flag in OWNED_OPTIONS:
            raise ValueError(f"--sbatch {arg!r}: nbddp sets {flag} itself; use {OWNED_OPTIONS[flag]} instead")
    return tuple(args)


def require_commands() -> None:
    """Slurm's client commands must be on ``PATH`` (the kernel's), or nothing can be submitted or watched."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        raise SlurmError(
            f"start(slurm=...) needs Slurm's {', '.join(missing)} on PATH, and this kernel does not find "
            f"{'it' if len(missing) == 1 else 'them'}. On a cluster's login node load Slurm before starting Jupyter "
            "(`module load slurm`), or add its bin folder to os.environ['PATH'] in the notebook; on Debian or "
            "Ubuntu install it with `apt-get install slurm-client`.")


def controller_address(request: SlurmRequest) -> str:
    """The address of this machine that the nodes reach: the one it uses to reach the first node it knows of.

    Asked of ``sinfo`` (the nodes' ``NodeAddr``, in the partition asked for);
    no packet is sent. ``controller_ip`` overrides it.
    """
    from nbddp.protocol.host import address_towards

    if request.controller_ip:
        return request.controller_ip
    argv = ["sinfo", "-h", "-N", "-o", "%o"]
    listed = run_slurm(argv + ["-p", request.partition]) if request.partition else None
    if listed is None or not listed.stdout.split():  # (no such partition: sbatch will say so in its own words)
        listed = run_slurm(argv)
    for name in dict.fromkeys(listed.stdout.split()):
        try:
            node = socket.gethostbyname(name)
        except OSError:
            continue
        mine = address_towards(node)
        if not ipaddress.ip_address(mine).is_loopback or ipaddress.ip_address(node).is_loopback:
            return mine  # (loopback only for nodes on this machine; otherwise there was no route)
    raise SlurmError(f"nbddp could not tell which address of this machine the Slurm nodes reach (`{' '.join(argv)}` "
                     f"gave {listed.stdout.strip() or listed.stderr.strip() or 'nothing'!r}). Pass it: "
                     "slurm={'controller_ip': '10.1.2.3'} (--controller-ip), this machine's address on the "
                     "cluster network.")


def batch_template(request: SlurmRequest, threads: int | None = None) -> str:
    """The batch script's template (ipyparallel fills ``{n}``, ``{cluster_id}``, ``{output_file}``...).

    With a template of its own ipyparallel adds nothing, so everything asked for is written here.
    ``--no-requeue``: after a node failure Slurm would put the job back in the queue, and start engines
    that no session waits for; nbddp reports NODE_FAIL instead, and ``restart()`` submits anew.
    """
    lines = ["#!/bin/bash", "#SBATCH --job-name=nbddp-{cluster_id}", "#SBATCH --export=ALL", "#SBATCH --no-requeue",
             "#SBATCH --output={output_file}", "#SBATCH --ntasks={n}", "#SBATCH --nodes={nodes}",
             "#SBATCH --ntasks-per-node={tasks_on_node}"]
    for flag, value in (("partition", request.partition), ("time", request.time), ("account", request.account),
                        ("gpus-per-node", request.gpus_per_node or None), ("cpus-per-task", threads)):
        if value is not None:
            lines.append(f"#SBATCH --{flag}={value}")
    cpus = f"--cpus-per-task={threads} " if threads else ""  # srun no longer inherits sbatch's (Slurm 22.05)
    return "\n".join([*lines, f"srun {cpus}{{program_and_args}}", ""])


def _name(value: object, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise ValueError(f"--{key} (slurm={{'{key}': ...}}) must be a Slurm name (no spaces, quotes or braces), "
                         f"got {value!r}")
    return value


def _count(value: object, key: str, least: int) -> int:
    flag = "--" + key.replace("_", "-")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{flag} (slurm={{'{key}': ...}}) must be an int, got {type(value).__name__} {value!r}")
    if int(value) < least:
        raise ValueError(f"{flag} (slurm={{'{key}': ...}}) must be >= {least}, got {value}")
    return int(value)


def _seconds(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not float(value) > 0:
        raise ValueError(f"--queue-timeout (slurm={{'queue_timeout': ...}}) must be seconds > 0 or None (wait as long "
                         f"as Slurm holds the job), got {value!r}")
    return float(value)


def _address(value: str | int | None) -> str | None:
    if value is None:
        return None
    try:
        addr = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"--controller-ip (slurm={{'controller_ip': ...}}) must be an IP address of this machine, "
                         f"got {value!r}") from None
    if addr.is_unspecified:
        raise ValueError(f"--controller-ip {value}: nbddp never lets the controller listen on every interface; give "
                         "this machine's address on the network the nodes use (see docs/multi-node.md, Security)")
    return str(addr)
