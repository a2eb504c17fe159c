"""Elastic fits (issue 33): a lost rank is replaced and the same fit goes on, with an unbroken run's weights.

The option checks run in the kernel alone; the rest kill engines on the
suite's 2 CPU gloo workers (``faults``), through ``elastic_kit.KillAt``.
"""

from __future__ import annotations

import datetime
import glob
import json
import os
import threading
import time

from types import SimpleNamespace

import pytest
import torch

import nbddp
from elastic_kit import KillAt, KillLayer, armed
from faultkit import Net, regression_data
from nbddp.cluster.engines import Workers
from nbddp.elastic.policy import check_elastic
from nbddp.elastic.spare import Spare
from nbddp.protocol.errors import ClusterError, RankFailure, WorkerDied, WorkerError
from nbddp.protocol.fit_options import FitConfig
from nbddp.elastic import replacements
from nbddp.elastic.replacements import await_replacements
from nbddp.worker.checkpoints import background, files, snapshots
from nbddp.worker.tasks.snapshot_folder import remove_snapshot_folder
from nbddp.protocol.notes import shm_dir

STEPS = 24  # 512 samples, 16 per rank, 2 ranks: 16 steps an epoch; the fit crosses an epoch end


# ---------------------------------------------------------------- the options, checked in the kernel


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(max_restarts=-1), ValueError, r"max_restarts=-1.*0 \(the default"),
    (dict(max_restarts="3"), TypeError, r"max_restarts=\.\.\.\) must be an int, got str"),
    (dict(max_restarts=1, snapshot_every=0), ValueError, r"snapshot_every=0.*above 0 steps"),
    (dict(max_restarts=1, snapshot_every="0s"), ValueError, r"snapshot_every=0.0.*above 0 seconds"),
    (dict(max_restarts=1, snapshot_every="sometimes"), ValueError, r"snapshot_every='sometimes'.*'epoch'"),
    (dict(max_restarts=1, snapshot_every=2.5), ValueError, r"snapshot_every=2.5.*'30s'"),
    (dict(max_restarts=1, retry_on=[42]), TypeError, r"retry_on=.*42 is not one"),
    (dict(max_restarts=0, snapshot_every=10), ValueError, r"snapshot_every=\.\.\.\) takes effect only .*max_restarts"),
    (dict(retry_on=OSError), ValueError, r"retry_on=\.\.\.\) takes effect only"),
])
def test_bad_elastic_options_are_named_with_the_fix(kwargs, error, match):
    args = {"max_restarts": 0, "snapshot_every": None, "retry_on": None, **kwargs}
    with pytest.raises(error, match=match):
        check_elastic(args["max_restarts"], args["snapshot_every"], args["retry_on"])


@pytest.mark.parametrize("given, read", [(None, "auto"), ("auto", "auto"), ("epoch", "epoch"), (50, 50),
                                         ("30s", 30.0), ("2min", 120.0), ("1 h", 3600.0),
                                         (datetime.timedelta(seconds=90), 90.0)])
def test_snapshot_every_takes_steps_epochs_and_durations(given, read):
    policy = check_elastic(2, given, None)
    assert policy.snapshot_every == read and type(policy.snapshot_every) is type(read)
    assert check_elastic(0, None, None).restarts is False


