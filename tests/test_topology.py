"""Rank placement from fake probes: no processes needed."""

from __future__ import annotations

import random

import pytest

from nbddp.protocol.placement import Probe, TopologyError, assign, describe, interface_for, master_address, socket_interfaces


def probes(layout: dict[str, list[int]], gpus: int = 4) -> list[Probe]:
    """host -> engine ids; each host's address is 10.0.0.<i>."""
    out = []
    for i, (host, ids) in enumerate(layout.items()):
        for eid in ids:
            out.append(Probe(engine_id=eid, host=host, pid=1000 + eid, address=f"10.0.0.{i + 1}", cuda_devices=gpus,
                             interfaces={"lo": "127.0.0.1", "eth0": f"10.0.0.{i + 1}"}))
    return out


def test_two_hosts_four_gpus_any_registration_order():
    layout = {"a": [0, 2, 4, 6], "b": [1, 3, 5, 7]}  # engines registered interleaved
    expected = None
    for seed in range(5):
        ps = probes(layout)
        random.Random(seed).shuffle(ps)
        placed = assign(ps, "nccl")
        got = [(p.rank, p.host, p.local_rank, p.device, p.engine_id) for p in placed]
        expected = expected or got
        assert got == expected, "placement must not depend on probe order"
    assert [p.host for p in placed] == ["a"] * 4 + ["b"] * 4
    assert [p.local_rank for p in placed] == [0, 1, 2, 3] * 2
    assert [p.device for p in placed] == [f"cuda:{i}" for i in range(4)] * 2
    assert all(p.world_size == 8 and p.local_world_size == 4 for p in placed)
    assert master_address(placed) == "10.0.0.1"


def test_replaced_engines_get_new_ids_and_ranks_stay_dense():
    # engines 1 and 3 died; 8 and 9 replaced them on host b
    placed = assign(probes({"a": [0, 2], "b": [8, 9]}, gpus=2), "nccl")
    assert [p.rank for p in placed] == [0, 1, 2, 3]
    assert [(p.host, p.local_rank, p.engine_id) for p in placed] == [("a", 0, 0), ("a", 1, 2), ("b", 0, 8), ("b", 1, 9)]


def test_host_order_follows_first_engine():
    placed = assign(probes({"late": [5, 6], "early": [2, 9]}, gpus=0), "gloo")
    assert placed[0].host == "early" and placed[0].engine_id == 2
    assert all(p.device == "cpu" for p in placed)


def test_single_host_master_is_loopback():
    placed = assign(probes({"only": [3, 1]}, gpus=0), "gloo")
    assert master_address(placed) == "127.0.0.1"
    assert [p.engine_id for p in placed] == [1, 3]


def test_nccl_without_gpus_is_refused():
    with pytest.raises(TopologyError, match=r"nccl.*needs GPUs.*'a' see none"):
        assign(probes({"a": [0], "b": [1]}, gpus=0), "nccl")


def test_more_engines_than_gpus_is_refused():
    with pytest.raises(TopologyError, match=r"runs 3 engines but sees 2 GPU"):
        assign(probes({"a": [0, 1, 2]}, gpus=2), "nccl")


def test_hosts_with_different_gpu_counts_are_refused():
    ps = probes({"a": [0, 1]}, gpus=2) + [Probe(engine_id=5, host="b", pid=5, address="10.0.0.9", cuda_devices=4)]
    with pytest.raises(TopologyError, match=r"hosts differ in their GPUs"):
        assign(ps, "nccl")


def test_no_engines_is_refused():
    with pytest.raises(TopologyError, match="no engines are registered"):
        assign([], "gloo")


def test_interface_is_the_one_carrying_the_address():
    assert interface_for("10.0.0.2", {"lo": "127.0.0.1", "eth1": "10.0.0.2"}) == "eth1"
    assert interface_for("192.168.1.1", {"lo": "127.0.0.1"}) is None


def test_master_across_hosts_is_never_loopback():
    placed = assign(probes({"a": [0], "b": [1]}, gpus=0), "gloo")
    assert master_address(placed) == "10.0.0.1"
    looped = [Probe(engine_id=0, host="a", pid=1, address="127.0.0.1"), Probe(engine_id=1, host="b", pid=2, address="10.0.0.2")]
    with pytest.raises(TopologyError, match=r"2 hosts, but rank 0 \(host 'a'\) reaches the controller through '127.0.0.1'.*--ip="):
        master_address(assign(looped, "gloo"))


def test_socket_interfaces_default_to_the_controller_facing_one():
    ps = probes({"a": [0, 1], "b": [2]}, gpus=0)
    placed = assign(ps, "gloo")
    assert socket_interfaces(placed, ps, None) == {0: "eth0", 1: "eth0", 2: "eth0"}
    unknown = [Probe(engine_id=0, host="a", pid=1, address="10.0.0.1", interfaces={"lo": "127.0.0.1"})]
    assert socket_interfaces(assign(unknown, "gloo"), unknown, None) == {0: None}  # leave gloo's own choice


def test_socket_interface_option_must_exist_on_every_host():
    ps = probes({"a": [0], "b": [1]}, gpus=0)
    placed = assign(ps, "gloo")
    assert socket_interfaces(placed, ps, "eth0") == {0: "eth0", 1: "eth0"}
    with pytest.raises(TopologyError, match=r"interface='ib0'\): host 'a' \(rank 0\) has no such network interface; it has \['eth0', 'lo'\]"):
        socket_interfaces(placed, ps, "ib0")


def test_describe_shows_host_and_address():
    rows = describe(assign(probes({"a": [4], "b": [2]}, gpus=0), "gloo"))
    assert [(r["rank"], r["host"], r["address"], r["engine"]) for r in rows] == [(0, "b", "10.0.0.2", 2), (1, "a", "10.0.0.1", 4)]


def test_gloo_with_fewer_gpus_than_workers_shares_them_round_robin():
    placed = assign(probes({"a": [0, 1, 2]}, gpus=2), "gloo")
    assert [p.device for p in placed] == ["cuda:0", "cuda:1", "cuda:0"]
    placed = assign(probes({"a": [0, 1]}, gpus=1), "gloo")
    assert [p.device for p in placed] == ["cuda:0", "cuda:0"]
    with pytest.raises(TopologyError, match=r"runs 2 engines but sees 1 GPU"):
        assign(probes({"a": [0, 1]}, gpus=1), "nccl")
