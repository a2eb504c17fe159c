"""``%ddp start --slurm`` against a real, private Slurm (tests/slurm_cluster.py).

One Slurm for the module: slurmctld and the notebook (a real ipykernel) on
the login host, a slurmd on each of two node hosts (network namespaces), so
the two ranks run on different hosts, in a job, and reach the kernel's
controller over the fake network. The scenarios run in file order on the
one kernel; each one starts the workers itself when it needs them, so any
one of them also runs alone (``-k``).

The workers are the kernel's own (``fresh_workers``): a Slurm job started
by that kernel, never the suite's shared ones, which this module does not
use (the reference fit is one process, on the same global batch).

Kernel > Interrupt is the real one (``KernelManager.interrupt_kernel``:
SIGINT to the kernel process), sent only while the cell runs and shows the
pending job; killing the kernel is a real SIGKILL of that process.
"""

from __future__ import annotations

import json
import subprocess
import time

import pytest

from kernel_cells import HELPERS
from slurm_cluster import LoginKernel, private_slurm, slurm_available

_OK, _WHY = slurm_available()
pytestmark = [pytest.mark.slurm, pytest.mark.notebook, pytest.mark.netns, pytest.mark.fresh_workers,
              pytest.mark.timeout(400), pytest.mark.skipif(not _OK, reason=f"Slurm tests skipped: {_WHY}")]

START = "%ddp start -n 2 --slurm --nodes 2 --time 15"
# the model, data and fit, built the same way in the test process (one machine) and in the kernel
BUILD = r"""
import torch

FIT = dict(epochs=2, batch_size=16, shuffle=False, seed=0, optimizer=torch.optim.SGD, lr=0.05, live=False)


def build():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(128, 8, generator=g)
    y = x @ torch.randn(8, 1, generator=g) + 0.1 * torch.randn(128, 1, generator=g)
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)), (x, y)
"""
TIMES: dict[str, float] = {}


@pytest.fixture(scope="module")
def slurm():
    t0 = time.monotonic()
    with private_slurm() as cluster:
        TIMES["slurm start"] = time.monotonic() - t0
        yield cluster
    print("\nSLURM-TIMES " + json.dumps({k: round(v, 2) for k, v in TIMES.items()}))


@pytest.fixture(scope="module")
def kernel(slurm):
    t0 = time.monotonic()
    k = LoginKernel(slurm)
    try:
        _ok(k.execute(HELPERS + "%load_ext nbddp\nimport json, os, time, nbddp\n" + BUILD))
        TIMES["kernel start"] = time.monotonic() - t0
        yield k
        if k.is_alive():
            k.execute("nbddp.stop()")
    finally:
        k.close()


def _ok(reply):
    assert reply.status == "ok", reply.text[-4000:]
    return reply


def _nbddp_jobs(slurm, all_states=False):
    return [j for j in slurm.jobs(all_states) if j["name"].startswith("nbddp-")]


def _running_job(kernel) -> str:
    """Start the workers in the kernel unless they run (restart them if their job ended); the id of their job."""
    jobs = _ok(kernel.execute("out(nbddp.status().get('slurm'))")).value
    if not jobs or jobs[-1]["state"] != "RUNNING":
        t0 = time.monotonic()
        _ok(kernel.execute(START if not jobs else "%ddp restart"))
        TIMES.setdefault("job start (submit to group formed)", time.monotonic() - t0)
        jobs = _ok(kernel.execute("out(nbddp.status().get('slurm'))")).value
    return jobs[-1]["job"]


def test_requests_slurm_refuses_get_slurms_own_message_at_once(slurm, kernel):
    reply = kernel.execute("%ddp start -n 2 --slurm --partition nope")
    assert reply.ename == "SlurmError", reply.text[-3000:]
    assert "Slurm refused the job: sbatch: error: invalid partition specified: nope" in reply.evalue
    reply = kernel.execute('%ddp start -n 2 --slurm --sbatch "--constraint=nope --comment=extra"')  # on sbatch's line
    assert reply.ename == "SlurmError" and "Invalid feature specification" in reply.evalue, reply.text[-3000:]
    reply = kernel.execute("%ddp start -n 3 --slurm --nodes 3")  # the partition has 2 nodes
    assert reply.ename == "SlurmError", reply.text[-3000:]
    assert "PENDING (PartitionNodeLimit): Slurm can never start this job as asked, so nbddp cancelled it" in reply.evalue
    assert reply.seconds < 15, reply.seconds
    assert _nbddp_jobs(slurm) == []
    TIMES["rejected request"] = reply.seconds


