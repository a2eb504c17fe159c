"""Writes notebooks/pipeline_parallel.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Pipeline and tensor parallelism from a notebook\n\n"
        "When a model does not fit on one GPU, it can be *split* instead of copied:\n\n"
        "* `strategy=nbddp.Pipeline(stages=2, microbatches=4)` cuts the model into 2 stages, one per worker; each "
        "batch is cut into 4 micro-batches that flow through the stages one after another, so both work at once "
        "most of the time.\n"
        "* `strategy=nbddp.TensorParallel()` splits each big `nn.Linear` across the workers instead.\n\n"
        "Either way the trained weights come back whole into the notebook's `model`. Two CPU workers here; the "
        "same cells run on GPUs (see `docs/topologies.md`)."
    ),
    nbf.v4.new_code_cell(
        "import copy\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "## A model as a sequence of blocks\n\n"
        "An `nn.Sequential` is cut between its children, balanced by parameter count (`split=[...]` names the "
        "cut points instead). Any other model is cut at its repeated blocks (the layers of a transformer)."
    ),
    nbf.v4.new_code_cell(
        "class Block(nn.Module):\n"
        "    def __init__(self, d):\n"
        "        super().__init__()\n"
        "        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)\n"
        "\n"
        "    def forward(self, x):\n"
        "        return x + self.fc2(F.gelu(self.fc1(x)))\n"
        "\n"
        "def make_model(d=32):\n"
        "    torch.manual_seed(0)\n"
        "    return nn.Sequential(nn.Linear(2, d), Block(d), Block(d), Block(d), Block(d), nn.Linear(d, 4))\n"
        "\n"
        "g = torch.Generator().manual_seed(0)\n"
        "x = torch.randn(512, 2, generator=g)\n"
        "y = ((torch.atan2(x[:, 1], x[:, 0]) + torch.pi) / (torch.pi / 2)).long().clamp(max=3)  # the quadrant\n"
        "model = make_model()\n"
        "print(model)"
    ),
    nbf.v4.new_markdown_cell("## Train it as a pipeline of 2 stages"),
    nbf.v4.new_code_cell(
        "start = copy.deepcopy(model)\n"
        "history = dist_fit(model, (x, y), epochs=2, batch_size=32, optimizer=torch.optim.SGD, lr=0.1,\n"
        "                   strategy=nbddp.Pipeline(stages=2, microbatches=4), shuffle=False, live='text')\n"
        "for r in history.ranks:\n"
        "    print(f\"rank {r['rank']}: stage {r['stage']}, {r['param_bytes'] / 1024:.1f} KiB of parameters\")"
    ),
    nbf.v4.new_markdown_cell(
        "The loss is computed on the last stage. The gradients are those of the whole batch, so the weights are "
        "the ones a single process trains on the same batches:"
    ),
    nbf.v4.new_code_cell(
        "alone = copy.deepcopy(start)\n"
        "opt = torch.optim.SGD(alone.parameters(), lr=0.1)\n"
        "for epoch in range(2):\n"
        "    for i in range(0, len(x), 32):\n"
        "        F.cross_entropy(alone(x[i:i + 32]), y[i:i + 32]).backward()\n"
        "        opt.step(); opt.zero_grad()\n"
        "diff = max((a - b).abs().max().item() for a, b in zip(model.state_dict().values(), alone.state_dict().values()))\n"
        "print(f'pipeline vs one process: largest weight difference {diff:.1e}')\n"
        "accuracy = (model(x).argmax(1) == y).float().mean().item()\n"
        "print(f'accuracy of the weights back in the notebook: {accuracy:.0%}')"
    ),
    nbf.v4.new_markdown_cell(
        "## Idle time\n\n"
        "Stage 2 waits for the first micro-batch, stage 1 for the last gradients: with `p` stages and `m` "
        "micro-batches a stage is idle about `(p - 1) / (m + p - 1)` of a step, 1/5 here. More micro-batches, "
        "less idle time (and `schedule='interleaved'` with several stages per worker less still); "
        "`benchmarks/bench_topologies.py` measures it."
    ),
    nbf.v4.new_markdown_cell(
        "## The same model, tensor parallel\n\n"
        "`TensorParallel()` finds the pairs of layers to split: each block's `fc1` by its outputs, `fc2` by its "
        "inputs (one all-reduce per block). Both workers read the same batch."
    ),
    nbf.v4.new_code_cell(
        "tp_model = make_model()\n"
        "h = dist_fit(tp_model, (x, y), epochs=2, batch_size=32, optimizer=torch.optim.SGD, lr=0.1,\n"
        "             strategy=nbddp.TensorParallel(), shuffle=False, live=False)\n"
        "for r in h.ranks:\n"
        "    print(f\"rank {r['rank']}: tp rank {r['tp_rank']}, {r['param_bytes'] / 1024:.1f} KiB of parameters\")\n"
        "diff = max((a - b).abs().max().item() for a, b in zip(tp_model.state_dict().values(), alone.state_dict().values()))\n"
        "print(f'tensor parallel vs one process: largest weight difference {diff:.1e}')"
    ),
    nbf.v4.new_markdown_cell(
        "With more workers, `mesh={'dp': 2, 'pp': 2}` (or `'tp'`) trains two pipelines on different data "
        "(`batch_size` is per pipeline), with DDP or FSDP over `dp`."
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/pipeline_parallel.ipynb")
