"""Slurm support without a Slurm: argument checks, the batch script, reading job states, the wait, the reaper.

Slurm's commands are faked by small scripts on ``PATH`` (``fake_slurm``)
that print what a real Slurm 22.05 printed (seen on this machine, recorded
in tests/test_slurm.py's runs); the real thing is tests/test_slurm.py.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from IPython.core.error import UsageError

import nbddp
from nbddp.protocol.errors import SlurmError
from nbddp.cluster.slurm.request import SlurmRequest, batch_template, check_time, controller_address, slurm_request
from nbddp.cluster.slurm.queue import GONE, JobState, cancel, never_starts, parse_squeue, query
from nbddp.cluster.slurm.watch import SlurmJobs, ended_words, fmt_clock, job_lines
from nbddp.live.job_line import JobLine


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """``fake_slurm({"squeue": "echo 42|RUNNING|None|n1|0:05|30:00|debug|1"})``: scripts on PATH; calls in ``calls``."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"

    def make(scripts: dict[str, str]) -> Path:
        for name in ("sbatch", "squeue", "scancel", "sinfo", "scontrol"):
            body = scripts.get(name, "true")
            (bin_dir / name).write_text(f"#!/bin/sh\necho \"{name} $*\" >> {calls}\n{body}\n")
            (bin_dir / name).chmod(0o755)
        return calls

    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return make


# ---- bad input: each refused before anything is submitted ----------------------------------
@pytest.mark.parametrize("value, exc, match", [
    ({"nodes": 0}, ValueError, r"--nodes \(slurm=\{'nodes': \.\.\.\}\) must be >= 1, got 0"),
    ({"nodes": 1.5}, TypeError, r"--nodes .* must be an int, got float 1\.5"),
    ({"gpus_per_node": -1}, ValueError, r"--gpus-per-node .* must be >= 0, got -1"),
    ({"time": "1h"}, ValueError, r"--time .* '1h' is not a time Slurm can parse: use minutes \(30\), MM:SS"),
    ({"time": "1:2:3:4"}, ValueError, r"'1:2:3:4' is not a time Slurm can parse"),
    ({"time": -5}, ValueError, r"-5 is not a time Slurm can parse"),
    ({"partition": "gpu a100"}, ValueError, r"--partition .* must be a Slurm name \(no spaces, quotes or braces\)"),
    ({"account": "{x}"}, ValueError, r"--account .* must be a Slurm name"),
    ({"sbatch": "--ntasks=8"}, ValueError, r"--sbatch '--ntasks=8': nbddp sets --ntasks itself; use -n N instead"),
    ({"sbatch": ["-N", "3"]}, ValueError, r"--sbatch '-N': nbddp sets -N itself; use --nodes instead"),
    ({"sbatch": "--comment='unclosed"}, ValueError, r"does not split like a shell line"),
    ({"sbatch": 5}, TypeError, r"must be a string of sbatch arguments or a list of strings, got int 5"),
    ({"queue_timeout": 0}, ValueError, r"--queue-timeout .* must be seconds > 0 or None"),
    ({"controller_ip": "login1"}, ValueError, r"--controller-ip .* must be an IP address of this machine"),
    ({"controller_ip": "0.0.0.0"}, ValueError, r"nbddp never lets the controller listen on every interface"),
    ({"nodes": 2, "partitions": "gpu"}, ValueError, r"has no setting 'partitions'; the settings are account, controller_ip"),
    ("gpu", TypeError, r"start\(slurm=\.\.\.\) must be True or a dict of Slurm settings .* got str 'gpu'"),
])
def test_bad_slurm_settings_are_refused(value, exc, match):
    with pytest.raises(exc, match=match):
        slurm_request(value)


@pytest.mark.parametrize("text", ["30", "0", "30:00", "04:00:00", "1-12", "1-12:30", "1-12:30:00", "UNLIMITED",
                                  "infinite"])
def test_every_time_format_slurm_parses_is_accepted(text):
    assert check_time(text) == text
    assert check_time(90) == "90"


