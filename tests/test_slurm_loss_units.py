"""An elastic fit's lost Slurm job, without a Slurm: which ends are retried, what the fit resumes from, the errors.

The real thing (a node going down under a fit, a new job, the same fit
going on) is in tests/test_slurm.py; these check the decisions it is made of.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic_kit import FakeRun
from nbddp.cluster.slurm.queue import GONE, JobState
from nbddp.cluster.slurm.watch import SlurmJobs
from nbddp.elastic import job_loss, snapshot_folder
from nbddp.execution.policy import FailurePolicy
from nbddp.elastic.recovery import Recovery
from nbddp.protocol.errors import ClusterError, SlurmError
from nbddp.worker.tasks.held_snapshots import held


@pytest.mark.parametrize("state, retried, cause", [
    ("NODE_FAIL", True, "NODE_FAIL"), ("PREEMPTED", True, "PREEMPTED"), ("BOOT_FAIL", True, "BOOT_FAIL"),
    ("TIMEOUT", True, "TIMEOUT"), ("PENDING", True, "REQUEUED"), ("REQUEUED", True, "REQUEUED"),
    ("REQUEUE_HOLD", True, "REQUEUED"), ("SUSPENDED", True, "REQUEUED"),
    ("CANCELLED", False, "CANCELLED"), ("FAILED", False, "FAILED"), ("OUT_OF_MEMORY", False, "OUT_OF_MEMORY"),
    ("DEADLINE", False, "DEADLINE"), ("COMPLETED", False, "COMPLETED"), (GONE, False, GONE),
])
def test_which_job_ends_are_retried(state, retried, cause):
    assert job_loss.retried(state) is retried
    assert job_loss.cause(state) == cause
    assert (cause in job_loss.RETRIED) is retried and (cause in job_loss.NOT_RETRIED) is not retried


def _run(**kw):
    run = FakeRun()
    for name, value in kw.items():
        setattr(run, name, value)
    return run


def test_a_job_end_that_is_not_retried_says_why_and_what_is():
    recovery = Recovery(FailurePolicy(max_restarts=2))
    exc = SlurmError("Slurm job 42 was cancelled (scancel, or an administrator): CANCELLED", "42", "CANCELLED")
    assert not recovery.should_retry(_run(), exc)
    assert "not retried (max_restarts=2): CANCELLED: scancel is a decision" in str(exc)
    assert "A new job is retried after NODE_FAIL, PREEMPTED, BOOT_FAIL, TIMEOUT, REQUEUED" in str(exc)


def test_a_lost_job_is_retried_until_max_restarts_are_used():
    recovery = Recovery(FailurePolicy(max_restarts=1))
    exc = SlurmError("Slurm job 42 lost a node: NODE_FAIL (NodeDown)", "42", "NODE_FAIL")
    assert recovery.should_retry(_run(), exc)
    assert not Recovery(FailurePolicy()).should_retry(_run(), exc)  # max_restarts=0: today's error, as it was
    assert not recovery.should_retry(_run(stop_requested=True), exc)
    recovery.restarts.append({"job": "41"})
    assert not recovery.should_retry(_run(), exc)
    assert "restarted 1 time(s) and max_restarts=1 were all used; this lost job ends it" in str(exc)


def _file(step):
    """A DDP snapshot as held_snapshots.held() lists it: one whole file."""
    name = f"step-{step:08d}.pt"
    return {"path": f"/dev/shm/s/{name}", "have": [name], "needs": [name]}


H1 = {"host": "n1", "pieces": {8: _file(8), 6: _file(6)}, "checkpoints": {4: ("/shared/c/step-00000004.pt", 100.0)}}
H2 = {"host": "n2", "pieces": {}, "checkpoints": {4: ("/shared/c/step-00000004.pt", 100.0)}}


def test_the_newest_step_every_rank_can_read_is_chosen():
    # rank 0's snapshots are on n1 alone: the relaunch copies the newest to n2, so it is newer than the checkpoint
    assert job_loss.choose({"n1": H1, "n2": H2}, since=50.0) == ("/dev/shm/s/step-00000008.pt", job_loss.SNAPSHOT)
    # one host (a one-node job back on its node): its snapshot is newer than the checkpoint
    assert job_loss.choose({"n1": H1}, since=50.0) == ("/dev/shm/s/step-00000008.pt", "snapshot in /dev/shm")
    # no snapshot on any node of the new job: the shared checkpoint, if this fit wrote it
    bare = {**H1, "pieces": {}}
    assert job_loss.choose({"n1": bare, "n2": H2}, since=50.0) == ("/shared/c/step-00000004.pt", "checkpoint_dir")
    # a checkpoint written before this fit began is an earlier fit's: never resumed from
    assert job_loss.choose({"n1": bare, "n2": H2}, since=150.0) is None
    # the same step in both: the snapshot (memory reads faster)
    both = {"host": "n1", "pieces": {4: _file(4)}, "checkpoints": H1["checkpoints"]}
    assert job_loss.choose({"n1": both}, since=50.0)[1] == "snapshot in /dev/shm"
    assert job_loss.choose({}, since=0.0) is None


def test_a_sharded_snapshot_whose_files_only_the_nodes_together_hold_is_chosen():
    """n1 kept rank 0's files and the index, n3 (a node of the lost job) the copy of rank 1's: neither is whole."""
    needs = [".metadata", "__0_0.distcp", "__1_0.distcp", "loop.pt"]
    folder = "/dev/shm/s/step-00000012"
    n1 = {"host": "n1", "checkpoints": {},
          "pieces": {12: {"path": folder, "have": [".metadata", "__0_0.distcp", "loop.pt"], "needs": needs}}}
    n3 = {"host": "n3", "checkpoints": {},
          "pieces": {12: {"path": folder, "have": ["__1_0.distcp"], "needs": None}}}
    assert job_loss.choose({"n1": n1, "n3": n3}, since=0.0) == (folder, job_loss.SNAPSHOT)
    # without n3, rank 1's file is on no node: the shared checkpoint it is
    n1_shared = {**n1, "checkpoints": H1["checkpoints"]}
    assert job_loss.choose({"n1": n1_shared, "n2": H2}, since=50.0) == ("/shared/c/step-00000004.pt", "checkpoint_dir")


def test_held_lists_whole_snapshots_and_checkpoints(tmp_path):
    import torch

    snaps, ckpts = tmp_path / "snap", tmp_path / "ckpt"
    snaps.mkdir()
    ckpts.mkdir()
    torch.save({"step": 6}, snaps / "step-00000006.pt")
    (snaps / "step-00000008.pt").write_bytes(b"half a write")  # a rank killed mid-write: not whole
    torch.save({"step": 4}, ckpts / "step-00000004.pt")
    found = held(str(snaps), str(ckpts))
    assert found["pieces"] == {6: {"path": str(snaps / "step-00000006.pt"), "have": ["step-00000006.pt"],
                                   "needs": ["step-00000006.pt"]}}
    assert list(found["checkpoints"]) == [4] and found["checkpoints"][4][0] == str(ckpts / "step-00000004.pt")
    assert held(None, str(tmp_path / "none"))["checkpoints"] == {}


class _Answer:
    def __init__(self, value):
        self.value = value

    def get(self, timeout=None):
        return self.value


class _Engine:
    def __init__(self, value):
        self.value = value

    def apply_async(self, fn, *args):
        return _Answer(self.value)


def _job_run(holdings, step_lost_at=12, checkpoint_dir=None):
    placements = [SimpleNamespace(host=h, engine_id=i) for i, h in enumerate(holdings)]
    session = SimpleNamespace(placements=placements, client={i: _Engine(v) for i, v in enumerate(holdings.values())})
    cfg = SimpleNamespace(snapshot_dir="/dev/shm/s", checkpoint_dir=checkpoint_dir, resume=False)
    import time

    event = {"job": "42", "cause": "NODE_FAIL", "step_lost_at": step_lost_at, "new_job": "43"}
    return _run(session=session, config=cfg, policy=FailurePolicy(max_restarts=1), started_at=time.perf_counter()), event


PART = {"host": "n1", "checkpoints": {}, "pieces": {  # rank 0's files of a sharded snapshot
    8: {"path": "/dev/shm/s/step-00000008", "have": [".metadata", "__0_0.distcp", "loop.pt"],
        "needs": [".metadata", "__0_0.distcp", "__1_0.distcp", "loop.pt"]}, 6: _file(6) | {"have": []}}}


def test_nothing_surviving_for_every_rank_is_an_error_that_says_what_would_have():
    run, event = _job_run({"n1": PART, "n2": {**H2, "checkpoints": {}}})
    with pytest.raises(SlurmError, match="none of the fit's state survived where every rank") as caught:
        job_loss.resume_point(run, event)
    message = str(caught.value)
    assert "Slurm job 42 was lost at step 12 (NODE_FAIL) and nbddp submitted job 43" in message
    assert "n1: step 6 (in part), step 8 (in part); n2: none (a step is taken when each of its files is on some" \
        in message and "the fit has no checkpoint_dir" in message
    assert "dist_fit(checkpoint_dir=...) on a file system every node mounts" in message
    assert (caught.value.job_id, caught.value.state) == ("42", "NODE_FAIL")
    # a checkpoint_dir only one node sees (not shared) is named as such
    run, event = _job_run({"n1": {**PART, "checkpoints": H1["checkpoints"]}, "n2": {**H2, "checkpoints": {}}},
                          checkpoint_dir="/scratch/c")
    with pytest.raises(SlurmError, match=r"checkpoint_dir='/scratch/c' holds no checkpoint of this fit that every "
                                         r"node reads \(n1: step 4; n2: none\)"):
        job_loss.resume_point(run, event)
    # lost before its first step: nothing is lost by starting again as the first launch did
    run, event = _job_run({"n1": PART, "n2": H2}, step_lost_at=0)
    assert job_loss.resume_point(run, event) == (False, "the start: no step had been taken")


def _live_run(stop=False):
    cancelled = []
    jobs = SimpleNamespace(cancel=lambda: cancelled.append(True) or "")
    run = _run(session=SimpleNamespace(workers=SimpleNamespace(jobs=jobs)), restarts=["head; submitting a new job"])
    run.stop_requested = stop
    return run, cancelled


def test_the_new_job_is_shown_in_the_live_view_and_a_stop_cancels_it():
    run, cancelled = _live_run()
    line = job_loss.LiveJobLine(run, "Slurm job 42 lost at step 9 (NODE_FAIL)")
    line.show(JobState("43", "PENDING", "Resources"), 12.0, 0, 2)
    assert run.restarts == ["Slurm job 42 lost at step 9 (NODE_FAIL); new Slurm job 43: PENDING "
                                       "(Resources), 0:12"]
    line.show(JobState("43", "RUNNING", nodes="n[1-2]"), 15.0, 1, 2)
    assert run.restarts[-1].endswith("RUNNING on n[1-2], 1 of 2 engines registered, 0:15")
    assert run.updates == 2
    run.stop_requested = True
    with pytest.raises(ClusterError, match="stopped while Slurm job 43 was PENDING"):
        line.show(JobState("43", "PENDING", "Resources"), 16.0, 0, 2)
    assert cancelled == [True]


def test_a_stop_while_the_new_job_waits_ends_the_fit_with_a_slurm_error():
    def failed_heal(raise_error):
        raise ClusterError("replacing failed workers did not work: ClusterError: stopped while Slurm job 43 was "
                           "PENDING")

    run, _ = _live_run(stop=True)
    run.session.options = SimpleNamespace(slurm=SimpleNamespace(queue_timeout=None))
    run.session.supervisor = SimpleNamespace(recover=lambda killed, job_wait: None)
    run.session.wait_healed = failed_heal
    exc = SlurmError("lost", "42", "NODE_FAIL")
    with pytest.raises(SlurmError, match="the fit was stopped while its new job waited in Slurm's queue, so nbddp "
                                         "cancelled that job"):
        job_loss.new_job_ready(run, "Slurm job 42 lost at step 9 (NODE_FAIL)", exc)
    run.stop_requested = False  # not stopped: the heal's own error, as it was
    with pytest.raises(ClusterError, match="replacing failed workers did not work"):
        job_loss.new_job_ready(run, "Slurm job 42 lost at step 9 (NODE_FAIL)", exc)


def test_a_retired_job_is_no_longer_reported_as_ended(monkeypatch):
    states = {"41": JobState("41", "NODE_FAIL", "NodeDown"), "42": JobState("42", "RUNNING")}
    monkeypatch.setattr("nbddp.cluster.slurm.watch.query", lambda ids: {j: states[j] for j in ids})
    cluster = SimpleNamespace(engines={"a": SimpleNamespace(job_id="41"), "b": SimpleNamespace(job_id="42")})
    jobs = SlurmJobs(cluster)
    assert jobs.ended().state == "NODE_FAIL"
    jobs.retired.add("41")  # an elastic fit went on in job 42
    assert jobs.ended() is None


def test_the_end_of_a_fit_removes_its_snapshot_folder_on_the_other_hosts(tmp_path):
    asked = []

    class Engine:
        def apply_async(self, fn, path):
            asked.append((fn.__name__, path))
            return _Answer(True)

    folder = tmp_path / "nbddp-x-snap-1"
    folder.mkdir()
    placements = [SimpleNamespace(host="login", engine_id=0, local=True),
                  SimpleNamespace(host="n1", engine_id=1, local=False),
                  SimpleNamespace(host="n1", engine_id=2, local=False),
                  SimpleNamespace(host="n2", engine_id=3, local=False)]
    session = SimpleNamespace(group=SimpleNamespace(placements=placements), client={i: Engine() for i in range(4)},
                              workers=SimpleNamespace(job_problem=lambda: None))
    assert sorted(snapshot_folder.remove(str(folder), session)) == ["n1", "n2"]
    assert not folder.exists() and asked == [("remove_snapshot_folder", str(folder))] * 2
    session.workers.job_problem = lambda: JobState("42", "NODE_FAIL")  # its engines are gone with the job
    assert snapshot_folder.remove(str(folder), session) == []


def test_an_elastic_fit_over_several_nodes_without_checkpoint_dir_is_told_what_a_lost_job_would_cost():
    from nbddp.protocol.notices import NbddpWarning

    two = [SimpleNamespace(host="n1"), SimpleNamespace(host="n2")]
    session = SimpleNamespace(workers=SimpleNamespace(jobs=object()), placements=two)
    with pytest.warns(NbddpWarning, match="Slurm job over 2 nodes without checkpoint_dir.*Pass checkpoint_dir= on a "
                                          "file system the nodes share"):
        assert job_loss.advise(session, None)
    assert job_loss.advise(session, "/shared/runs") is None  # it will survive
    assert job_loss.advise(SimpleNamespace(workers=SimpleNamespace(jobs=None), placements=two), None) is None  # no Slurm
    assert job_loss.advise(SimpleNamespace(workers=session.workers, placements=two[:1]), None) is None  # one node


@pytest.mark.parametrize("found, resume", [(("/dev/shm/s/step-00000012", job_loss.SNAPSHOT), None),
                                           (("/shared/c/step-00000004.pt", "checkpoint_dir"),
                                            "/shared/c/step-00000004.pt")])
def test_a_surviving_snapshot_is_relaunched_from_the_snapshots_a_checkpoint_by_its_path(monkeypatch, found, resume):
    """A snapshot goes through the relaunch's own choice (which copies its files to the nodes that lack them)."""
    monkeypatch.setattr(job_loss, "_forget_lost_engines", lambda session: None)
    monkeypatch.setattr(job_loss, "new_job_ready", lambda run, head, exc: None)
    monkeypatch.setattr(job_loss, "resume_point", lambda run, event: found)
    relaunched = []
    jobs = SimpleNamespace(retired=set(), ids=["42", "43"])
    run = _run(session=SimpleNamespace(workers=SimpleNamespace(jobs=jobs)), relaunch=lambda resume: relaunched.append(resume))
    recovery = Recovery(FailurePolicy(max_restarts=1))
    event = job_loss.relaunch(recovery, run, SlurmError("lost", "42", "NODE_FAIL"), [12])
    assert relaunched == [resume] and event["resumed_from"] == found[1] and event["new_job"] == "43"
    assert recovery.restarts == [event] and recovery.pending is not None and event["replace_s"] is not None
    assert run.restarts == ["Slurm job 42 lost at step 12 (NODE_FAIL); submitting a new job"]