def test_a_pending_job_is_shown_and_interrupt_cancels_it(slurm, kernel):
    blocker = slurm.run("sbatch", "--parsable", "-N2", "--exclusive", "--job-name=blocker", "--wrap",
                        "sleep 600").stdout.strip()
    try:
        slurm.wait_for(lambda: [j for j in slurm.jobs() if j["id"] == blocker and j["state"] == "RUNNING"], 30,
                       "the blocking job to run")
        # queue_timeout: cancelled, named, with Slurm's reason
        reply = kernel.execute(START + " --queue-timeout 2")
        assert reply.ename == "SlurmError", reply.text[-3000:]
        assert "PENDING (Resources) for 0:0" in reply.evalue and "longer than queue_timeout=2 s" in reply.evalue

        sent = []

        def interrupt_when_shown(msg, so_far) -> None:  # like tests/interrupts.py: only while the cell runs, once
            last = so_far.shown[-1] if so_far.shown else ""
            if not sent and "PENDING (Resources), " in last and _clock(last) >= 3:
                sent.append(time.monotonic())
                kernel.interrupt()

        reply = kernel.execute(START, timeout=120, on_output=interrupt_when_shown)
        assert sent, reply.shown
        assert reply.ename == "KeyboardInterrupt", reply.text[-3000:]
        assert time.monotonic() - sent[0] < 10
        shown = [d for d in reply.shown if "PENDING" in d]
        job = shown[0].split()[2].rstrip(":")
        assert shown[0].startswith(f"Slurm job {job}: PENDING (Resources), 0:0"), shown
        assert len({_clock(d) for d in shown}) >= 2, shown  # one line, kept current: 0:01, 0:02, 0:03...
        assert reply.shown[-1].startswith(f"Slurm job {job}: cancelled (interrupted while PENDING (Resources))")
        states = {j["id"]: j["state"] for j in slurm.jobs(all_states=True)}
        assert states[job] == "CANCELLED" and [j["id"] for j in slurm.jobs()] == [blocker]
        TIMES["pending shown, then interrupted"] = reply.seconds
    finally:
        slurm.run("scancel", blocker)
    _ok(kernel.execute("assert not nbddp.status()['running']"))


def test_start_and_a_fit_equal_to_one_machine(slurm, kernel):
    """The reference is one process on one machine, on the same global batch: with ``shuffle=False``, rank r's
    k-th batch of 16 holds samples r, r+2, ... of the k-th 32, so together they are samples 32k..32k+31, and DDP's
    averaged gradient is that batch's (no engines are needed here for it)."""
    import torch

    ns: dict = {}
    exec(BUILD, ns)  # noqa: S102 - our own constant, shared with the kernel
    model, (x, y) = ns["build"]()
    opt = torch.optim.SGD(model.parameters(), lr=ns["FIT"]["lr"])
    for _ in range(ns["FIT"]["epochs"]):
        step = 2 * ns["FIT"]["batch_size"]  # the global batch: 2 ranks x 16
        for i in range(0, len(x), step):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[i:i + step]), y[i:i + step]).backward()
            opt.step()
    local = model.state_dict()

    job = _running_job(kernel)
    status = _ok(kernel.execute("%ddp status")).shown[-1]
    assert f"Slurm job {job}: RUNNING on n[1-2], elapsed " in status and " of 15:00" in status, status
    weights = slurm.root / "slurm-weights.pt"
    t0 = time.monotonic()
    reply = _ok(kernel.execute(f"""
def where():
    import os, socket
    return socket.gethostname(), os.environ["SLURM_JOB_ID"], os.environ["SLURMD_NODENAME"]
ran_on = nbddp.run(where)
st = nbddp.status()
model, data = build()
nbddp.dist_fit(model, data, **FIT)
torch.save(model.state_dict(), {str(weights)!r})
out([ran_on, st["hosts"], st["master"], st["slurm"]])
"""))
    TIMES["fit on the Slurm job"] = time.monotonic() - t0
    where, hosts, master, jobs = reply.value
    assert sorted(n for _, _, n in where) == ["n1", "n2"] and {j for _, j, _ in where} == {job}
    assert len(set(hosts)) == 2 and sorted(hosts) == sorted(h for h, _, _ in where)
    assert master.startswith("tcp://10.213.") and jobs[0]["nodes"] == "n[1-2]"

    remote = torch.load(weights)
    for name in local:
        torch.testing.assert_close(remote[name], local[name], rtol=1e-5, atol=1e-6, msg=f"parameter {name}")


