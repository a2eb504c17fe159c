"""Every notebook in notebooks/ runs end to end in a real Jupyter kernel (nbclient).

Each notebook starts its own workers (``%ddp start -n 2``) and stops them
(``%ddp stop``), so these tests are ``fresh_workers``. Notebooks that another
test already executes with its own checks are not run twice; a new notebook
is picked up automatically. The notebooks run in a temporary directory (the
files they write land there), and after each one no worker process it
started may be left behind.
"""

from __future__ import annotations

import base64
import os
import runpy
import sys
import time
from typing import TYPE_CHECKING

import psutil
import pytest

if TYPE_CHECKING:  # imported where a notebook is read: with jsonschema's format checkers it costs a second
    import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")
sys.path.insert(0, os.path.join(ROOT, "scripts"))

EXECUTED_ELSEWHERE = {
    "custom_loop": "tests/test_notebooks_magics.py",
    "live_fit": "tests/test_live_notebook.py",
    "restart_mid_fit": "tests/test_sessions_kernel.py",  # two kernels, a restart between them (nbclient has one)
}

# what each notebook must print (text outputs, in order of appearance)
EXPECTED = {
    "quickstart": ["nbddp: 2 worker(s), backend gloo", "validation accuracy in the notebook", "workers stopped"],
    "predictions": ["nbddp: 2 worker(s), backend gloo", "validation samples", "mistakes, e.g. samples",
                    "macro F1 on the workers' kept model", "FSDP model:", "pipeline model:",
                    "tensor-parallel model: macro F1", "workers stopped"],
    "nonblocking_stop": [
        "still running: True, status 'training'",
        "step records so far",
        "interrupted at step",
        "tensors changed",
        "('completed', 30)",
        "workers stopped",
    ],
    "finetune_hf_style": [
        "'attention_mask': tensor(",
        "nbddp fit completed: step 48/48 · epoch 3/3",
        "pre-training loss:",
        "newly initialised (to be trained): ['classifier.weight', 'classifier.bias']",
        "nbddp fit completed: step 60/60 · epoch 5/5",
        "'val_acc':",
        "validation accuracy:",
        "workers stopped",
    ],
    "sharded_transformer": [
        "sequences of 32 characters",
        "[completed]  step 108/108  epoch 4/4",
        "rank 0 held 50% of the",
        "rank 1 held 50% of the",
        "loss per epoch:",
        # each rank prints its line once; the two engines' output reaches the cell in either order
        "] FSDPTinyLM (2, 32,",
        "] FSDPTinyLM (2, 32,",
        "workers stopped",
    ],
    "pipeline_parallel": [
        "Sequential(",
        "[completed]  step 32/32  epoch 2/2",
        "rank 0: stage 0,",
        "rank 1: stage 1,",
        "pipeline vs one process: largest weight difference",
        "accuracy of the weights back in the notebook:",
        "rank 0: tp rank 0,",
        "tensor parallel vs one process: largest weight difference",
        "workers stopped",
    ],
    "sweep": [
        "nbddp sweep: 8 trials, val_loss (min), completed",
        "best: {'lr': ",
        "validation accuracy of the best model in the notebook:",
        "<SweepHandle running: ",
        "stopped: status 'interrupted', ",
        "best of those: {'lr': ",
        "workers stopped",
    ],
    "report": [
        "nbddp: 2 worker(s), backend gloo",
        "nbddp reports completed: step 120 · loss",  # the custom loop's view, its final summary
        "step 120: ranks",
        "the CSV logger wrote 120 rows, the last at step 120",
        "nbddp reports completed: step 20 · loss",  # the HF Trainer's, with no change to its code
        "the Trainer logged ['loss', 'grad_norm', 'learning_rate'] up to step 20",
        "[0, 1] [3.0, 3.0, 3.0, 3.0, 3.0]",
        "workers stopped",
    ],
    "checkpoint_resume": [
        "nbddp fit interrupted",
        "interrupted at step",
        "-> ['batch_size', 'batches_done', 'epoch', 'epoch_sums', 'model', 'optimizer'",
        "checkpoint weights == the weights that came back into `model`: True",
        "nbddp fit completed: step 189/189 · epoch 3/3",  # the dashboard is displayed before the cell prints
        "resumed: first record at step",
        "'step-00000189.pt'",
        "workers stopped",
    ],
}
MAX_SECONDS = 180  # "under two minutes" on an idle machine; this one is shared


def _names() -> list[str]:
    return sorted(n[:-len(".ipynb")] for n in os.listdir(NOTEBOOKS) if n.endswith(".ipynb"))


