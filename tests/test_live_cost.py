"""What the live dashboard costs: throughput with and without it, and the watcher thread's CPU.

Runs in a real ipykernel (through nbclient), so widget messages really go
out on IOPub as they do under JupyterLab. The same workload alternates
``live=False`` and ``live="widget"`` (default logging rates), and reports:

* workers' training throughput (samples / ``History.timings["train_s"]``);
* the kernel-side watcher thread's CPU time (``time.thread_time()`` at its
  end, view included) as a share of the fit's wall time.

Issue 3's targets are <= 1 % throughput and <= 5 % of one core. The CPU
share, which noise does not inflate, is asserted at the target. The
throughput ratio is reported, not asserted: inside the suite, beside two
other test processes on two cores, it read 0.84 in a full run where the same
test alone read 0.99 (2026-12-05), so no bound loose enough to hold would
catch a real cost. The throughput figure is benchmarks/bench_live.py's, a
paired ratio over many repetitions. ``NBDDP_COST_REPORT=path`` writes the numbers
as JSON.
"""

from __future__ import annotations

import json
import os

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.notebook, pytest.mark.bench]

SETUP = """
import json, time, torch, torch.nn as nn
import nbddp
nbddp.start(n=2, backend="gloo")
from sklearn.datasets import load_digits
x, y = load_digits(return_X_y=True)
x = torch.tensor(x, dtype=torch.float32) / 16.0
y = torch.tensor(y, dtype=torch.int64)
torch.manual_seed(0)
def net():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
"""

BENCH = """
rows = []
nbddp.dist_fit(net(), (x, y), epochs=1, batch_size=16, live=False)  # warm-up: caches, allocators
for rep in range({reps}):
    for live in ((False, "widget") if rep % 2 == 0 else ("widget", False)):
        handle = nbddp.dist_fit(net(), (x, y), epochs={epochs}, batch_size=16, live=live, block=False)
        h = handle.wait()
        run = handle._run
        samples = len(x) * {epochs}
        rows.append({{"live": live, "train_s": h.timings["train_s"], "total_s": h.timings["total_s"],
                     "samples_per_s": samples / h.timings["train_s"], "watch_cpu_s": run.watch_cpu_s,
                     "records": len(h.steps), "redraws": getattr(run.view, "redraws", None),
                     "plot_cpu_s": getattr(run.view, "plot_cpu_s", None)}})
print(json.dumps(rows))
"""


def test_live_view_cost(tmp_path):
    """The dashboard's cost in a real kernel: three fits with it and three without, alternating, after a warm-up.

    Each side's best throughput is reported (the module docstring says why it is not asserted). It
    cannot be faster: the fits must last seconds each, so that the dashboard redraws during training at its
    own pace (every 2-3 s) and its CPU share means something. The many-repetition measurement is
    benchmarks/bench_live.py.
    """
    import nbformat  # here, not at collection: with jsonschema's format checkers it costs a second of CPU
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(SETUP), nbformat.v4.new_code_cell(BENCH.format(reps=3, epochs=10)),
                nbformat.v4.new_code_cell("nbddp.stop()")]
    NotebookClient(nb, timeout=500, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs if o.output_type == "stream")
    rows = json.loads(text.strip().splitlines()[-1])
    by = {live: [r for r in rows if r["live"] == live] for live in (False, "widget")}
    tput = {live: max(r["samples_per_s"] for r in rs) for live, rs in by.items()}
    share = {live: max(r["watch_cpu_s"] / r["total_s"] for r in rs) for live, rs in by.items()}
    report = {"rows": rows, "best_samples_per_s": {str(k): v for k, v in tput.items()},
              "throughput_ratio_live_over_off": tput["widget"] / tput[False],
              "max_watcher_cpu_share": {str(k): v for k, v in share.items()}}
    print(json.dumps(report, indent=1))
    if os.environ.get("NBDDP_COST_REPORT"):
        with open(os.environ["NBDDP_COST_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    assert share["widget"] <= 0.05, f"the watcher thread used {share['widget']:.1%} of a core (target <= 5 %)"
    assert all(r["records"] > 0 for r in rows), report  # every fit published its records, with and without the view
