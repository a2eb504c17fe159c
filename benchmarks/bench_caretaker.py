"""A rank lost with no kernel attached: from the engine's kill to the fit training again (issue 43).

A first "kernel" (a Python process, as a Jupyter kernel would be) starts 2
workers with ``detach=True`` and launches ``dist_fit(..., max_restarts=N,
snapshot_every=4, block=False)`` on a small model whose steps are slowed
while a marker file exists (so the fit outlasts the kills), then dies
(``os._exit``: no clean-up). The session's reaper starts the caretaker
(``nbddp/detached/caretaker.py``); once its log says it drives the fit,
rank 1's engine is SIGKILLed by pid, REPS times one after the other
(``max_restarts=REPS``), each time once the previous relaunch resumed. The
figure is the time from each kill to the relaunched fit's rank 0 saying
from which step it resumed (the ledger the caretaker writes then,
``nbddp/detached/care_spec.py``, polled every 50 ms): a lost rank's
detection, the heal (a warm spare engine where one is ready, else one
started and importing torch) and the relaunch up to its first step back.
Then the marker goes, a new process attaches, takes the History (its
``restarts`` are checked against the kills) and stops the session.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys as _sys
import tempfile
import time
from pathlib import Path as _Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repo root importable
    _sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402

NAME = "caretaker"

SETUP = """
import json, os, time, torch, nbddp
from nbddp.session.session import get_session
MARK = {mark!r}
torch.manual_seed(0)
X = torch.randn(256, 8); Y = X.sum(1, keepdim=True)
class SlowNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    def forward(self, x):
        if os.path.exists(MARK):
            time.sleep(0.25)
        return self.body(x)
FIT = dict(epochs=40, batch_size=4, lr=0.01, seed=3, live=False, log_every=8, snapshot_every=4)
"""

FIRST = SETUP + """
nbddp.start(2, threads=1, detach=True, keep_alive="30m")
handle = nbddp.dist_fit(SlowNet(), (X, Y), **FIT, max_restarts={reps}, block=False)
while handle.history.last_step < 8:
    time.sleep(0.02)
s = get_session()
print("BENCH-OUT", json.dumps({{"record": s.record_path, "fit_id": s.running.plan.launch.fit_id}}))
os._exit(0)
"""

LAST = SETUP + """
nbddp.attach()
history = nbddp.running().wait()
s = get_session()
nbddp.stop()
print("BENCH-OUT", json.dumps({{"restarts": history.restarts, "status": history.status,
                                "last_step": history.steps[-1]["step"]}}))
"""


def _python(code: str, env: dict[str, str], timeout: float = 900) -> dict[str, Any]:
    """Run ``code`` in a new process (a kernel of its own); the JSON of its ``BENCH-OUT`` line."""
    done = subprocess.run([_sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout,
                          cwd=str(common.REPO_ROOT))
    lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH-OUT")]
    if not lines:
        raise RuntimeError(f"the process failed ({done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].split(" ", 1)[1])


def _until(what: str, check: Any, timeout: float = 300.0, log: str = "") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not happen within {timeout:.0f} s; caretaker log: "
                       f"{open(log).read()[-2000:] if log and os.path.exists(log) else '-'}")


def _rank_pid(record: str, rank: int) -> int:
    with open(record) as f:
        return next(p["pid"] for p in json.load(f)["group"]["placements"] if p["rank"] == rank)


def kills(reps: int) -> dict[str, Any]:
    """The session set up, ``reps`` kills of rank 1 with no kernel, each timed to the resume; then attach."""
    from nbddp.detached.care_spec import load_ledger

    runtime = tempfile.mkdtemp(prefix="nbddp-bench-runtime-")
    mark = os.path.join(runtime, "slow")
    open(mark, "w").close()
    env = common.worker_env({"NBDDP_RUNTIME_DIR": runtime})
    first = _python(FIRST.format(mark=mark, reps=reps), env)
    record, fit_id = first["record"], first["fit_id"]
    log = record[:-len(".json")] + "-caretaker.log"
    _until("the caretaker driving the fit",
           lambda: os.path.exists(log) and "driving fit" in open(log).read(), log=log)
    seconds = []
    for i in range(reps):
        pid = _rank_pid(record, 1)
        t0 = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        _until(f"resume {i + 1}", lambda: (lambda l: len(l.restarts) == i + 1 and not l.pending)(
            load_ledger(record, fit_id)), log=log)
        seconds.append(round(time.monotonic() - t0, 3))
    os.unlink(mark)
    last = _python(LAST.format(mark=mark), env)
    os.rmdir(runtime)  # empty: stop() removed the record
    return {"kill_to_resumed_s": seconds, "attach": last}


def main(quick: bool = False, reps: int | None = None) -> dict[str, Any]:
    reps = reps or (1 if quick else 3)
    load_before = os.getloadavg()
    run = kills(reps)
    restarts = run["attach"]["restarts"]
    if len(restarts) != reps or run["attach"]["status"] != "completed":
        raise RuntimeError(f"the fit did not complete with {reps} restart(s): {run['attach']}")
    out = {"reps": reps, "load_before": load_before, "load_after": os.getloadavg(),
           "summary": {"kill_to_resumed_s": common.summarize(run["kill_to_resumed_s"]),
                       "caretaker_seconds": common.summarize([r["seconds"] for r in restarts]),
                       "caretaker_replace_s": common.summarize([r["replace_s"] for r in restarts])},
           "kill_to_resumed_s": run["kill_to_resumed_s"], "restarts": restarts}
    s = out["summary"]["kill_to_resumed_s"]
    common.print_table([{"no kernel attached": "kill -> fit training again", "median s": s["median"],
                         "min": s["min"], "max": s["max"]}],
                       title=f"\n== caretaker: rank 1 SIGKILLed {reps} time(s) in a detached session, 2 workers ==")
    return out


def summary_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"bench": "caretaker", "competitor": "nbddp caretaker", "metric": "s",
             "median": res["summary"]["kill_to_resumed_s"]["median"], "ratio": None}]


if __name__ == "__main__":
    common.cli(main, NAME)