def test_slurm_and_cluster_together_are_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"start\(slurm=\.\.\.\) builds its own ipyparallel Cluster .* cannot be "
                                         r"combined with cluster=\.\.\."):
        nbddp.start(slurm=True, cluster=object())
    with pytest.raises(ValueError, match=r"cannot be combined with cluster=\.\.\. or profile=/cluster_id="):
        nbddp.start(slurm={"nodes": 2}, profile="somewhere")


def test_no_sbatch_on_path_names_what_to_load_or_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SlurmError, match=r"needs Slurm's sbatch, squeue, scancel on PATH.*`module load slurm`.*"
                                         r"apt-get install slurm-client"):
        nbddp.start(n=2, slurm=True)


def test_the_layout_spreads_engines_evenly_one_per_gpu():
    assert SlurmRequest().layout(None, None) == (2, "gloo")
    assert SlurmRequest(nodes=2).layout(None, None) == (4, "gloo")
    assert SlurmRequest(nodes=2, gpus_per_node=4).layout(None, None) == (8, "nccl")
    assert SlurmRequest(nodes=2, gpus_per_node=4).layout(4, "gloo") == (4, "gloo")
    with pytest.raises(ValueError, match=r"start\(n=3\) cannot be spread evenly over 2 Slurm node\(s\).*e\.g\. n=2"):
        SlurmRequest(nodes=2).layout(3, None)
    with pytest.raises(ValueError, match=r"start\(n=1\) cannot be spread evenly over 2"):
        SlurmRequest(nodes=2).layout(1, None)
    with pytest.raises(ValueError, match=r"start\(n=10\) over 2 node\(s\) is 5 engines per node, more than "
                                         r"--gpus-per-node 4"):
        SlurmRequest(nodes=2, gpus_per_node=4).layout(10, None)
    with pytest.raises(ValueError, match=r"start\(backend='nccl', slurm=\.\.\.\) needs GPUs on the nodes"):
        SlurmRequest().layout(2, "nccl")


def test_magic_slurm_flags_need_slurm_and_reach_start(ip, monkeypatch):
    with pytest.raises(UsageError, match=r"%ddp start --partition, --nodes only mean something with --slurm"):
        ip.run_line_magic("ddp", "start --partition gpu --nodes 2")
    with pytest.raises(ValueError, match=r"--nodes \(slurm=\{'nodes': \.\.\.\}\) must be >= 1, got 0"):
        ip.run_line_magic("ddp", "start -n 2 --slurm --nodes 0")
    with pytest.raises(ValueError, match=r"--time .* '2h' is not a time Slurm can parse"):
        ip.run_line_magic("ddp", "start --slurm --time 2h")
    with pytest.raises(ValueError, match=r"--sbatch '--output=x': nbddp sets --output itself"):
        ip.run_line_magic("ddp", 'start --slurm --sbatch "--qos=high --output=x"')
    with pytest.raises(ValueError, match=r"--sbatch '--array=1-4': nbddp sets --array itself"):
        ip.run_line_magic("ddp", "start --slurm --sbatch '--array=1-4'")


# ---- the batch script, as ipyparallel's own Slurm launcher writes it ------------------------------
def _render(tmp_path, request: SlurmRequest, n: int, per_node: int, threads=None) -> list[str]:
    import ipyparallel as ipp
    from traitlets.config import Config

    from nbddp.cluster.slurm.launcher import SlurmEngines

    c = Config()
    c.SlurmEngines.batch_template = batch_template(request, threads)
    c.SlurmEngines.tasks_per_node = per_node
    cluster = ipp.Cluster(engines=SlurmEngines, n=n, config=c, profile_dir=os.fspath(tmp_path))
    launcher = cluster.engine_launcher_class(config=cluster.config, profile_dir=os.fspath(tmp_path), cluster_id="lab",
                                             work_dir=os.fspath(tmp_path), log=cluster.log, parent=cluster)
    launcher.write_batch_script(n)
    return Path(launcher.batch_file).read_text().splitlines()