def test_stop_leaves_no_job_in_squeue(slurm, kernel):
    job = _running_job(kernel)
    reply = _ok(kernel.execute("%ddp stop"))
    assert [j for j in slurm.jobs() if j["id"] == job] == []  # not even COMPLETING
    assert {j["id"]: j["state"] for j in slurm.jobs(all_states=True)}[job] == "CANCELLED"
    TIMES["stop"] = reply.seconds


def test_scancel_mid_fit_is_a_clear_error_then_restart_submits_a_new_job(slurm, kernel):
    job = _running_job(kernel)
    message, took = _fail_a_fit(slurm, kernel, "cancelled", lambda: slurm.run("scancel", job), (job, "CANCELLED"))
    assert f"Slurm job {job} was cancelled" in message and "nbddp.restart()" in message
    TIMES["scancel to error"] = took
    # the next call says so too, until restart submits a new job
    reply = kernel.execute("nbddp.run(len, [])")
    assert reply.ename == "SlurmError" and f"Slurm job {job} was cancelled" in reply.evalue
    t0 = time.monotonic()
    _ok(kernel.execute("%ddp restart"))
    TIMES["restart (a new job)"] = time.monotonic() - t0
    new = _running_job(kernel)
    assert new != job and [j["id"] for j in _nbddp_jobs(slurm)] == [new]
    _ok(kernel.execute("model, data = build()\nh = nbddp.dist_fit(model, data, **FIT)\nassert h.status == 'completed'"))


@pytest.mark.slow
def test_the_time_limit_mid_fit_names_timeout(slurm, kernel):
    """Slurm's own time limit ends the job under a fit: TIMEOUT, within 10 s of Slurm ending it.

    It cannot be faster: a time limit is whole minutes, and slurmctld checks limits every 30 s
    (``PERIODIC_TIMEOUT``), so the job must be a minute old and the end comes up to 30 s
    later. The test lowers the limit of the running job to one minute (``scontrol update``,
    as a user may lower their own job's), so the minute already run in the tests before
    counts, and times the error from when Slurm ended the job.
    """
    job = _running_job(kernel)
    message, took = _fail_a_fit(slurm, kernel, "time-limit", lambda: slurm.run(
        "scontrol", "update", f"JobId={job}", "TimeLimit=1"), (job, "TIMEOUT"),
        ends_later=f"Time limit exhausted for JobId={job}")
    assert f"Slurm job {job} reached its time limit: TIMEOUT" in message, message
    TIMES["time limit to error"] = took
    _ok(kernel.execute("%ddp restart"))  # and a new job trains
    new = _running_job(kernel)
    assert new != job and [j["id"] for j in _nbddp_jobs(slurm)] == [new]
    _ok(kernel.execute("model, data = build()\nh = nbddp.dist_fit(model, data, **FIT)\nassert h.status == 'completed'"))


def test_a_node_going_down_mid_fit_names_node_fail(slurm, kernel):
    job = _running_job(kernel)
    try:
        message, took = _fail_a_fit(slurm, kernel, "node-down", lambda: slurm.run(
            "scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=nbddp-test"), (job, "NODE_FAIL"))
    finally:
        slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)  # (it may be back already)
    assert f"Slurm job {job} lost a node: NODE_FAIL (NodeDown)" in message, message
    TIMES["node down to error"] = took
    slurm.wait_for(lambda: "idle" in slurm.run("sinfo", "-h", "-n", "n2", "-o", "%t").stdout, 30, "n2 to be back")


LOSS_STEP = r"""
def slow_step(model, batch):
    import time
    with open(MARK, "a") as f:
        f.write("step\n")
    time.sleep(0.3)
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)

def left_on_nodes():
    import glob, socket
    return socket.gethostname(), sorted(glob.glob("/dev/shm/nbddp-*-snap-*"))
"""


