"""From probed engines to ranks: rank, local rank, device, master address.

Pure functions over plain data, so the placement logic is tested with fake
probes (2 hosts x 4 GPUs, engines registering in any order, replaced
engines with new ids) without starting anything.

Rules:
* hosts are ordered by the smallest engine id on them (the host that came up
  first, usually the controller's, is rank 0's), engines within a host by id;
  ranks count through that order. Engine ids change when engines are
  replaced, so ranks are always derived again from the current probes.
* ``local_rank`` is the index within the host; with CUDA it is the GPU index
  (with gloo and more engines than GPUs, ``local_rank % gpus``: they share).
* rank 0's host address is the master address.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nbddp.protocol.errors import TopologyError


@dataclass(frozen=True)
class Probe:
    """What an engine said about itself (see ``nbddp.worker.tasks.probe.probe``)."""

    engine_id: int
    host: str
    pid: int
    address: str  # the address this engine reaches the controller from
    cuda_devices: int = 0
    same_host_as_kernel: bool = False
    python: str = ""
    torch_version: str = ""
    interfaces: dict[str, str] = field(default_factory=dict)  # name -> IPv4 address


@dataclass(frozen=True)
class Placement:
    """Where one rank lives."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    engine_id: int
    host: str
    pid: int
    device: str
    address: str
    local: bool  # shares the kernel's file system (shared-memory shipping)


def assign(probes: list[Probe], backend: str) -> list[Placement]:
    """Ranks for ``probes``, checked for what ``backend`` needs.

    Raises:
        TopologyError: no engines; ``nccl`` on an engine that sees no GPU; more
            engines on a host than it has GPUs; hosts with different numbers
            of engines per GPU layout under ``nccl``.
    """
    if not probes:
        raise TopologyError("no engines are registered; start some with nbddp.start(n=...)")
    by_host: dict[str, list[Probe]] = {}
    for p in sorted(probes, key=lambda p: p.engine_id):
        by_host.setdefault(p.host, []).append(p)
    hosts = sorted(by_host, key=lambda h: by_host[h][0].engine_id)
    if backend == "nccl":
        _check_gpus(by_host)
    world = len(probes)
    placements: list[Placement] = []
    for host in hosts:
        group = by_host[host]
        for local_rank, p in enumerate(group):
            # nccl: one rank per GPU (checked above). gloo with GPUs: ranks share them round-robin, so two
            # workers on one GPU can test a DDP setup; gloo moves CUDA tensors through host memory
            device = f"cuda:{local_rank % p.cuda_devices}" if p.cuda_devices else "cpu"
            placements.append(
                Placement(
                    rank=len(placements),
                    local_rank=local_rank,
                    world_size=world,
                    local_world_size=len(group),
                    engine_id=p.engine_id,
                    host=host,
                    pid=p.pid,
                    device=device,
                    address=p.address,
                    local=p.same_host_as_kernel,
                )
            )
    return placements


def _check_gpus(by_host: dict[str, list[Probe]]) -> None:
    counts = {host: (len(group), group[0].cuda_devices) for host, group in by_host.items()}
    for host, (engines, gpus) in counts.items():
        if gpus == 0:
            raise TopologyError(
                f"backend='nccl' needs GPUs, but the engines on host {host!r} see none. "
                "Use backend='gloo' for CPU training, or check CUDA_VISIBLE_DEVICES on that host."
            )
        if engines > gpus:
            raise TopologyError(
                f"host {host!r} runs {engines} engines but sees {gpus} GPU(s); nccl needs one GPU per engine. "
                f"Start at most {gpus} engine(s) there (nbddp.start(n={gpus}) on one machine)."
            )
    gpu_counts = {gpus for _, gpus in counts.values()}
    if len(gpu_counts) > 1:
        detail = ", ".join(f"{h}: {e} engines / {g} GPUs" for h, (e, g) in counts.items())
        raise TopologyError(
            f"hosts differ in their GPUs ({detail}); mixed hosts make local ranks and devices ambiguous. "
            "Use hosts of one kind, or start the same number of engines on each."
        )


def master_address(placements: list[Placement]) -> str:
    """Rank 0's reachable address (loopback when every rank is on one host).

    Raises:
        TopologyError: ranks on several hosts, but rank 0 reaches the
            controller only through loopback (or an unspecified address), so
            the other hosts could not reach its store.
    """
    if len({p.host for p in placements}) == 1:
        return "127.0.0.1"
    first = placements[0]
    if first.address.startswith("127.") or first.address in ("0.0.0.0", "", "localhost"):
        raise TopologyError(
            f"ranks run on {len({p.host for p in placements})} hosts, but rank 0 (host {first.host!r}) reaches the "
            f"controller through {first.address!r}, which the other hosts cannot reach. Make the controller listen on "
            "an address every host reaches (`ipcontroller --ip=<that address>`, or `ipcluster start --ip=...`)."
        )
    return first.address


def interface_for(address: str, interfaces: dict[str, str]) -> str | None:
    """The interface name that carries ``address`` (for GLOO/NCCL_SOCKET_IFNAME)."""
    for name, addr in interfaces.items():
        if addr == address:
            return name
    return None


def socket_interfaces(placements: list[Placement], probes: list[Probe], interface: str | None) -> dict[int, str | None]:
    """rank -> network interface for ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``.

    ``interface`` (the ``start(interface=...)`` option) is used on every rank,
    after checking that every host has it. By default each rank uses the
    interface carrying the address it reaches the controller from; ``None``
    (the interface is unknown) leaves gloo's and NCCL's own choice.

    Raises:
        TopologyError: ``interface`` is missing on a host.
    """
    by_engine = {pr.engine_id: pr for pr in probes}
    out: dict[int, str | None] = {}
    for p in placements:
        known = by_engine[p.engine_id].interfaces if p.engine_id in by_engine else {}
        if interface is not None:
            if known and interface not in known:
                raise TopologyError(
                    f"start(interface={interface!r}): host {p.host!r} (rank {p.rank}) has no such network interface; "
                    f"it has {sorted(known)}. Pass an interface every host has, or leave interface=None to use the "
                    "one each host reaches the controller through."
                )
            out[p.rank] = interface
        else:
            out[p.rank] = interface_for(p.address, known)
    return out


def describe(placements: list[Placement]) -> list[dict[str, Any]]:
    """Rows for ``status()`` tables."""
    return [
        {
            "rank": p.rank,
            "local_rank": p.local_rank,
            "host": p.host,
            "pid": p.pid,
            "device": p.device,
            "engine": p.engine_id,
            "address": p.address,
        }
        for p in placements
    ]