def test_what_is_retried():
    """Deaths and broken collectives are; the person's own exception only when named in retry_on."""
    died = WorkerDied(RankFailure(1, "WorkerDied", "died"), "killed by signal 9 (SIGKILL)")
    own = WorkerError(RankFailure(1, "ValueError", "bad batch"))
    flaky = WorkerError(RankFailure(0, "OSError", "remote storage"))
    broken = WorkerError(RankFailure(0, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:1234"))
    policy = check_elastic(1, None, [OSError])
    assert policy.retries(died) and policy.retries(flaky) and policy.retries(broken)
    assert not policy.retries(own)


# ---------------------------------------------------------------- the warm spare engine, in the kernel


def test_a_spare_engine_is_no_rank_nor_is_one_still_registering():
    client = SimpleNamespace(ids=[0, 1])
    w = Workers(None, client, owned=True, can_add_engines=True)
    w.spare_baseline, client.ids = {0, 1}, [0, 1, 2]  # engine 2 registered while the spare starts
    assert w.ids == [0, 1]
    w.spare_ids.add(2)
    w.spare_baseline = None
    assert w.ids == [0, 1]
    w.wait_for(2, timeout=0.1)  # counts the ranks' engines only
    with pytest.raises(ClusterError, match="only 2 of 3 engines registered"):
        w.wait_for(3, timeout=0.1)


@pytest.mark.parametrize("change, allowed", [({}, True), ({"jobs": object()}, False), ({"owned": False}, False),
                                             ({"can_add_engines": False}, False), ({"local": False}, False),
                                             ({"closing": True}, False)])
def test_a_spare_is_kept_only_for_engines_this_session_starts_on_its_own_host(change, allowed):
    workers = SimpleNamespace(**{"owned": True, "can_add_engines": True, "jobs": None,
                                 **{k: v for k, v in change.items() if k in ("jobs", "owned", "can_add_engines")}})
    session = SimpleNamespace(workers=workers, supervisor=SimpleNamespace(closing=change.get("closing", False)),
                              placements=[SimpleNamespace(local=True), SimpleNamespace(local=change.get("local", True))])
    assert Spare(session).allowed() is allowed


# ---------------------------------------------------------------- snapshots on one rank, in this process


def test_a_snapshot_torn_mid_write_leaves_the_last_whole_one(tmp_path):
    """What a rank killed while writing leaves: its temporary, or a torn file; the previous snapshot is taken."""
    cfg = FitConfig(snapshot_dir=str(tmp_path), snapshot_every=2)
    files.save(str(tmp_path), 4, {"model": {}, "optimizer": {}, "step": 4, "epoch": 0})
    (tmp_path / "step-00000006.pt.tmp-999999").write_bytes(b"PK\x03\x04half")
    (tmp_path / "step-00000008.pt").write_bytes(b"PK\x03\x04torn")
    assert snapshots.latest(cfg) == files.path_for(str(tmp_path), 4)
    assert snapshots.latest(FitConfig(snapshot_dir=str(tmp_path / "none"))) is None


class _Replicated:
    """A strategy's snapshot seam on one process: rank 0 copies a tensor, the writer's thread writes it."""

    def __init__(self, gate: threading.Event | None = None, fail_at: int | None = None):
        self.weight = torch.zeros(4)
        self.gate, self.fail_at = gate, fail_at

    def save_snapshot(self, directory, step, optimizer, extra, rank, writer):
        state = writer.stage({"model": {"w": self.weight}, "optimizer": {}, **extra})

        def write():
            if self.gate is not None:
                assert self.gate.wait(10)
            if step == self.fail_at:  # half a file under the temporary name, then the write fails
                with open(files.path_for(directory, step) + f".tmp-{os.getpid()}", "wb") as f:
                    f.write(b"PK\x03\x04half")
                raise OSError(28, "No space left on device")
            files.save(directory, step, state, private=True)
        return write


def _loaded_weight(path: str) -> torch.Tensor:
    return files.load(path)["model"]["w"]


def test_snapshots_are_written_off_the_step_owner_only_and_the_last_two_kept(tmp_path):
    """The step returns with the write still to come; what it wrote is the state at the step, not after it."""
    clock = snapshots.SnapshotClock(FitConfig(snapshot_dir=str(tmp_path), snapshot_every=3), torch.device("cpu"))
    assert [s for s in range(1, 10) if clock.due(s, sync_step=False)] == [3, 6, 9] and not clock.at_epoch_end
    gate = threading.Event()
    strategy = _Replicated(gate)
    for step in (3, 6, 9):
        strategy.weight.fill_(step)
        clock.write(strategy, step, None, {"step": step, "epoch": 0}, rank=0)
        assert clock.writer.busy and not os.path.exists(files.path_for(str(tmp_path), step))  # not yet written
        strategy.weight.fill_(-1.0)  # training goes on: the host copy keeps the step's weights
        gate.set()
        clock.writer.wait()
        gate.clear()
        assert _loaded_weight(files.path_for(str(tmp_path), step)).eq(step).all()
    clock.close()
    kept = sorted(os.listdir(tmp_path))
    assert kept == ["step-00000006.pt", "step-00000009.pt"] and clock.count == 3 and clock.writer.write_s > 0
    assert {oct(os.stat(tmp_path / k).st_mode & 0o777) for k in kept} == {"0o600"}


def test_a_snapshot_write_that_fails_half_way_leaves_the_previous_one_and_says_so(tmp_path):
    clock = snapshots.SnapshotClock(FitConfig(snapshot_dir=str(tmp_path), snapshot_every=2), torch.device("cpu"))
    strategy = _Replicated(fail_at=4)
    strategy.weight.fill_(2.0)
    clock.write(strategy, 2, None, {"step": 2, "epoch": 0}, rank=0)
    strategy.weight.fill_(4.0)
    clock.write(strategy, 4, None, {"step": 4, "epoch": 0}, rank=0)  # its write fails in the thread
    clock.writer._thread.join()
    found = snapshots.latest(FitConfig(snapshot_dir=str(tmp_path)))
    assert found == files.path_for(str(tmp_path), 2) and _loaded_weight(found).eq(2.0).all()
    with pytest.raises(RuntimeError, match=r"writing an elastic fit's snapshot failed \(OSError: .*No space left.*"
                                           r"the previous snapshot is kept.*/dev/shm is full"):
        clock.write(strategy, 6, None, {"step": 6, "epoch": 0}, rank=0)  # the next snapshot learns of it
    clock.close()


def test_the_fit_end_waits_for_the_last_write_and_a_failed_one_does_not_fail_it(tmp_path):
    clock = snapshots.SnapshotClock(FitConfig(snapshot_dir=str(tmp_path), snapshot_every=2), torch.device("cpu"))
    clock.write(_Replicated(fail_at=2), 2, None, {"step": 2, "epoch": 0}, rank=0)
    clock.close()  # the fit's own outcome stands; the snapshots go with the fit anyway
    assert not clock.writer.busy and snapshots.latest(FitConfig(snapshot_dir=str(tmp_path))) is None


def test_inline_snapshots_are_written_on_the_training_thread_for_the_benchmarks_a_b(tmp_path, monkeypatch):
    monkeypatch.setenv(background.INLINE_ENV, "1")
    clock = snapshots.SnapshotClock(FitConfig(snapshot_dir=str(tmp_path), snapshot_every=2), torch.device("cpu"))
    assert clock.writer.inline and clock.writer.stage({"w": torch.ones(2)})["w"].sum() == 2
    clock.writer.submit(lambda: files.save(str(tmp_path), 2, {"model": {}, "optimizer": {}, "step": 2, "epoch": 0}))
    assert not clock.writer.busy and os.path.exists(files.path_for(str(tmp_path), 2))  # written before submit returned
    clock.close()


@pytest.mark.requires_gpu
def test_a_cuda_snapshot_is_a_copy_into_pinned_host_buffers_kept_across_snapshots():
    """The step's copy: device to pinned host memory, the same buffers at the next snapshot, the state at the copy."""
    writer = background.Writer(torch.device("cuda:0"))
    weight = torch.full((1024,), 1.0, device="cuda:0")
    first = writer.stage({"model": {"w": weight}, "step": 1})
    weight.fill_(2.0)  # the training step after the snapshot: the copy was synchronised before stage returned
    assert first["model"]["w"].device.type == "cpu" and first["model"]["w"].is_pinned()
    assert first["model"]["w"].eq(1.0).all()
    second = writer.stage({"model": {"w": weight}, "step": 2})
    assert second["model"]["w"].data_ptr() == first["model"]["w"].data_ptr() and second["model"]["w"].eq(2.0).all()
    writer.close()


def test_a_lost_engine_of_an_attached_cluster_is_waited_for_then_the_error_says_what_to_start():
    workers = SimpleNamespace(ids=[0])
    started = threading.Timer(0.2, lambda: setattr(workers, "ids", [0, 3]))  # its launcher starts one again
    started.start()
    await_replacements(workers, 1, 2, timeout=30)
    started.join()
    with pytest.raises(ClusterError, match=r"1 engine\(s\) of this attached cluster died during an elastic fit .*"
                                           r"within 0 s; nbddp cannot start engines.*`ipengine --file="):
        await_replacements(SimpleNamespace(ids=[0]), 1, 2, timeout=0.2)


def test_an_engine_removes_only_a_snapshot_folder_in_its_shared_memory(tmp_path):
    folder = os.path.join(shm_dir(), f"nbddp-test-{os.getpid()}-snap-{time.monotonic_ns()}")
    os.mkdir(folder, 0o700)
    open(os.path.join(folder, "step-00000004.pt"), "wb").close()
    assert remove_snapshot_folder(folder) is True and not os.path.exists(folder)
    assert remove_snapshot_folder(folder) is False
    with pytest.raises(ValueError, match=r"not an elastic fit's snapshot folder in /dev/shm"):
        remove_snapshot_folder(str(tmp_path))


# ---------------------------------------------------------------- lost ranks, on the workers


def _snapshot_folders(session) -> list[str]:
    return glob.glob(os.path.join(shm_dir(), f"{session.file_prefix}-snap-*"))


def _fit(step_fn, live=False, **elastic):
    torch.manual_seed(0)
    model = Net()
    h = nbddp.dist_fit(model, regression_data(), batch_size=16, max_steps=STEPS, epochs=2, live=live, seed=3,
                       step_fn=step_fn, **elastic)
    return h, {k: v.clone() for k, v in model.state_dict().items()}


_REFERENCE: list = []


@pytest.fixture
def unbroken(workers):
    """The reference: the same fit, no snapshot, no kill (run once for the module)."""
    if not _REFERENCE:
        _REFERENCE.append(_fit(KillAt()))
    return _REFERENCE[0]


@pytest.mark.faults
@pytest.mark.timeout(240)
@pytest.mark.parametrize("rank", [1, 0])
def test_sigkill_mid_fit_the_same_call_ends_with_the_unbroken_weights(workers, unbroken, tmp_path, rank, capsys):
    marker = armed(str(tmp_path / "kill"))
    before = [p.pid for p in workers.placements]
    h, weights = _fit(KillAt([(rank, 11, marker)]), live="text", max_restarts=2, snapshot_every=4)
    assert h.status == "completed" and not os.path.exists(marker)
    for name, want in unbroken[1].items():
        assert torch.equal(weights[name], want), name
    (event,) = h.restarts
    # lost at: the furthest step the kernel had seen (records and heartbeats, about once a second), not ahead of 10
    assert event["rank"] == rank and event["step_resumed_from"] == 8 and 8 <= event["step_lost_at"] <= 10
    assert "SIGKILL" in event["cause"] or "closed" in event["cause"] or "reset" in event["cause"]
    assert 0 < event["replace_s"] <= event["seconds"]
    steps = [r["step"] for r in h.steps]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # replayed steps overwrite, never duplicate
    assert len(h.epochs) == 1 and h.epochs[0]["loss"] == pytest.approx(unbroken[0].epochs[0]["loss"], abs=1e-6)
    after = [p.pid for p in workers.placements]
    assert set(after) & set(before) == {before[1 - rank]} and _snapshot_folders(workers) == []
    # the survivor raised on its own and was kept; the warm spare engine took the lost rank's place
    assert workers.supervisor.last_heal["started"] == 0
    spare = workers.supervisor.spare
    spare.wait()  # the next one, started once the fit resumed
    assert spare.engine_id is not None and spare.engine_id not in [p.engine_id for p in workers.placements]
    assert workers.workers.pids[spare.engine_id] in workers.workers.all_pids()  # stopped with the workers
    shown = capsys.readouterr().out  # the text view says what happened (its final lines: the restart, the time split)
    assert f"rank {rank} lost at step {event['step_lost_at']} (" in shown and "; resumed from step 8" in shown


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_after_max_restarts_the_fit_fails_saying_so(workers, tmp_path):
    """Two deaths in one fit: it cannot be faster than two heals, each a fresh engine started (60-85 s here)."""
    first, second = armed(str(tmp_path / "first")), armed(str(tmp_path / "second"))
    with pytest.raises(WorkerError, match=r"restarted 1 time\(s\) and max_restarts=1 were all used"):
        _fit(KillAt([(1, 3, first), (1, 5, second)]), max_restarts=1, snapshot_every=4)
    assert not os.path.exists(first) and not os.path.exists(second)
    assert _snapshot_folders(workers) == []
    workers.wait_healed(raise_error=True)


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_an_exception_in_the_persons_code_is_not_retried(workers, tmp_path):
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with pytest.raises(WorkerError, match=r"not retried: ValueError.*retry_on=\[ValueError\]"):
        nbddp.dist_fit(Net(fail=(1, 3, "raise", str(tmp_path / "raised"))), regression_data(), batch_size=16,
                       max_steps=8, live=False, max_restarts=3, snapshot_every=2)
    assert time.perf_counter() - t0 < 30 and _snapshot_folders(workers) == []
    workers.wait_healed(raise_error=True)


@pytest.mark.faults
@pytest.mark.timeout(120)
def test_snapshots_are_owner_only_and_gone_after_the_fit(workers, tmp_path):
    modes = str(tmp_path / "modes.json")
    # by time: about 10 steps a second, a snapshot at the first synchronisation step after each second
    h, _ = _fit(KillAt(prefix=workers.file_prefix, modes=modes, modes_at=STEPS, delay=0.1), max_restarts=1,
                snapshot_every="1s")
    with open(modes) as f:
        seen = json.load(f)
    folders = [p for p in seen if os.path.dirname(p) == shm_dir()]
    assert len(folders) == 1 and seen[folders[0]] == "0o700"
    files = {p: m for p, m in seen.items() if p not in folders}
    assert files and set(files.values()) == {"0o600"}, files
    assert len([p for p in files if p.endswith(".pt")]) <= 2  # the last two: the double buffer
    assert h.restarts == [] and 1 <= h.timings["snapshots"] <= 3 and _snapshot_folders(workers) == []


def _stack(marker: str) -> torch.nn.Module:
    """Three linear layers, then the kill switch: on rank 1 (a pipeline's last stage holds it)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 1), KillLayer(1, 21, marker))


@pytest.mark.faults
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["fsdp", nbddp.Pipeline(stages=2, microbatches=2), nbddp.TensorParallel()],
                         ids=["fsdp", "pipeline", "tensor"])
def test_sharded_fits_recover_with_the_unbroken_weights(workers, tmp_path, strategy):
    """Each rank restores its own shard (or stage, or slice of each layer) from the snapshot it wrote.

    Rank 1 dies in its step 11: at its 11th forward, or 21st for a pipeline (2 micro-batches a step through
    rank 1's stage)."""
    calls = 21 if isinstance(strategy, nbddp.Pipeline) else 11

    def fit(marker: str, **elastic):
        model = _stack(marker)
        model[-1].call = calls
        h = nbddp.dist_fit(model, regression_data(), batch_size=16, max_steps=STEPS, epochs=2, live=False, seed=3,
                           strategy=strategy, **elastic)
        return h, model.state_dict()

    _, want = fit(str(tmp_path / "never"))
    h, got = fit(armed(str(tmp_path / "kill")), max_restarts=1, snapshot_every=4)
    assert h.status == "completed" and len(h.restarts) == 1 and h.restarts[0]["rank"] in (0, 1)
    assert max((got[k] - want[k]).abs().max().item() for k in want) <= 1e-6
    assert _snapshot_folders(workers) == []


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_a_stall_past_stall_timeout_is_a_failure_that_restarts(workers, unbroken, tmp_path):
    marker = armed(str(tmp_path / "stall"))
    h, weights = _fit(KillAt([(1, 11, marker, "stall")]), max_restarts=1, snapshot_every=4, stall_timeout=8)
    assert h.status == "completed" and len(h.restarts) == 1
    assert all(torch.equal(weights[name], want) for name, want in unbroken[1].items())
    assert "WorkerStalled" in h.restarts[0]["cause"] and h.restarts[0]["step_resumed_from"] == 8
    assert _snapshot_folders(workers) == []


@pytest.mark.faults
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_killing_rank_0_while_it_writes_a_snapshot_resumes_from_the_previous_one(workers):
    """Rank 0 (which writes a DDP fit's snapshot) is SIGKILLed mid-write of a 128 MB model's snapshot.

    It cannot be much faster: the write must last long enough to be caught (a big model, a snapshot every
    step), and a fresh engine is started and loads it (80 s here on a shared 2-core machine).
    """
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4096, generator=g), torch.randn(64, 4096, generator=g)
    rank0 = workers.placements[0].pid
    big = lambda: torch.nn.Sequential(torch.nn.Linear(4096, 4096, bias=False),  # noqa: E731
                                      torch.nn.Linear(4096, 4096, bias=False))
    handle = nbddp.dist_fit(big, (x, y), epochs=100, max_steps=8, batch_size=2, optimizer=torch.optim.SGD, lr=1e-3,
                            block=False, live=False, max_restarts=1, snapshot_every=1)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        folders = _snapshot_folders(workers)
        done = [p for f in folders for p in glob.glob(os.path.join(f, "step-*.pt"))]
        tmps = [p for f in folders for p in glob.glob(os.path.join(f, f"step-*.pt.tmp-{rank0}"))]
        if done and tmps and os.path.getsize(tmps[0]) > (1 << 20):
            break
        time.sleep(0.005)
    else:
        pytest.fail("no snapshot was being written")
    os.kill(rank0, 9)
    h = handle.wait(timeout=240)
    assert h.status == "completed" and h.last_step == 8 and len(h.restarts) == 1
    assert h.restarts[0]["rank"] == 0 and h.restarts[0]["step_resumed_from"] >= 1
    assert _snapshot_folders(workers) == []


# ---------------------------------------------------------------- no replacement: going on with fewer (min_workers)


def _no_replacement(session, monkeypatch) -> None:
    """A lost rank cannot be replaced: the session acts as on a cluster it attached to (nbddp starts no engine
    there), whose own replacement does not register within the heal's wait (1 s here), and no warm spare."""
    monkeypatch.setattr(session.workers, "can_add_engines", False)
    monkeypatch.setattr(session.supervisor, "spare", None)
    monkeypatch.setattr(replacements, "WAIT_S", 1.0)


@pytest.mark.faults
@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_with_no_replacement_min_workers_goes_on_with_one_rank_and_the_unbroken_weights(workers, unbroken, tmp_path,
                                                                                       monkeypatch, capsys, strategy):
    """FSDP: the 2 ranks' DCP snapshot is resharded for the one rank left as it loads."""
    if strategy == "fsdp":
        unbroken = _fit(KillAt(), strategy="fsdp")
    _no_replacement(workers, monkeypatch)
    marker = armed(str(tmp_path / "kill"))
    survivor = workers.placements[0].pid
    h, weights = _fit(KillAt([(1, 11, marker)]), live="text", max_restarts=1, snapshot_every=4, min_workers=1,
                      strategy=strategy)
    assert h.status == "completed" and not os.path.exists(marker)
    # one rank accumulating 2 batches of 16 sums the same 32 samples' gradients as 2 ranks' all-reduce: only the
    # order of the floating-point additions differs
    for name, want in unbroken[1].items():
        torch.testing.assert_close(weights[name], want, rtol=0, atol=1e-6)
    (event,) = h.restarts
    assert (event["rank"], event["world_size"], event["grad_accum"]) == (1, 1, 2)
    # FSDP's snapshot of step 8 is whole once both ranks' DCP writes end, which rank 1's death may precede
    assert event["step_resumed_from"] == 8 or (strategy == "fsdp" and event["step_resumed_from"] == 4)
    assert "no replacement registered within 1 s" in event["no_replacement"]
    steps = [r["step"] for r in h.steps]
    assert steps == sorted(set(steps)) and steps[-1] == STEPS  # the global batch kept: the same 16 steps an epoch
    assert h.epochs[0]["loss"] == pytest.approx(unbroken[0].epochs[0]["loss"], abs=1e-6)
    shown = capsys.readouterr().out
    going = "; going on with 1 of 2 ranks, accumulating 2 batches per step; resumed from step"
    assert f"{going} {event['step_resumed_from']}" in shown
    assert [p.pid for p in workers.placements] == [survivor] and workers.supervisor.regrow_to == 2
    assert _snapshot_folders(workers) == []
    monkeypatch.undo()  # replacements can start again: the next call heals back to 2 workers first
    again = nbddp.dist_fit(Net(), regression_data(64), batch_size=16, max_steps=2, live=False)
    assert again.status == "completed" and workers.world_size == 2 and workers.supervisor.regrow_to is None


@pytest.mark.faults
@pytest.mark.timeout(180)
def test_with_no_replacement_below_min_workers_the_fit_fails_naming_it(workers, tmp_path, monkeypatch):
    _no_replacement(workers, monkeypatch)
    marker = armed(str(tmp_path / "kill"))
    with pytest.raises(WorkerError, match=r"(?s)no replacement for the lost rank could start \(1 engine.*within 1 s\)"
                                         r".*the 1 worker\(s\) left would be below min_workers=2"):
        nbddp.dist_fit(Net(), regression_data(), batch_size=16, max_steps=8, live=False, seed=3,
                       step_fn=KillAt([(1, 3, marker)]), max_restarts=1, snapshot_every=2, min_workers=2)
    assert _snapshot_folders(workers) == [] and workers.supervisor.regrow_to == 2
    monkeypatch.undo()
    workers.supervisor.regrow()  # what the next call does first: back to 2 workers
    workers.wait_healed(raise_error=True)
    assert workers.world_size == 2 and workers.supervisor.regrow_to is None