def _lose_the_job_mid_fit(slurm, kernel, name: str, fit_args: str, ready, job: str | None = None,
                          fault=None, wipe: tuple[str, ...] = (), preempt: bool = False) -> tuple:
    """A blocking elastic fit (live text view) whose job is lost once ``ready(mark)``: by ``fault(job)``, by a job
    of the urgent partition that preempts it (``preempt``: it holds both nodes until released), or by node n2
    going down. The urgent job ends, or n2 comes back, once the new job shows PENDING in the live view.
    ``wipe``: by then these nodes have also lost their memory (``_reboot_memory``), as nodes that rebooted have.

    Returns (the cell's reply, the lost job's id). Its value: ``restarts`` (the fit's) or ``failed`` (the
    SlurmError's job, state and message), and ``left``, each node's snapshot files after it.
    """
    release = slurm.root / f"release-{name}"
    release.unlink(missing_ok=True)
    if preempt:
        fault = lambda _job: slurm.run(  # noqa: E731 - both nodes, whole: no core is left for the nbddp job
            "sbatch", "-p", slurm.urgent, "-N", "2", "--exclusive", "--job-name", "urgent", "-o", "/dev/null",
            "--wrap", f"while [ ! -e {release} ]; do sleep 0.2; done")
    job = job or _running_job(kernel)
    mark = slurm.root / f"fit-{name}"
    mark.unlink(missing_ok=True)
    events: dict[str, float] = {}

    def drive(msg, so_far) -> None:
        if "lost" not in events and ready(mark):
            events["lost"] = time.monotonic()
            if fault is not None:
                fault(job)
                return
            slurm.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=nbddp-test")  # the job: NODE_FAIL
            # and drained, so that it does not come back on its own (ReturnToService) before the test sees the new
            # job wait for it
            slurm.run("scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=nbddp-test")
        elif (fault is None or preempt) and "lost" in events and "resume" not in events \
                and "; new Slurm job " in so_far.text and "PENDING" in so_far.text.rsplit("lost at step", 1)[-1]:
            events["resume"] = time.monotonic()
            if wipe:  # the lost job's processes are gone: nothing writes a snapshot any more
                _reboot_memory(slurm, wipe)
            if preempt:
                release.touch()
            else:
                slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)  # (it may be back already)

    try:
        reply = kernel.execute(f"MARK = {str(mark)!r}\n" + LOSS_STEP + f"""
model, data = build()
try:
    h = nbddp.dist_fit(model, data, **{{**FIT, "epochs": 8, "live": "text"}}, step_fn=slow_step, max_restarts=1,
                       {fit_args})
    torch.save(model.state_dict(), MARK + ".pt")
    ended = dict(restarts=h.restarts)
except nbddp.SlurmError as e:
    ended = dict(failed=[e.job_id, e.state, str(e)])
out(dict(ended, left=nbddp.run(left_on_nodes)))
""", timeout=360, on_output=drive)
    finally:
        if preempt:
            release.touch()
        elif fault is None:
            slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME", check=False)
    assert "lost" in events and ("resume" in events or (fault is not None and not preempt)), (events, reply.text[-6000:])
    if preempt:
        slurm.wait_for(lambda: not [j for j in slurm.jobs() if j["name"] == "urgent"], 30, "the urgent job to end")
    slurm.wait_for(lambda: slurm.run("sinfo", "-h", "-n", "n2", "-o", "%t").stdout.strip() in ("idle", "mix", "alloc"),
                   30, "n2 to be back")
    TIMES[f"lost job: {name}"] = reply.seconds
    return _ok(reply), job


def _reboot_memory(slurm, names: tuple[str, ...]) -> None:
    """These nodes lose the fit's snapshots in their /dev/shm, as a rebooted node does: removed inside each slurmd's
    mount namespace, where the node's private /dev/shm is (the test process has its own)."""
    for name in names:
        subprocess.run(["nsenter", "-t", str(slurm.pids[f"slurmd-{name}"]), "-m", "sh", "-c",
                        "rm -rf /dev/shm/nbddp-*-snap-*"], check=True, timeout=30)


