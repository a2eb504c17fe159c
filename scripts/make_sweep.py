"""Writes notebooks/sweep.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Many small trials at once: `nbddp.sweep`\n\n"
        "A small classifier gains little from DDP over two workers, but trying learning rates and widths is "
        "work that splits perfectly: one trial per worker, no gradient sync between them. `nbddp.sweep` runs the "
        "trials on the warm workers, lets Optuna choose them and prune the poor ones, shows a leaderboard and "
        "every trial's curve under the cell, and gives the best model back."
    ),
    nbf.v4.new_code_cell(
        "import optuna\n"
        "import torch, torch.nn as nn\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "Data made in the notebook (no download): 2,048 points in a square, labelled by whether they lie inside "
        "a circle. The model is a factory with the width as an argument, so the sweep can vary it."
    ),
    nbf.v4.new_code_cell(
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.rand(2048, 2, generator=g) * 2 - 1\n"
        "label = (x.norm(dim=1) < 0.7).long()\n"
        "train, val = (x[:1536], label[:1536]), (x[1536:], label[1536:])\n"
        "\n"
        "def make_net(width=32):\n"
        "    return nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh(), nn.Linear(width, 2))\n"
        "\n"
        "def accuracy(out, y):\n"
        "    return (out.argmax(1) == y).float().mean()"
    ),
    nbf.v4.new_markdown_cell(
        "Eight trials over a log-uniform learning rate and three widths; the median pruner stops a trial whose "
        "validation loss is worse than the median of the trials before it at the same step (after two trials "
        "and one epoch). Each worker takes the next trial as soon as its last one ends or is pruned."
    ),
    nbf.v4.new_code_cell(
        "result = nbddp.sweep(make_net, train, val_data=val, metrics={'acc': accuracy}, epochs=6, batch_size=64,\n"
        "                     space={'lr': (1e-4, 3e-1, 'log'), 'width': [8, 32, 64]}, n_trials=8,\n"
        "                     sampler=optuna.samplers.TPESampler(seed=0),\n"
        "                     pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=24))"
    ),
    nbf.v4.new_markdown_cell("`repr(result)` is the leaderboard, best first; `result.trials` is the same as a DataFrame:"),
    nbf.v4.new_code_cell(
        "print(result.leaderboard())\n"
        "print('best:', result.best_params, f'val_loss {result.best_value:.4f}')\n"
        "result.trials[['trial', 'params_lr', 'params_width', 'value', 'epoch', 'state', 'seconds', 'group']]"
    ),
    nbf.v4.new_markdown_cell(
        "`best_model` is a module the factory built with the best parameters, holding the best trial's weights:"
    ),
    nbf.v4.new_code_cell(
        "best = result.best_model\n"
        "with torch.no_grad():\n"
        "    acc = accuracy(best(val[0]), val[1]).item()\n"
        "print(f'width {best[0].out_features}; validation accuracy of the best model in the notebook: {acc:.3f}')"
    ),
    nbf.v4.new_markdown_cell("Every trial's curve, the best in red, pruned ones grey:"),
    nbf.v4.new_code_cell("result.plot()"),
    nbf.v4.new_markdown_cell(
        "Parallel coordinates: each completed trial is a line across its parameters and its validation loss "
        "(Optuna's own matplotlib plot, over the study's completed trials):"
    ),
    nbf.v4.new_code_cell('result.plot(kind="parallel")'),
    nbf.v4.new_markdown_cell(
        "### A sweep that leaves the notebook free\n\n"
        "With `block=False` the cell returns a `SweepHandle` at once; the trials go on, with the live view and its "
        "Stop button under the cell, while other cells run. `handle.trials` is the leaderboard so far. Here a long "
        "sweep (40 trials) is started..."
    ),
    nbf.v4.new_code_cell(
        "handle = nbddp.sweep(make_net, train, val_data=val, epochs=6, batch_size=64,\n"
        "                     space={'lr': (1e-3, 1e-1, 'log'), 'width': [8, 32]}, n_trials=40,\n"
        "                     sampler=optuna.samplers.RandomSampler(seed=1), block=False)\n"
        "print(handle)"
    ),
    nbf.v4.new_markdown_cell(
        "...and stopped from another cell once two trials have completed: `handle.stop()` is the Stop button's "
        "stop (no new trial, the running ones stop at their next step) and returns the `SweepResult` of what "
        "finished, with `status == 'interrupted'`. The best model of those trials comes back as before."
    ),
    nbf.v4.new_code_cell(
        "import time\n"
        "while (handle.trials['state'] == 'complete').sum() < 2 and not handle.done():\n"
        "    time.sleep(0.2)  # the notebook is free: any other work could run here\n"
        "partial = handle.stop()\n"
        "print(f'stopped: status {partial.status!r}, {len(partial.trials)} of 40 trials handed out, '\n"
        "      f\"{(partial.trials['state'] == 'complete').sum()} complete\")\n"
        "print('best of those:', partial.best_params)"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/sweep.ipynb")