def _texts(nb: nbformat.NotebookNode) -> str:
    """Every cell's text outputs; consecutive pieces of one stream joined as Jupyter shows them (a kernel may
    flush one print() in two messages when another thread writes in between)."""
    out: list[str] = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        stream = None
        for o in cell.outputs:
            if o.output_type == "stream" and o.name == stream:
                out[-1] += o.text
            elif o.output_type == "stream":
                out.append(o.text)
            elif "data" in o:
                out.append(o.data.get("text/plain", ""))
            stream = o.name if o.output_type == "stream" else None
    return "\n".join(out)


def _workers_started_in(directory: str) -> list[psutil.Process]:
    """ipyparallel processes whose working directory is ``directory`` (the notebook's)."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if "ipyparallel" in " ".join(p.info["cmdline"] or []) and p.cwd() == directory:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.notebook
@pytest.mark.fresh_workers
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in _names() if n not in EXECUTED_ELSEWHERE])
def test_notebook_runs_and_shows_its_results(name, tmp_path):
    from run_notebook import execute  # nbformat: imported when a notebook runs, not at every collection

    t0 = time.monotonic()
    nb = execute(os.path.join(NOTEBOOKS, f"{name}.ipynb"), out=str(tmp_path / "executed.ipynb"), timeout=240,
                 cwd=str(tmp_path))
    took = time.monotonic() - t0
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, errors
    text = _texts(nb)
    pos = 0
    for expected in EXPECTED.get(name, []):
        found = text.find(expected, pos)
        assert found >= 0, f"{name}: expected {expected!r} (after position {pos}) in the outputs:\n{text[-4000:]}"
        pos = found + len(expected)
    assert took < MAX_SECONDS, f"{name} took {took:.0f} s"
    for cell in [c for c in nb.cells if c.cell_type == "code" and ".plot()" in c.source
                 and c.source.rstrip().endswith("fig")]:
        # History.plot()'s Figure as a cell's value is an image in a plain kernel, not "<Figure size ...>"
        shown = [o for o in cell.outputs if o.output_type == "execute_result"]
        assert shown and base64.b64decode(shown[0].data["image/png"])[:4] == b"\x89PNG", cell.outputs
    for cell in [c for c in nb.cells if c.cell_type == "code"]:  # no figure of any cell shows as its repr text
        for out in [o for o in cell.outputs if o.output_type in ("execute_result", "display_data")]:
            if out.data.get("text/plain", "").startswith("<Figure size"):
                assert "image/png" in out.data, (name, cell.source[-200:], out.data.keys())
    deadline = time.monotonic() + 15
    while (left := _workers_started_in(str(tmp_path))) and time.monotonic() < deadline:
        time.sleep(0.2)
    for p in left:
        p.kill()
    assert not left, f"{name} left worker processes behind: {[p.pid for p in left]}"


def test_every_notebook_is_executed_by_some_test():
    for name, test in EXECUTED_ELSEWHERE.items():
        with open(os.path.join(ROOT, test), encoding="utf-8") as f:
            assert f"{name}.ipynb" in f.read(), f"{test} no longer executes {name}.ipynb; drop it from EXECUTED_ELSEWHERE"
    assert set(EXPECTED) <= set(_names()), f"EXPECTED names notebooks that do not exist: {set(EXPECTED) - set(_names())}"


@pytest.mark.parametrize("name", [n for n in _names() if os.path.exists(os.path.join(ROOT, "scripts", f"make_{n}.py"))])
def test_notebook_matches_its_generator_script(name, tmp_path, monkeypatch):
    """Notebooks with a ``scripts/make_<name>.py`` are edited there, not by hand."""
    import nbformat

    (tmp_path / "notebooks").mkdir()
    monkeypatch.chdir(tmp_path)  # the scripts write notebooks/<name>.ipynb relative to the working directory
    runpy.run_path(os.path.join(ROOT, "scripts", f"make_{name}.py"), run_name="__main__")
    generated = nbformat.read(tmp_path / "notebooks" / f"{name}.ipynb", as_version=4)
    committed = nbformat.read(os.path.join(NOTEBOOKS, f"{name}.ipynb"), as_version=4)
    assert [(c.cell_type, c.source) for c in committed.cells] == [(c.cell_type, c.source) for c in generated.cells], (
        f"notebooks/{name}.ipynb differs from what scripts/make_{name}.py writes: edit the script and run "
        f"`python scripts/make_{name}.py` from the repository root"
    )
