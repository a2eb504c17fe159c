"""Writes notebooks/predictions.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Predictions and exact metrics after a fit\n\n"
        "Train a digits classifier, then look at its mistakes: `nbddp.predict` runs the model over the "
        "validation set on every worker and brings the predictions back in the dataset's order; "
        "`nbddp.evaluate` gives exact F1 and a confusion matrix (torchmetrics) over the whole set. "
        "Both work on the notebook's model and on a model kept on the workers, sharded with FSDP."
    ),
    nbf.v4.new_code_cell(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from sklearn.datasets import load_digits\n"
        "from torchmetrics.classification import MulticlassConfusionMatrix, MulticlassF1Score\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_code_cell(
        "X, y = load_digits(return_X_y=True)\n"
        "X = torch.tensor(X, dtype=torch.float32) / 16.0\n"
        "y = torch.tensor(y)\n"
        "perm = torch.randperm(len(X), generator=torch.Generator().manual_seed(0))\n"
        "train_ds = (X[perm[:1400]], y[perm[:1400]])\n"
        "val_x, val_y = X[perm[1400:]], y[perm[1400:]]\n"
        "\n"
        "def make_model():\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))\n"
        "\n"
        "model = make_model()\n"
        "history = nbddp.dist_fit(model, train_ds, epochs=4, batch_size=64, lr=1e-2, live=False, keep='ddp_model')\n"
        "print(f'{len(val_y)} validation samples')"
    ),
    nbf.v4.new_markdown_cell(
        "## Predictions, in order\n\n"
        "Each worker predicts one block of the validation set; every sample comes back once, in order."
    ),
    nbf.v4.new_code_cell(
        "pred = nbddp.predict(model, (val_x, val_y), batch_size=64, step_fn=lambda m, b: m(b[0]).argmax(1))\n"
        "wrong = (pred != val_y).nonzero().flatten()\n"
        "print(f'{len(wrong)} mistakes, e.g. samples {wrong[:5].tolist()}: predicted {pred[wrong[:5]].tolist()}, '\n"
        "      f'true {val_y[wrong[:5]].tolist()}')\n"
        "assert torch.equal(pred, model.eval()(val_x).argmax(1))"
    ),
    nbf.v4.new_markdown_cell(
        "## Exact metrics\n\n"
        "torchmetrics objects sync their state over the workers: F1 over the whole set, not a mean of "
        "batch values; the confusion matrix too."
    ),
    nbf.v4.new_code_cell(
        "scores = nbddp.evaluate('ddp_model', (val_x, val_y), batch_size=64, live=False,\n"
        "                        metrics={'f1': MulticlassF1Score(10, average='macro'),\n"
        "                                 'confusion': MulticlassConfusionMatrix(10)})\n"
        "print(f\"macro F1 on the workers' kept model: {scores['f1']:.3f}\")\n"
        "confusion = scores['confusion']\n"
        "assert torch.equal(confusion, torch.bincount(val_y * 10 + pred, minlength=100).view(10, 10))"
    ),
    nbf.v4.new_code_cell(
        "import os\n"
        "import matplotlib.pyplot as plt\n"
        "\n"
        "def draw(confusion, title):\n"
        "    fig, ax = plt.subplots(figsize=(4, 4))\n"
        "    plt.close(fig)  # shown once, as the cell's value (an image), not again at the end of the cell\n"
        "    ax.imshow(confusion, cmap='Blues')\n"
        "    ax.set(xlabel='predicted', ylabel='true', title=title, xticks=range(10), yticks=range(10))\n"
        "    return fig\n"
        "\n"
        "os.makedirs('artifacts', exist_ok=True)\n"
        "fig = draw(confusion, 'DDP model')\n"
        "fig.savefig('artifacts/predictions_confusion.png')\n"
        "fig"
    ),
    nbf.v4.new_markdown_cell(
        "## A model kept sharded on the workers\n\n"
        "With FSDP and `keep=`, each worker holds half of every parameter; `predict` runs it there, the "
        "ranks gathering each layer's weights together."
    ),
    nbf.v4.new_code_cell(
        "sharded = make_model()\n"
        "nbddp.dist_fit(sharded, train_ds, epochs=4, batch_size=64, lr=1e-2, live=False, strategy='fsdp',\n"
        "               keep='fsdp_model')\n"
        "logits = nbddp.predict('fsdp_model', (val_x, val_y), batch_size=64, live=False)\n"
        "fsdp_pred = logits.argmax(1)\n"
        "print(f'FSDP model: {(fsdp_pred != val_y).sum().item()} mistakes')\n"
        "draw(torch.bincount(val_y * 10 + fsdp_pred, minlength=100).view(10, 10), 'FSDP model (kept)')"
    ),
    nbf.v4.new_markdown_cell(
        "## A kept pipeline, and a tensor-parallel model\n\n"
        "A model kept as a pipeline (`nbddp.Pipeline`: one stage per worker) predicts through its stages; the "
        "last stage holds the outputs. `step_fn(model, batch)` still works: its `model` stands for the whole "
        "pipeline on that batch, so `model(x)` returns the last stage's outputs. A tensor-parallel model "
        "(`nbddp.TensorParallel()`: each worker holds half of each split layer) runs every batch on both workers."
    ),
    nbf.v4.new_code_cell(
        "staged = make_model()\n"
        "nbddp.dist_fit(staged, train_ds, epochs=2, batch_size=64, lr=1e-2, live=False,\n"
        "               strategy=nbddp.Pipeline(stages=2, microbatches=4), keep='pipeline_model')\n"
        "pipe_pred = nbddp.predict('pipeline_model', (val_x, val_y), batch_size=64, live=False,\n"
        "                          step_fn=lambda m, b: m(b[0]).argmax(1))\n"
        "print(f'pipeline model: {(pipe_pred != val_y).sum().item()} mistakes')\n"
        "assert torch.equal(pipe_pred, staged.eval()(val_x).argmax(1))  # the weights back in the notebook agree"
    ),
    nbf.v4.new_code_cell(
        "split = make_model()\n"
        "nbddp.dist_fit(split, train_ds, epochs=2, batch_size=64, lr=1e-2, live=False,\n"
        "               strategy=nbddp.TensorParallel(), keep='tp_model')\n"
        "tp = nbddp.evaluate('tp_model', (val_x, val_y), batch_size=64, live=False,\n"
        "                    metrics={'f1': MulticlassF1Score(10, average='macro'),\n"
        "                             'confusion': MulticlassConfusionMatrix(10)})\n"
        "print(f\"tensor-parallel model: macro F1 {tp['f1']:.3f}\")\n"
        "draw(tp['confusion'], 'tensor-parallel model (kept)')"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/predictions.ipynb")