def test_the_batch_script_asks_for_every_setting_and_one_engine_per_gpu(tmp_path):
    request = SlurmRequest(partition="gpu", nodes=2, gpus_per_node=4, time="04:00:00", account="lab")
    script = _render(tmp_path, request, 8, 4, threads=6)
    for line in ["#SBATCH --job-name=nbddp-lab", "#SBATCH --ntasks=8", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --partition=gpu", "#SBATCH --time=04:00:00",
                 "#SBATCH --account=lab", "#SBATCH --gpus-per-node=4", "#SBATCH --cpus-per-task=6"]:
        assert line in script, script
    assert any(line.startswith("srun --cpus-per-task=6 ") and "ipyparallel.engine" in line for line in script), script
    assert not any("{" in line for line in script), script
    # a replacement for one lost engine asks for one node, not all of them
    replacement = _render(tmp_path / "r", request, 1, 4)
    assert "#SBATCH --nodes=1" in replacement and "#SBATCH --ntasks-per-node=1" in replacement, replacement


def test_sbatch_refusing_a_job_is_slurms_own_message(tmp_path, fake_slurm):
    from nbddp.cluster.slurm.launcher import SlurmEngines

    fake_slurm({"sbatch": "echo 'sbatch: error: invalid partition specified: nope' >&2; exit 1"})
    launcher = SlurmEngines(work_dir=os.fspath(tmp_path), profile_dir=os.fspath(tmp_path), cluster_id="lab")
    with pytest.raises(SlurmError, match=r"Slurm refused the job: sbatch: error: invalid partition specified: nope"):
        launcher.start(2)
    launcher.job_id = "42"
    fake_slurm({"scancel": "echo 'scancel: error: Kill job error on job id 42: Access/permission denied' >&2; exit 1"})
    with pytest.raises(SlurmError, match=r"could not cancel Slurm job 42: .*Access/permission denied"):
        launcher.stop()
    fake_slurm({"scancel": "echo 'scancel: error: Kill job error on job id 42: Job/step already completing or "
                           "completed' >&2; exit 1"})
    assert launcher.stop() == ""  # a job that already ended is stopped


# ---- what Slurm says about a job ------------------------------------------------------------
SQUEUE = "42|PENDING|Resources||0:00|30:00|debug|2\n43|RUNNING|None|n[1-2]|1:05|UNLIMITED|debug|2\nnot a line\n"


def test_squeue_lines_become_job_states():
    jobs = parse_squeue(SQUEUE)
    assert set(jobs) == {"42", "43"}
    pending, running = jobs["42"], jobs["43"]
    assert pending.pending and not pending.ended and pending.headline() == "Slurm job 42: PENDING (Resources)"
    assert running.running and running.headline() == "Slurm job 43: RUNNING on n[1-2]"
    for state in ("CANCELLED", "TIMEOUT", "NODE_FAIL", "COMPLETING", GONE):
        assert JobState("7", state).ended
    assert ended_words(JobState("7", "TIMEOUT", nodes="n1")) == "Slurm job 7 reached its time limit: TIMEOUT on n1"
    assert ended_words(JobState("7", "NODE_FAIL", "NodeDown", "n2")) == "Slurm job 7 lost a node: NODE_FAIL (NodeDown) on n2"
    assert "sacct -j 7" in ended_words(JobState("7", GONE))
    assert JobState("7", GONE).headline() == "Slurm job 7: no longer listed by Slurm"
    assert job_lines([{"job": "43", "state": "RUNNING", "reason": "", "nodes": "n[1-2]", "elapsed": "1:05",
                       "time_limit": "30:00"}]) == ["Slurm job 43: RUNNING on n[1-2], elapsed 1:05 of 30:00"]
    assert [fmt_clock(s) for s in (0, 12, 725, 3723)] == ["0:00", "0:12", "12:05", "1:02:03"]


def test_a_job_slurm_forgot_is_gone_and_one_bad_id_does_not_hide_the_others(fake_slurm):
    calls = fake_slurm({"squeue": textwrap.dedent("""\
        case "$*" in
          *"-j 42,99"*) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1 ;;
          *"-j 42"*) echo '42|CANCELLED|None|n1|0:09|UNLIMITED|debug|1' ;;
          *) echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1 ;;
        esac""")})
    states = query(["42", "99"])
    assert states["42"].state == "CANCELLED" and states["99"].state == GONE
    assert len(calls.read_text().splitlines()) == 3
    fake_slurm({"squeue": "echo 'slurm_load_jobs error: Unable to contact slurm controller' >&2; exit 1"})
    assert query(["42"]) == {}  # slurmctld not answering: nothing is known, nothing is made up