def _unbroken_weights(epochs: int) -> dict:
    """The one-process reference on the same global batch (see test_start_and_a_fit_equal_to_one_machine)."""
    import torch

    ns: dict = {}
    exec(BUILD, ns)  # noqa: S102 - our own constant, shared with the kernel
    model, (x, y) = ns["build"]()
    opt = torch.optim.SGD(model.parameters(), lr=ns["FIT"]["lr"])
    step = 2 * ns["FIT"]["batch_size"]
    for _ in range(epochs):
        for i in range(0, len(x), step):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x[i:i + step]), y[i:i + step]).backward()
            opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_a_lost_job_is_resubmitted_and_the_fit_goes_on_from_the_snapshot_one_node_kept(slurm, kernel):
    """NODE_FAIL mid-fit with max_restarts=1 and a snapshot every 2 steps, and n2 rebooted (its memory lost) while
    the new job waits: a new job, shown PENDING in the live view until the node is back, then the same fit from
    the snapshot n1 kept, which the relaunch copies to n2, with the unbroken run's weights. (A checkpoint_dir is
    resumed from in the requeue test below.) It cannot be faster: a second job is submitted, waits for the node
    and starts its engines (about a minute)."""
    import torch

    reply, job = _lose_the_job_mid_fit(slurm, kernel, "lost-job", "snapshot_every=2",
                                       lambda mark: mark.exists() and len(mark.read_text().split()) >= 8,
                                       wipe=("n2",))
    assert "restarts" in reply.value, reply.text[-3000:]
    (event,) = reply.value["restarts"]
    assert (event["job"], event["cause"], event["resumed_from"]) == (job, "NODE_FAIL", "snapshot in /dev/shm"), event
    assert event["new_job"] not in (None, job) and event["step_resumed_from"] >= 2, event
    assert event["step_resumed_from"] % 2 == 0 and event["step_lost_at"] >= event["step_resumed_from"], event
    TIMES.update({"lost job: new job ready (replace_s)": event["replace_s"], "lost job: to resumed": event["seconds"]})
    shown = reply.text.split(f"Slurm job {job} lost at step", 1)[1]
    assert f"new Slurm job {event['new_job']}: PENDING" in shown, shown[:2000]
    assert f"resumed from step {event['step_resumed_from']} (snapshot in /dev/shm)" in shown, shown[-2000:]
    remote, local = torch.load(str(slurm.root / "fit-lost-job.pt")), _unbroken_weights(8)
    for key in local:
        torch.testing.assert_close(remote[key], local[key], rtol=1e-5, atol=1e-6, msg=f"parameter {key}")
    left = reply.value["left"]
    assert sorted(h for h, _ in left) == sorted(n.hostname for n in slurm.nodes.values()), left
    assert all(not files for _, files in left), left
    assert [j["id"] for j in _nbddp_jobs(slurm)] == [event["new_job"]]


@pytest.mark.slow
def test_a_lost_job_with_nothing_surviving_says_so_and_what_would_have(slurm, kernel):
    """A job of a higher-priority partition preempts the fit's job (Slurm's ``PREEMPTED``, retried as a lost job),
    and holds both nodes until the fit's new job waits. Without checkpoint_dir the snapshots live only in the
    nodes' /dev/shm (rank 0's and its peer copy); with both nodes' memory lost (rebooted) meanwhile, the new job
    has nothing to resume from, and the error says so, naming checkpoint_dir. It cannot be faster, for the same
    reasons as the test above: the lost job's engines must be unregistered, and a second job started."""
    reply, job = _lose_the_job_mid_fit(slurm, kernel, "nothing-left", "snapshot_every=2",
                                       lambda mark: mark.exists() and len(mark.read_text().split()) >= 8,
                                       wipe=("n1", "n2"), preempt=True)
    assert "failed" in reply.value, reply.text[-3000:]
    job_id, state, message = reply.value["failed"]
    assert (job_id, state) == (job, "PREEMPTED"), message
    assert f"Slurm job {job} was lost at step" in message and "(PREEMPTED)" in message, message
    assert "none of the fit's state survived where every rank of the new job can read it" in message, message
    h1, h2 = slurm.nodes["n1"].hostname, slurm.nodes["n2"].hostname  # both rebooted: neither holds one
    assert f"{h1}: none" in message and f"{h2}: none" in message, message
    assert "the fit has no checkpoint_dir" in message, message
    assert "dist_fit(checkpoint_dir=...) on a file system every node mounts" in message, message
    assert "this elastic fit runs in a Slurm job over 2 nodes without checkpoint_dir" in reply.text  # said at launch
    left = reply.value["left"]  # the new job's workers work, and clean up
    assert sorted(h for h, _ in left) == sorted(n.hostname for n in slurm.nodes.values()), left
    assert all(not files for _, files in left), left
    (new,) = [j["id"] for j in _nbddp_jobs(slurm)]
    assert new != job


