"""Writes notebooks/checkpoint_resume.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Checkpoints, stopping, and resuming\n\n"
        "With `checkpoint_dir=...`, rank 0 saves the model, optimizer, scheduler, the position in the epoch and "
        "every rank's random-number states: every `checkpoint_every` optimizer steps, at each epoch end, and when "
        "training is stopped. `resume=True` continues from the newest one, in this kernel or after a restart. "
        "The files are plain PyTorch: `torch.load` reads them without nbddp."
    ),
    nbf.v4.new_code_cell(
        "import os, shutil, time\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_code_cell(
        "g = torch.Generator().manual_seed(0)\n"
        "centers = torch.randn(4, 16, generator=g) * 2\n"
        "labels = torch.randint(0, 4, (2000,), generator=g)\n"
        "features = centers[labels] + torch.randn(2000, 16, generator=g) * 1.5\n"
        "train_ds = (features, labels)\n"
        "\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4))\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
        "\n"
        "CKPT = os.path.abspath('checkpoints/blobs')\n"
        "shutil.rmtree(CKPT, ignore_errors=True)  # start this demo from scratch"
    ),
    nbf.v4.new_markdown_cell(
        "## Train with checkpoints, then stop\n\n"
        "`checkpoint_every=10` saves every 10 optimizer steps; the three newest files are kept. We run in the "
        "background and stop after about 25 steps, as the dashboard's Stop button (or *Kernel > Interrupt* in "
        "a blocking cell) would. A stop also writes a checkpoint, of the step where every rank stopped."
    ),
    nbf.v4.new_code_cell(
        "model = Net()\n"
        "handle = dist_fit(model, train_ds, epochs=40, batch_size=16, lr=1e-3, log_every=1,\n"
        "                  checkpoint_dir=CKPT, checkpoint_every=10, block=False)\n"
        "deadline = time.monotonic() + 120\n"
        "while handle.history.last_step < 25 and not handle.done():\n"
        "    assert time.monotonic() < deadline, 'training did not reach step 25 within 120 s'\n"
        "    time.sleep(0.1)\n"
        "first = handle.stop()\n"
        "stopped_at = first.steps[-1]['step']\n"
        "print(f'{first.status} at step {stopped_at} (epoch {first.steps[-1][\"epoch\"]})')\n"
        "assert first.status == 'interrupted'\n"
        "sorted(os.listdir(CKPT))"
    ),
    nbf.v4.new_markdown_cell(
        "## The checkpoint is a plain PyTorch file\n\n"
        "`torch.load` reads it without nbddp (even with `weights_only=True`, its default). It holds the model "
        "and optimizer state dicts, where training was, and the RNG states used to continue exactly."
    ),
    nbf.v4.new_code_cell(
        "latest = os.path.join(CKPT, sorted(os.listdir(CKPT))[-1])\n"
        "state = torch.load(latest)  # weights_only=True: only tensors and plain Python objects inside\n"
        "print(os.path.basename(latest), '->', sorted(state))\n"
        "print(f\"step {state['step']}, epoch {state['epoch']}, {state['batches_done']} batches into that epoch, \"\n"
        "      f\"saved by {state['world_size']} ranks with batch_size {state['batch_size']}\")\n"
        "assert state['step'] == stopped_at\n"
        "\n"
        "restored = Net()\n"
        "restored.load_state_dict(state['model'])\n"
        "same = all(torch.equal(a, b) for a, b in zip(restored.state_dict().values(), model.state_dict().values()))\n"
        "print('checkpoint weights == the weights that came back into `model`:', same)\n"
        "assert same"
    ),
    nbf.v4.new_markdown_cell(
        "## Resume\n\n"
        "`resume=True` picks the newest checkpoint in `checkpoint_dir` (or starts fresh when there is none, so "
        "the same cell works on the first run too). The weights come from the checkpoint, so a brand-new "
        "`Net()`, as after a kernel restart, is fine. `epochs` counts from the start of training: "
        "`epochs=3` trains up to the end of epoch 3, not 3 more. Resuming in the middle of an epoch needs the "
        "same number of workers and `batch_size`."
    ),
    nbf.v4.new_code_cell(
        "model = Net()  # as if the kernel had restarted\n"
        "history = dist_fit(model, train_ds, epochs=3, batch_size=16, lr=1e-3, log_every=1,\n"
        "                   checkpoint_dir=CKPT, checkpoint_every=10, resume=True)\n"
        "print(f\"resumed: first record at step {history.steps[0]['step']}, last at step {history.steps[-1]['step']}\")\n"
        "assert history.steps[0]['step'] == stopped_at + 1\n"
        "history.epochs"
    ),
    nbf.v4.new_markdown_cell("Checkpoints are kept up to date as training goes on; the three newest remain:"),
    nbf.v4.new_code_cell(
        "sorted(os.listdir(CKPT))"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/checkpoint_resume.ipynb")
