"""Writes notebooks/finetune_hf_style.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Fine-tuning a Hugging Face-style model\n\n"
        "Models from `transformers` take a dict of tensors (`input_ids`, `attention_mask`, `labels`) and return "
        "an output object with `.loss` and `.logits`. `dist_fit` trains that shape as it is: a dict batch runs "
        "as `model(**batch)` and the loss is `output.loss`.\n\n"
        "To stay download-free and fast on a CPU, this notebook defines a tiny transformer classifier with the "
        "same interface, *pre-trains* it on one task, saves the weights, then loads them into a model with a "
        "fresh classification head and *fine-tunes* it on another task. With `transformers` installed, "
        "`AutoModelForSequenceClassification.from_pretrained(...)` and a tokenised dataset take the same path."
    ),
    nbf.v4.new_code_cell(
        "import os\n"
        "from dataclasses import dataclass\n"
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "from torch.utils.data import Dataset, DataLoader\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "## The model\n\n"
        "An embedding, one transformer encoder layer, mean pooling over the real (unmasked) tokens, and a "
        "classification head, returning a `SequenceClassifierOutput`-like object. Everything is defined in the "
        "notebook: nbddp ships the classes to the workers by value."
    ),
    nbf.v4.new_code_cell(
        "@dataclass\n"
        "class ClassifierOutput:\n"
        "    loss: torch.Tensor | None\n"
        "    logits: torch.Tensor\n"
        "\n"
        "class TinyConfig:\n"
        "    def __init__(self, vocab_size=32, hidden=32, heads=2, ff=64, max_len=32, num_labels=2):\n"
        "        self.vocab_size, self.hidden, self.heads, self.ff = vocab_size, hidden, heads, ff\n"
        "        self.max_len, self.num_labels = max_len, num_labels\n"
        "\n"
        "class TinyForSequenceClassification(nn.Module):\n"
        "    def __init__(self, config):\n"
        "        super().__init__()\n"
        "        self.config = config\n"
        "        self.embed = nn.Embedding(config.vocab_size, config.hidden, padding_idx=0)\n"
        "        self.pos = nn.Embedding(config.max_len, config.hidden)\n"
        "        self.encoder = nn.TransformerEncoderLayer(config.hidden, config.heads, config.ff,\n"
        "                                                  dropout=0.0, batch_first=True)\n"
        "        self.classifier = nn.Linear(config.hidden, config.num_labels)\n"
        "\n"
        "    def forward(self, input_ids, attention_mask=None, labels=None):\n"
        "        if attention_mask is None:\n"
        "            attention_mask = (input_ids != 0).long()\n"
        "        positions = torch.arange(input_ids.shape[1], device=input_ids.device)\n"
        "        h = self.embed(input_ids) + self.pos(positions)\n"
        "        h = self.encoder(h, src_key_padding_mask=attention_mask == 0)\n"
        "        mask = attention_mask.unsqueeze(-1).to(h.dtype)\n"
        "        pooled = (h * mask).sum(1) / mask.sum(1).clamp(min=1)\n"
        "        logits = self.classifier(pooled)\n"
        "        loss = F.cross_entropy(logits, labels) if labels is not None else None\n"
        "        return ClassifierOutput(loss=loss, logits=logits)\n"
        "\n"
        "    @classmethod\n"
        "    def from_pretrained(cls, path, num_labels):\n"
        "        \"\"\"The body's weights from `path`, a new randomly initialised head (as in transformers).\"\"\"\n"
        "        saved = torch.load(path)\n"
        "        config = TinyConfig(**{**saved['config'], 'num_labels': num_labels})\n"
        "        model = cls(config)\n"
        "        body = {k: v for k, v in saved['state_dict'].items() if not k.startswith('classifier.')}\n"
        "        missing, unexpected = model.load_state_dict(body, strict=False)\n"
        "        print(f'newly initialised (to be trained): {missing}')\n"
        "        return model"
    ),
    nbf.v4.new_markdown_cell(
        "## The data: a `Dataset` of dicts, padded per batch\n\n"
        "Sequences of token ids (1..31; 0 is padding) of random lengths. Items are dicts like a tokenised "
        "`datasets.Dataset`; a collate function pads each batch to its longest sequence and builds the "
        "`attention_mask`, like `DataCollatorWithPadding`. Passing a `DataLoader` tells `dist_fit` to use its "
        "`batch_size` (per rank) and `collate_fn`; nbddp replaces its sampler with a `DistributedSampler`."
    ),
    nbf.v4.new_code_cell(
        "class SequenceTask(Dataset):\n"
        "    \"\"\"Random token sequences; `rule(ids) -> label` defines the task.\"\"\"\n"
        "    def __init__(self, n, rule, seed):\n"
        "        g = torch.Generator().manual_seed(seed)\n"
        "        lengths = torch.randint(6, 17, (n,), generator=g)\n"
        "        self.items = []\n"
        "        for length in lengths.tolist():\n"
        "            ids = torch.randint(1, 32, (length,), generator=g)\n"
        "            self.items.append({'input_ids': ids, 'labels': rule(ids)})\n"
        "    def __len__(self):\n"
        "        return len(self.items)\n"
        "    def __getitem__(self, i):\n"
        "        return self.items[i]\n"
        "\n"
        "def pad_collate(items):\n"
        "    longest = max(len(it['input_ids']) for it in items)\n"
        "    ids = torch.zeros(len(items), longest, dtype=torch.long)\n"
        "    for row, it in enumerate(items):\n"
        "        ids[row, :len(it['input_ids'])] = it['input_ids']\n"
        "    return {'input_ids': ids, 'attention_mask': (ids != 0).long(),\n"
        "            'labels': torch.tensor([it['labels'] for it in items])}\n"
        "\n"
        "# pre-training task: is the sequence's mean token id above 16?  (a 'general' skill: reading every token)\n"
        "pretrain_rule = lambda ids: int(ids.float().mean() > 16)\n"
        "# fine-tuning task: which third of the vocabulary is most common in the sequence?  (3 labels)\n"
        "finetune_rule = lambda ids: int(torch.bincount((ids - 1) // 11, minlength=3).argmax())\n"
        "\n"
        "pretrain_train = DataLoader(SequenceTask(1024, pretrain_rule, seed=0), batch_size=32, collate_fn=pad_collate)\n"
        "finetune_train = DataLoader(SequenceTask(768, finetune_rule, seed=1), batch_size=32, collate_fn=pad_collate)\n"
        "finetune_val = DataLoader(SequenceTask(256, finetune_rule, seed=2), batch_size=64, collate_fn=pad_collate)\n"
        "pad_collate([finetune_train.dataset[0], finetune_train.dataset[1]])"
    ),
    nbf.v4.new_markdown_cell(
        "Metrics receive the model's output object and `batch['labels']`:"
    ),
    nbf.v4.new_code_cell(
        "def accuracy(output, labels):\n"
        "    return (output.logits.argmax(-1) == labels).float().mean()"
    ),
    nbf.v4.new_markdown_cell(
        "## Pre-training\n\n"
        "On two workers, each step sees 2 x 32 sequences. The trained weights come back into `base`, which we "
        "save the way a model hub checkpoint would be: a config plus a state dict."
    ),
    nbf.v4.new_code_cell(
        "torch.manual_seed(0)\n"
        "base = TinyForSequenceClassification(TinyConfig(num_labels=2))\n"
        "pre = dist_fit(base, pretrain_train, epochs=3, lr=3e-3, seed=0)\n"
        "os.makedirs('artifacts', exist_ok=True)\n"
        "torch.save({'config': vars(base.config), 'state_dict': base.state_dict()}, 'artifacts/tiny_pretrained.pt')\n"
        "print(f\"pre-training loss: {pre.epochs[0]['loss']:.3f} -> {pre.epochs[-1]['loss']:.3f}\")"
    ),
    nbf.v4.new_markdown_cell(
        "## Fine-tuning\n\n"
        "Load the pre-trained body with a new 3-label head and fine-tune everything with a smaller learning "
        "rate, a linear warm-up/decay schedule (stepped after every optimizer step) and gradient clipping, "
        "validating after each epoch. `val_loss` and `val_acc` are reduced over every rank's validation shard."
    ),
    nbf.v4.new_code_cell(
        "model = TinyForSequenceClassification.from_pretrained('artifacts/tiny_pretrained.pt', num_labels=3)\n"
        "\n"
        "def warmup_then_decay(optimizer, warmup=5, total=60):\n"
        "    ramp = lambda step: min(1.0, (step + 1) / warmup) * max(0.05, 1 - step / total)\n"
        "    return torch.optim.lr_scheduler.LambdaLR(optimizer, ramp)\n"
        "\n"
        "history = dist_fit(model, finetune_train, val_data=finetune_val, epochs=5, lr=2e-3,\n"
        "                   scheduler=warmup_then_decay, clip_grad_norm=1.0, metrics={'acc': accuracy}, seed=0)\n"
        "history.epochs[-1]"
    ),
    nbf.v4.new_markdown_cell("The fine-tuned weights are in the notebook's `model`; use it like any `nn.Module`:"),
    nbf.v4.new_code_cell(
        "model.eval()\n"
        "batch = next(iter(finetune_val))\n"
        "with torch.no_grad():\n"
        "    out = model(**batch)\n"
        "acc = accuracy(out, batch['labels']).item()\n"
        "first, last = history.epochs[0]['val_acc'], history.epochs[-1]['val_acc']\n"
        "print(f'validation accuracy: {first:.3f} after epoch 1, {last:.3f} after the last; '\n"
        "      f'{acc:.3f} on one batch in the notebook')\n"
        "assert last > 0.6 and last >= first"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/finetune_hf_style.ipynb")