def test_a_pending_job_that_can_never_start_is_told_apart(fake_slurm):
    fake_slurm({"scontrol": "echo 'PartitionName=debug AllowGroups=ALL TotalCPUs=4 TotalNodes=2 State=UP'"})
    too_many = JobState("5", "PENDING", "PartitionNodeLimit", partition="debug", node_count="3")
    assert never_starts(too_many)
    assert not never_starts(JobState("5", "PENDING", "PartitionNodeLimit", partition="debug", node_count="2"))
    assert never_starts(JobState("5", "PENDING", "InvalidAccount"))
    assert not never_starts(JobState("5", "PENDING", "Resources"))


def test_cancel_reports_only_real_complaints(fake_slurm):
    calls = fake_slurm({"scancel": "exit 0"})
    assert cancel(["42", "43"]) == "" and "scancel 42 43" in calls.read_text()
    fake_slurm({"scancel": "echo 'scancel: error: Invalid job id specified' >&2; exit 1"})
    assert cancel(["42"]) == ""
    fake_slurm({"scancel": "echo 'scancel: error: slurm_kill_job: Access/permission denied' >&2; exit 1"})
    assert cancel(["42"]) == "scancel: error: slurm_kill_job: Access/permission denied"


def test_the_controller_listens_where_the_nodes_are_reached(fake_slurm):
    assert controller_address(SlurmRequest(controller_ip="10.1.2.3")) == "10.1.2.3"
    fake_slurm({"sinfo": "echo 127.0.0.1; echo 127.0.0.1"})
    assert controller_address(SlurmRequest(partition="debug")) == "127.0.0.1"  # nodes on this machine
    fake_slurm({"sinfo": "true"})
    with pytest.raises(SlurmError, match=r"could not tell which address of this machine the Slurm nodes reach.*"
                                         r"slurm=\{'controller_ip': '10\.1\.2\.3'\} \(--controller-ip\)"):
        controller_address(SlurmRequest())


# ---- waiting for the job, kept current, bounded -------------------------------------------
class FakeWorkers:
    def __init__(self, registered_after: float | None = None):
        self.t0 = time.monotonic()
        self.after = registered_after

    @property
    def client(self):
        ready = self.after is not None and time.monotonic() - self.t0 > self.after
        return SimpleNamespace(ids=[0, 1] if ready else [])


def _jobs(job_id: str = "42") -> SlurmJobs:
    cluster = SimpleNamespace(engines={"s1": SimpleNamespace(job_id=job_id, output_file="")})
    return SlurmJobs(cluster)


def _squeue(line: str) -> dict[str, str]:
    return {"squeue": f"echo '{line}'", "scontrol": "echo 'PartitionName=debug TotalNodes=2'"}


@pytest.mark.parametrize("line, queue_timeout, run_timeout, match", [
    ("42|PENDING|Resources||0:00|30:00|debug|2", 0.3, 60,
     r"Slurm job 42: PENDING \(Resources\) for 0:0\d, longer than queue_timeout=0\.3 s, so nbddp cancelled it"),
    ("42|PENDING|PartitionNodeLimit||0:00|30:00|debug|3", None, 60,
     r"Slurm job 42: PENDING \(PartitionNodeLimit\): Slurm can never start this job as asked, so nbddp cancelled it"),
    ("42|RUNNING|None|n[1-2]|0:01|30:00|debug|2", None, 0.2,
     r"Slurm job 42: RUNNING on n\[1-2\], but only 0 of 2 engines registered within 0 s of its start, so nbddp "
     r"cancelled it"),
], ids=["past queue_timeout", "can never start", "engines never register"])
def test_a_wait_that_cannot_end_well_cancels_the_job_and_names_it(fake_slurm, line, queue_timeout, run_timeout, match):
    calls = fake_slurm(_squeue(line))
    with pytest.raises(SlurmError, match=match) as err:
        _jobs().wait_started(FakeWorkers(), 2, queue_timeout=queue_timeout, run_timeout=run_timeout, show=None)
    assert (err.value.job_id, err.value.state) == ("42", line.split("|")[1])
    assert "scancel 42" in calls.read_text()


