"""Writes notebooks/nonblocking_stop.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# A fit that runs in the background, and the Stop button\n\n"
        "`dist_fit(..., block=False)` returns a `FitHandle` at once. Training and the live dashboard go on, "
        "and the notebook stays free: run other cells, look at `handle.history` while it grows, then stop "
        "training on every rank at the same step with the dashboard's **Stop** button or `handle.stop()`. "
        "The notebook's `model` gets the weights of the step where training stopped."
    ),
    nbf.v4.new_code_cell(
        "import time\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "A small regression problem built in the notebook (no download): learn `y = sin(3x) + x^2` on 4,096 points. "
        "`epochs=10_000` is far more than we will let it run."
    ),
    nbf.v4.new_code_cell(
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.rand(4096, 1, generator=g) * 4 - 2\n"
        "y = torch.sin(3 * x) + x ** 2\n"
        "\n"
        "class MLP(nn.Module):\n"
        "    def __init__(self, width=64):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(1, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(),\n"
        "                                 nn.Linear(width, 1))\n"
        "    def forward(self, x):\n"
        "        return self.net(x)\n"
        "\n"
        "model = MLP()\n"
        "before = {k: v.clone() for k, v in model.state_dict().items()}"
    ),
    nbf.v4.new_markdown_cell(
        "`block=False`: the cell returns at once with a handle, and the dashboard below it keeps updating "
        "from a background thread. `log_every=1` records every step, so `handle.history` fills quickly."
    ),
    nbf.v4.new_code_cell(
        "handle = dist_fit(model, (x, y), epochs=10_000, batch_size=64, lr=3e-3, loss_fn=F.mse_loss,\n"
        "                  log_every=1, block=False)\n"
        "handle"
    ),
    nbf.v4.new_markdown_cell(
        "The notebook is free while the workers train. `handle.history` is what has arrived so far "
        "(one record per reduced step; `loss` is the mean over every rank's samples):"
    ),
    nbf.v4.new_code_cell(
        "deadline = time.monotonic() + 120\n"
        "while len(handle.history.steps) < 20 and not handle.done():\n"
        "    assert time.monotonic() < deadline, 'no training records after 120 s'\n"
        "    time.sleep(0.2)\n"
        "print(f'still running: {not handle.done()}, status {handle.status!r}')\n"
        "print(f'{len(handle.history.steps)} step records so far; the latest:')\n"
        "handle.history.steps[-1]"
    ),
    nbf.v4.new_markdown_cell(
        "## Stopping\n\n"
        "Clicking **Stop** on the dashboard does exactly what `handle.stop()` does: it asks every rank to stop; "
        "the ranks agree on the stop at their next synchronisation point, so all of them stop after the same "
        "step, and rank 0's weights come back into `model`.\n\n"
        "The button works **because this cell is not blocking**. Jupyter handles a widget click only while the "
        "kernel is idle, so during a blocking `dist_fit(...)` (the default) a click waits until the cell ends; "
        "there, use *Kernel > Interrupt* instead, which nbddp turns into the same coordinated stop. "
        "`handle.stop()` waits for the workers and returns the final `History`."
    ),
    nbf.v4.new_code_cell(
        "history = handle.stop()\n"
        "print(history.status, 'at step', history.steps[-1]['step'], f\"loss {history.steps[-1]['loss']:.4f}\")\n"
        "assert history.status == 'interrupted' and handle.done()"
    ),
    nbf.v4.new_markdown_cell("The notebook's `model` now holds the weights of the step where training stopped:"),
    nbf.v4.new_code_cell(
        "changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]\n"
        "with torch.no_grad():\n"
        "    mse = F.mse_loss(model(x), y).item()\n"
        "print(f'{len(changed)} of {len(before)} tensors changed; MSE on the data in the notebook: {mse:.4f}')\n"
        "assert changed"
    ),
    nbf.v4.new_markdown_cell(
        "The workers are free again: the next fit starts at once (here a short one that continues from the "
        "current weights, blocking this time)."
    ),
    nbf.v4.new_code_cell(
        "more = dist_fit(model, (x, y), max_steps=30, batch_size=64, lr=1e-3, loss_fn=F.mse_loss, live=False)\n"
        "more.status, more.steps[-1]['step']"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/nonblocking_stop.ipynb")
