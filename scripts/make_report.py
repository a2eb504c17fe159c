"""Writes notebooks/report.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Your own loop, or a framework's, with the live view\n\n"
        "`dist_fit` is not the only way to train on the workers. A loop of your own in a `%%ddp` cell, a "
        "function given to `nbddp.run`, a script, or a Hugging Face `Trainer` all get the same live view, "
        "`History` and loggers: call `nbddp.report(step, loss=...)` on every rank (a `Trainer` needs no call "
        "at all). The values are reduced over the ranks in the notebook's kernel, off your training thread: "
        "no collective is added to your step."
    ),
    nbf.v4.new_code_cell(
        "import torch\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "## A custom DDP loop\n\n"
        "Each rank trains on its own shard of a small regression problem and reports its loss every step, "
        "the samples it trained (for samples/s) and, every 10 steps, a validation loss. `nbddp.should_stop()` "
        "turns true on every rank at the same step once you press **Stop** or *Kernel > Interrupt* (or a "
        "callback asks), so the loop ends cleanly. The loggers and callbacks come from a notebook variable "
        "named by `--hooks`."
    ),
    nbf.v4.new_code_cell(
        "hooks = [nbddp.loggers.CSV('runs/report.csv')]"
    ),
    nbf.v4.new_code_cell(
        "%%ddp --hooks hooks\n"
        "import torch, nbddp\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "\n"
        "g = torch.Generator().manual_seed(rank)\n"
        "x = torch.rand(2048, 1, generator=g) * 4 - 2\n"
        "y = torch.sin(3 * x) + x ** 2\n"
        "torch.manual_seed(0)\n"
        "model = DDP(torch.nn.Sequential(torch.nn.Linear(1, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)))\n"
        "opt = torch.optim.Adam(model.parameters(), lr=3e-3)\n"
        "for step in range(1, 121):\n"
        "    i = torch.randint(0, len(x), (64,), generator=g)\n"
        "    loss = torch.nn.functional.mse_loss(model(x[i]), y[i])\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    nbddp.report(step, loss=loss.detach(), samples=64)\n"
        "    if step % 10 == 0:\n"
        "        with torch.no_grad():\n"
        "            nbddp.report(step, val_loss=torch.nn.functional.mse_loss(model(x[:256]), y[:256]))\n"
        "    if nbddp.should_stop():\n"
        "        break"
    ),
    nbf.v4.new_markdown_cell(
        "The cell's `History` is `nbddp.last_history()`. Each record is the mean over the ranks (`reduce=` "
        "picks `'sum'`, `'max'`, `'min'` or rank 0's value), and `rank_steps` keeps each rank's own values:"
    ),
    nbf.v4.new_code_cell(
        "h = nbddp.last_history()\n"
        "own = [r['loss'] for r in h.rank_steps if r['step'] == 120]\n"
        "print(f\"step 120: ranks {own[0]:.4f} and {own[1]:.4f}, reduced {h.steps[-1]['loss']:.4f}\")\n"
        "h.to_pandas().tail(3)"
    ),
    nbf.v4.new_code_cell(
        "import pandas as pd\n"
        "logged = pd.read_csv('runs/report.csv')\n"
        "print(f'the CSV logger wrote {len(logged)} rows, the last at step {logged.step.iloc[-1]}')"
    ),
    nbf.v4.new_markdown_cell("One small plot per metric; `ranks=True` adds each rank's own line:"),
    nbf.v4.new_code_cell("fig = h.plot(ranks=True)\nfig"),
    nbf.v4.new_markdown_cell(
        "## A Hugging Face `Trainer`, unchanged\n\n"
        "nbddp adds a `TrainerCallback` to every `Trainer` built on the workers: what the Trainer logs "
        "(`loss`, `grad_norm`, `learning_rate`...) shows below the cell, and a stop sets "
        "`control.should_training_stop` on every rank at the same step. The model is built from a config: "
        "nothing is downloaded."
    ),
    nbf.v4.new_code_cell(
        "%%ddp\n"
        "import torch\n"
        "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments\n"
        "\n"
        "class Tokens(torch.utils.data.Dataset):\n"
        "    def __len__(self):\n"
        "        return 512\n"
        "    def __getitem__(self, i):\n"
        "        ids = torch.randint(1, 50, (12,), generator=torch.Generator().manual_seed(i))\n"
        "        return {'input_ids': ids, 'attention_mask': torch.ones(12, dtype=torch.long), 'labels': ids.sum() % 2}\n"
        "\n"
        "config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,\n"
        "                    intermediate_size=32, max_position_embeddings=16)\n"
        "args = TrainingArguments(output_dir='runs/hf', per_device_train_batch_size=8, max_steps=20,\n"
        "                         learning_rate=1e-2, report_to=[], save_strategy='no', logging_steps=2,\n"
        "                         disable_tqdm=True)\n"
        "Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens()).train()\n"
        "None"
    ),
    nbf.v4.new_code_cell(
        "hf = nbddp.last_history()\n"
        "print('the Trainer logged', [k for k in hf.metrics if k in ('loss', 'grad_norm', 'learning_rate')],\n"
        "      'up to step', hf.last_step)"
    ),
    nbf.v4.new_markdown_cell(
        "## `nbddp.run`: the values and the History\n\n"
        "`nbddp.run(fn)` still returns each rank's value in rank order; the list also carries what `fn` "
        "reported, as `.history`."
    ),
    nbf.v4.new_code_cell(
        "def count(n):\n"
        "    import torch.distributed as dist\n"
        "    for step in range(n):\n"
        "        nbddp.report(step, reduce='sum', seen=dist.get_rank() + 1)\n"
        "    return dist.get_rank()\n"
        "\n"
        "out = nbddp.run(count, 5, live=False)\n"
        "print(out, [r['seen'] for r in out.history.steps])"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/report.ipynb")