REQUEUE_TEMPLATE = """#!/bin/bash
#SBATCH --job-name=nbddp-own-{cluster_id}
#SBATCH --export=ALL
#SBATCH --requeue
#SBATCH --output={output_file}
#SBATCH --nodes={n}
#SBATCH --ntasks={n}
#SBATCH --ntasks-per-node=1
srun {program_and_args}
"""


@pytest.mark.slow
def test_a_requeued_job_is_cancelled_and_the_fit_goes_on_in_a_new_one(slurm, kernel):
    """A job of the person's own ipyparallel Slurm cluster, whose template lets Slurm requeue it: an administrator's
    `scontrol requeue` mid-fit puts it back in the queue under the same id; the fit cancels it and goes on in a new
    job, as for NODE_FAIL, recording REQUEUED. It cannot be faster: a job is requeued, cancelled and another
    started."""
    import torch

    _ok(kernel.execute("nbddp.stop()"))
    start = _ok(kernel.execute(f"""
import ipyparallel as ipp
from traitlets.config import Config
c = Config()
c.SlurmEngineSetLauncher.batch_template = {REQUEUE_TEMPLATE!r}
nbddp.start(cluster=ipp.Cluster(engines="slurm", n=2, controller_ip={slurm.login.address!r}, config=c))
out(nbddp.status()["slurm"][-1]["job"])
"""))
    job = start.value
    ckpt = slurm.root / "ckpt-requeued"
    try:
        reply, _ = _lose_the_job_mid_fit(slurm, kernel, "requeued", f"checkpoint_dir={str(ckpt)!r}, checkpoint_every=2",
                                         lambda mark: list(ckpt.glob("step-*.pt")), job=job,
                                         fault=lambda j: slurm.run("scontrol", "requeue", j))
        assert "restarts" in reply.value, reply.text[-3000:]
        (event,) = reply.value["restarts"]
        assert (event["job"], event["cause"], event["resumed_from"]) == (job, "REQUEUED", "checkpoint_dir"), event
        assert event["new_job"] not in (None, job) and event["step_resumed_from"] >= 2, event
        remote, local = torch.load(str(slurm.root / "fit-requeued.pt")), _unbroken_weights(8)
        for key in local:
            torch.testing.assert_close(remote[key], local[key], rtol=1e-5, atol=1e-6, msg=f"parameter {key}")
        states = {j["id"]: j["state"] for j in slurm.jobs(all_states=True)}
        assert states[job] == "CANCELLED" and [j["id"] for j in _nbddp_jobs(slurm)] == [event["new_job"]], states
    finally:
        _ok(kernel.execute("nbddp.stop()"))
    assert _nbddp_jobs(slurm) == []


