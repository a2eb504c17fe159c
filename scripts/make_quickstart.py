"""Writes notebooks/quickstart.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# nbddp quickstart\n\n"
        "Train a small classifier on scikit-learn's digits with DistributedDataParallel on two workers "
        "(one per GPU where there are GPUs, CPU workers with gloo elsewhere), watch it live, and get the "
        "trained weights back in this notebook's `model`."
    ),
    nbf.v4.new_code_cell(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from sklearn.datasets import load_digits\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_markdown_cell("Start the workers once; every later cell reuses them."),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_code_cell(
        "X, y = load_digits(return_X_y=True)\n"
        "X = torch.tensor(X, dtype=torch.float32) / 16.0\n"
        "y = torch.tensor(y)\n"
        "perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))\n"
        "train_ds = (X[perm[:1400]], y[perm[:1400]])\n"
        "val_ds = (X[perm[1400:]], y[perm[1400:]])\n"
        "\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))\n"
        "    def forward(self, x):\n"
        "        return self.body(x)\n"
        "\n"
        "def accuracy(output, target):\n"
        "    return (output.argmax(dim=1) == target).float().mean()\n"
        "\n"
        "model = Net()"
    ),
    nbf.v4.new_markdown_cell(
        "`batch_size` is per rank: with 2 workers each step sees 64 samples. Metrics are reduced over all ranks."
    ),
    nbf.v4.new_code_cell(
        "history = nbddp.dist_fit(model, train_ds, epochs=12, batch_size=32, lr=3e-3,\n"
        "                         loss_fn=F.cross_entropy, val_data=val_ds, metrics={'acc': accuracy}, seed=0)\n"
        "history.epochs[-1]"
    ),
    nbf.v4.new_markdown_cell("The notebook's own `model` now holds the trained weights:"),
    nbf.v4.new_code_cell(
        "with torch.no_grad():\n"
        "    acc = accuracy(model(val_ds[0]), val_ds[1]).item()\n"
        "print(f'validation accuracy in the notebook: {acc:.3f}')\n"
        "assert acc > 0.9"
    ),
    nbf.v4.new_code_cell(
        "import os\n"
        "os.makedirs('artifacts', exist_ok=True)\n"
        "fig = history.plot()\n"
        "fig.savefig('artifacts/quickstart_loss.png')\n"
        "fig"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/quickstart.ipynb")