def test_a_job_that_ends_before_its_engines_registered_says_so_with_its_output(fake_slurm, tmp_path):
    out = tmp_path / "job.out"
    out.write_text("srun: error: Unable to create step\n")
    fake_slurm(_squeue("42|FAILED|NonZeroExitCode|n1|0:01|30:00|debug|1"))
    jobs = SlurmJobs(SimpleNamespace(engines={"s": SimpleNamespace(job_id="42", output_file=str(out))}))
    with pytest.raises(SlurmError, match=r"Slurm job 42 failed .*: FAILED \(NonZeroExitCode\) on n1 before its engines "
                                         r"registered\.\nthe job's output ends with:\nsrun: error: Unable to create step"):
        jobs.wait_started(FakeWorkers(), 2, queue_timeout=None, run_timeout=60, show=None)


def test_the_wait_ends_when_the_engines_registered_and_an_interrupt_cancels(fake_slurm, monkeypatch):
    fake_slurm(_squeue("42|RUNNING|None|n[1-2]|0:01|30:00|debug|2"))
    _jobs().wait_started(FakeWorkers(registered_after=0.2), 2, queue_timeout=None, run_timeout=60, show=None)
    calls = fake_slurm(_squeue("42|PENDING|Priority||0:00|30:00|debug|2"))
    jobs, stream = _jobs(), io.StringIO()
    lines = []
    monkeypatch.setattr(SlurmJobs, "_check_pending", _interrupt_after(0.3))  # Kernel > Interrupt, while pending
    with pytest.raises(KeyboardInterrupt):
        jobs.wait_started(FakeWorkers(), 2, queue_timeout=None, run_timeout=60, show=_Recorder(lines, stream))
    assert "scancel 42" in calls.read_text()
    assert lines[0].startswith("Slurm job 42: PENDING (Priority), 0:00")
    assert lines[-1].startswith("Slurm job 42: cancelled (interrupted while PENDING (Priority)), 0:0")


class _Recorder(JobLine):
    def __init__(self, lines, stream):
        super().__init__(every=0.0, stream=stream)
        self.lines = lines

    def _write(self, text, changed, final):
        self.lines.append(text)


def _interrupt_after(seconds: float):
    t0 = time.monotonic()

    def check_pending(self, job, waited, queue_timeout):
        if time.monotonic() - t0 > seconds:
            raise KeyboardInterrupt
    return check_pending


def test_the_line_is_rewritten_on_a_terminal_and_written_on_change_elsewhere():
    class Tty(io.StringIO):
        def isatty(self):
            return True

    log, tty = io.StringIO(), Tty()
    for stream in (log, tty):
        line = JobLine(every=0.0, stream=stream)
        pending = JobState("42", "PENDING", "Resources")
        for waited in (0, 1, 2):
            line.show(pending, waited, 0, 2)
        line.show(JobState("42", "RUNNING", nodes="n[1-2]"), 3, 2, 2, final="started")
    assert log.getvalue().splitlines() == ["Slurm job 42: PENDING (Resources), 0:00",
                                           "Slurm job 42: RUNNING on n[1-2], 2 of 2 engines registered, 0:03"]
    assert tty.getvalue().count("\r") == 4 and "PENDING (Resources), 0:02\x1b[K" in tty.getvalue()



def test_the_session_hands_the_cluster_the_line_that_draws_a_jobs_wait(monkeypatch):
    """``cluster/`` imports nothing of ``live/``: the session passes the ``JobLine`` in (``show=``)."""
    from nbddp.cluster.engines import Workers
    from nbddp.session.session import Session

    given = {}

    def start(cls, n, cluster=None, **kwargs):
        given.update(kwargs)
        raise RuntimeError("stop here")

    monkeypatch.setattr(Workers, "start", classmethod(start))
    with pytest.raises(RuntimeError, match="stop here"):
        Session().start(2)
    assert isinstance(given["show"], JobLine)