def _fail_a_fit(slurm, kernel: LoginKernel, name: str, fault, expect: tuple[str, str],
                ends_later: str = "") -> tuple[str, float]:
    """Run a long fit, do ``fault()`` once it trains; the SlurmError's message, and how long it took to come.

    ``ends_later``: the fault is one Slurm acts on by its own clock (a time limit), so the time is
    counted from when ``squeue`` stops showing the job RUNNING, which the test waits for (2 minutes at most):
    first for this line in slurmctld's log, which Slurm writes as it ends the job (a file read, where each
    ``squeue`` from this process is a Python trampoline into the login node's namespace: ten a second, for the
    minute or so Slurm takes, cost 17 CPU-seconds), then for ``squeue``.
    """
    mark = slurm.root / f"fit-{name}"
    # each step mostly sleeps: the fit only has to be running when the job ends (up to 90 s later for the time
    # limit), not to keep both engines busy meanwhile (at 0.05 s a step the time-limit test cost 69 CPU-seconds,
    # at 0.5 s 36)
    msg_id = kernel.send(f"""
def slow_step(model, batch):
    import time
    open({str(mark)!r}, "a").close()
    time.sleep(0.5)
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)
model, data = build()
try:
    nbddp.dist_fit(model, data, epochs=500, batch_size=8, step_fn=slow_step, live=False)
except nbddp.SlurmError as e:
    out([e.job_id, e.state, str(e)])
""")
    slurm.wait_for(mark.exists, 120, "the fit to start")
    t0 = time.monotonic()
    fault()
    if ends_later:
        log = slurm.root / "slurmctld.log"
        slurm.wait_for(lambda: ends_later in log.read_text(errors="replace"), 120, f"{ends_later!r} in {log.name}",
                       interval=0.05)
        slurm.wait_for(lambda: {j["id"]: j["state"] for j in slurm.jobs()}.get(expect[0]) != "RUNNING", 30,
                       f"Slurm to end job {expect[0]}", interval=0.1)
        t0 = time.monotonic()
    reply = _ok(kernel.finish(msg_id, 60))
    took = time.monotonic() - t0
    assert reply.value is not None, reply.text[-3000:]
    job_id, state, message = reply.value
    assert took < 10, (took, message)
    assert (job_id, state) == expect, message
    return message, took


def test_killing_the_kernel_leaves_no_job_in_squeue_within_15_s(slurm, kernel):
    from faultkit import record_time

    job = _running_job(kernel)
    assert [j["id"] for j in _nbddp_jobs(slurm)] == [job]
    t0 = time.monotonic()
    kernel.kill()
    slurm.wait_for(lambda: not _nbddp_jobs(slurm), 15, "the reaper to cancel the dead kernel's job", interval=0.1)
    took = time.monotonic() - t0
    assert {j["id"]: j["state"] for j in slurm.jobs(all_states=True)}[job] == "CANCELLED"
    TIMES["kernel killed: job gone"] = took
    record_time("Slurm kernel SIGKILL: job gone from squeue", gone_s=took)


def _clock(line: str) -> int:
    """Seconds of the clock that ends a job line ("..., 1:05" -> 65)."""
    minutes, _, seconds = line.rsplit(", ", 1)[-1].partition(":")
    return int(minutes) * 60 + int(seconds) if minutes.isdigit() and seconds.isdigit() else -1


def test_a_detached_sessions_job_outlives_its_kernel_until_keep_alive(slurm):
    """Issue 43 on Slurm: a detached session keeps its job when its kernel is SIGKILLed, ``nbddp.sessions()``
    lists the job, and once no kernel and no fit has used the session for ``keep_alive`` the reaper cancels the
    job and ends everything, the record included. A kernel of its own (the module's is killed above), a job to
    start: about 20 s."""
    from kernel_cells import kill, wait_gone

    runtime = slurm.root / "runtime-detached"
    kernel = LoginKernel(slurm, NBDDP_RUNTIME_DIR=str(runtime))
    pids: list[int] = []
    try:
        job, listed, pids = _ok(kernel.execute(
            HELPERS + f"%load_ext nbddp\nimport nbddp\n{START} --detach --keep-alive 6s\n"
            "out([nbddp.status()['slurm'][-1]['job'], nbddp.sessions()[0]['slurm_jobs'], session_pids()])")).value
        assert listed == [job]
        kernel.kill()
        t0 = time.monotonic()
        time.sleep(3)  # well within keep_alive: what is checked is that nothing happens yet
        assert {j["id"]: j["state"] for j in slurm.jobs()}.get(job) == "RUNNING", "the job ended with its kernel"
        slurm.wait_for(lambda: job not in {j["id"] for j in slurm.jobs()}, 40,
                       "the reaper to cancel the idle session's job", interval=0.2)
        took = time.monotonic() - t0
        assert took >= 5.5, f"cancelled {took:.1f} s after the kernel died, before its 6 s keep_alive"
        assert {j["id"]: j["state"] for j in slurm.jobs(all_states=True)}[job] == "CANCELLED"
        assert wait_gone(pids, 20) == []
        assert list(runtime.rglob("session-*.json")) == []
        TIMES["detached: kernel killed to job cancelled (keep_alive 6 s)"] = took
    finally:
        kernel.close()
        kill(pids)
        for left in slurm.jobs():
            if left["name"].startswith("nbddp-"):
                slurm.run("scancel", left["id"], check=False)
