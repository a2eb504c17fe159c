"""Writes notebooks/restart_mid_fit.ipynb: a fit that goes on through a kernel restart (issue 43).

Kept as code so the notebook diff stays reviewable. nbclient runs a notebook
in one kernel and cannot restart it half-way, so the outputs come from a real
two-kernel run instead:

    python scripts/make_restart_mid_fit.py          # the cells only (what the generator test compares)
    python scripts/make_restart_mid_fit.py --run    # run them: the cells before the restart in one kernel,
                                                    # Kernel > Restart (jupyter_client's restart_kernel),
                                                    # the cells after it in the new kernel; outputs saved

``tests/test_sessions_kernel.py`` runs ``--run`` into a temporary folder and
checks what the notebook shows.
"""

from __future__ import annotations

import os
import sys

import nbformat as nbf

RESTART = "restart"  # the place in CELLS where the kernel is restarted

CELLS = [
    nbf.v4.new_markdown_cell(
        "# Restarting the kernel in the middle of a fit\n\n"
        "Kernels get restarted: after a bad import, to free memory, or because they crashed. With "
        "`%ddp start --detach` the workers outlive the kernel: a fit started with `block=False` keeps training "
        "through the restart, and the next kernel takes it up with `%ddp attach`, with its whole curve, its "
        "History and its weights. Names a `%%ddp` cell defined on the ranks stay too. See docs/sessions.md."
    ),
    nbf.v4.new_code_cell("import time\nimport torch, torch.nn as nn, torch.nn.functional as F\nimport nbddp\n"
                         "%load_ext nbddp"),
    nbf.v4.new_code_cell("%ddp start -n 2 --detach --keep-alive 30m"),
    nbf.v4.new_markdown_cell("A small regression problem built in the notebook (no download), and a name kept on "
                             "every rank by a `%%ddp` cell:"),
    nbf.v4.new_code_cell(
        "def data():\n"
        "    g = torch.Generator().manual_seed(0)\n"
        "    x = torch.rand(4096, 1, generator=g) * 4 - 2\n"
        "    return x, torch.sin(3 * x) + x ** 2\n"
        "\n"
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))\n"
        "\n"
        "x, y = data()\n"
        "model = mlp()"
    ),
    nbf.v4.new_code_cell("%%ddp\nnote = f'rank {rank} kept this before the restart'"),
    nbf.v4.new_markdown_cell("A fit that runs in the background (`block=False`): the cell returns at once."),
    nbf.v4.new_code_cell(
        "handle = dist_fit(model, (x, y), epochs=60, batch_size=32, lr=3e-3, loss_fn=F.mse_loss, seed=0,\n"
        "                  log_every=16, block=False, live='text')\n"
        "deadline = time.monotonic() + 120\n"
        "while len(handle.history.steps) < 10:\n"
        "    assert time.monotonic() < deadline, 'no training records after 120 s'\n"
        "    time.sleep(0.1)\n"
        "print(f'{len(handle.history.steps)} records so far, status {handle.status!r}: now restart the kernel')"
    ),
    RESTART,
    nbf.v4.new_markdown_cell(
        "**Kernel > Restart.** Everything the kernel held is gone: `handle`, `model`, `x`, even the classes. "
        "The workers are not: `%ddp sessions` lists the session, and `%ddp attach` takes it up in this kernel "
        "(the text view below replays the whole curve so far, then follows the fit)."
    ),
    nbf.v4.new_code_cell("import torch, torch.nn as nn\nimport nbddp\n%load_ext nbddp\n"
                         "[(s['id'], s['world'], s['attached'] is None) for s in nbddp.sessions()]"),
    nbf.v4.new_code_cell("%ddp attach"),
    nbf.v4.new_markdown_cell("`nbddp.running()` is the fit's handle. This kernel has no model of its own yet: "
                             "make one and let `wait(into=...)` load the trained weights into it."),
    nbf.v4.new_code_cell(
        "def mlp():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))\n"
        "\n"
        "model = mlp()\n"
        "history = nbddp.running().wait(into=model)\n"
        "steps = [r['step'] for r in history.steps]\n"
        "print(f'{history.status}: {len(history.epochs)} epochs, step records {steps[0]}..{steps[-1]}, '\n"
        "      f'none missing: {steps == sorted(set(steps))}')\n"
        "print(f\"loss {history.steps[0]['loss']:.3f} -> {history.steps[-1]['loss']:.4f}\")"
    ),
    nbf.v4.new_markdown_cell("The name the `%%ddp` cell defined before the restart is still on every rank:"),
    nbf.v4.new_code_cell("%%ddp\nprint(note)"),
    nbf.v4.new_code_cell("%ddp stop"),
]


def notebook() -> nbf.NotebookNode:
    nb = nbf.v4.new_notebook()
    nb.cells = [c for c in CELLS if c != RESTART]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def _execute(kc, cell: nbf.NotebookNode, count: int) -> None:
    """Run one cell in the kernel behind ``kc``; its outputs as nbformat outputs on the cell."""
    outputs = []

    def hook(msg):
        if msg["msg_type"] in ("stream", "display_data", "execute_result", "error"):
            outputs.append(nbf.v4.output_from_msg(msg))

    reply = kc.execute_interactive(cell.source, timeout=300, output_hook=hook)
    cell.outputs, cell.execution_count = outputs, count
    if reply["content"]["status"] != "ok":
        raise RuntimeError(f"cell {count} failed: {reply['content'].get('evalue')}\n{cell.source}")


def run(nb: nbf.NotebookNode, cwd: str) -> nbf.NotebookNode:
    """The cells before ``RESTART`` in one kernel, a real restart, the rest in the new kernel."""
    from jupyter_client.manager import KernelManager

    before = CELLS.index(RESTART)
    km = KernelManager(kernel_name="python3")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    km.start_kernel(cwd=cwd, env=dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        code = [c for c in CELLS[:before] if c.cell_type == "code"]
        for i, cell in enumerate(code, 1):
            _execute(kc, cell, i)
        km.restart_kernel(now=True)  # Kernel > Restart: the kernel's process group is killed, a new kernel starts
        kc.wait_for_ready(timeout=120)
        for i, cell in enumerate((c for c in CELLS[before + 1:] if c.cell_type == "code"), 1):
            _execute(kc, cell, i)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return nb


def main(argv: list[str]) -> str:
    os.makedirs("notebooks", exist_ok=True)
    path = os.path.join("notebooks", "restart_mid_fit.ipynb")
    nb = notebook()
    if "--run" in argv:
        run(nb, os.path.abspath("notebooks"))
    nbf.write(nb, path)
    return path


if __name__ == "__main__":
    print("wrote", main(sys.argv[1:]))