# ---- the reaper cancels the jobs of a dead kernel --------------------------------------------
def test_the_reaper_cancels_the_jobs_of_a_dead_kernel(tmp_path, fake_slurm):
    from nbddp.cluster.reaper import Reaper

    calls = fake_slurm({"scancel": "exit 0"})
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    reaper = Reaper()
    reaper.start([], "", ["42"])
    pidfile = reaper.pidfile
    reaper.process.kill()  # this reaper watched the test process; run one for a dead "kernel" instead
    reaper.process.wait()
    done = subprocess.run([sys.executable, "-m", "nbddp.cluster.reaper", str(dead.pid), pidfile], timeout=30,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0
    assert "scancel 42" in calls.read_text()
    assert not os.path.exists(pidfile)


def test_sigterm_during_a_task_ends_the_engine_at_once_and_idle_handling_comes_back():
    """Slurm's scancel sends SIGTERM, then waits KillWait (30 s) before SIGKILL: a busy engine must not wait."""
    code = textwrap.dedent("""
        import os, signal, sys, time
        from nbddp.worker.engine.rank_state import exit_on_sigterm
        idle = lambda signum, frame: print("idle handler", flush=True)
        signal.signal(signal.SIGTERM, idle)
        with exit_on_sigterm():
            pass
        os.kill(os.getpid(), signal.SIGTERM)  # after a task: the engine's own handler again
        with exit_on_sigterm():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        print("not reached")
    """)
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert (done.returncode, done.stdout) == (143, "idle handler\n"), done.stderr
    assert time.monotonic() - t0 < 20


# ---- a detached session's job (issue 43) ------------------------------------------------------------------
def _detached_record(tmp_path, monkeypatch, keep_alive_s: float) -> str:
    from nbddp.protocol import session_record

    monkeypatch.setenv("NBDDP_RUNTIME_DIR", str(tmp_path / "runtime"))
    record = session_record.SessionRecord(
        id="20261205-000000-slurm0", owner_uid=os.getuid(), kernel_pid=0, cluster_file="", connection_file="",
        world=2, backend="gloo", started=time.time(), keep_alive_s=keep_alive_s, file_prefix="", token="t",
        slurm_job_ids=["42"])
    return session_record.write(record)


def test_a_detached_session_keeps_its_job_until_keep_alive_and_lists_it(tmp_path, fake_slurm, monkeypatch):
    """No kernel, no fit: the job stays (no scancel) while the session is idle for less than keep_alive."""
    from nbddp.cluster.idle_watch import wait_unused

    calls = fake_slurm({"squeue": "echo 42\\|RUNNING\\|None\\|n1\\|0:05\\|30:00\\|debug\\|1"})
    path = _detached_record(tmp_path, monkeypatch, keep_alive_s=1.5)
    (row,) = nbddp.sessions()
    assert row["slurm_jobs"] == ["42"]
    pidfile = tmp_path / "pids"
    pidfile.write_text("")
    t0 = time.monotonic()
    assert wait_unused(str(pidfile), path, "", interval=0.05) is True  # keep_alive reached: the session must end
    assert time.monotonic() - t0 >= 1.5
    assert "squeue" in calls.read_text() and "scancel" not in calls.read_text()  # asked after, never cancelled


def test_a_detached_sessions_job_that_ended_ends_the_session_at_once(tmp_path, fake_slurm, monkeypatch):
    """The job reached its time limit before keep_alive: the session ends now (its workers went with the job)."""
    from nbddp.cluster.idle_watch import wait_unused

    fake_slurm({"squeue": "echo 42\\|TIMEOUT\\|TimeLimit\\|n1\\|30:00\\|30:00\\|debug\\|1"})
    path = _detached_record(tmp_path, monkeypatch, keep_alive_s=3600.0)
    pidfile = tmp_path / "pids"
    pidfile.write_text("")
    t0 = time.monotonic()
    assert wait_unused(str(pidfile), path, "", interval=0.05) is True
    assert time.monotonic() - t0 < 30
