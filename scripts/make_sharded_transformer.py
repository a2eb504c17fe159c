"""Writes notebooks/sharded_transformer.ipynb (kept as code so the notebook diff stays reviewable)."""

import nbformat as nbf

cells = [
    nbf.v4.new_markdown_cell(
        "# Sharding a small transformer with FSDP\n\n"
        "`dist_fit(..., strategy=\"fsdp\")` trains with FSDP2: each worker holds half of every parameter, "
        "gradient and optimizer state (with 2 workers), and gathers a layer's full weights only while the "
        "layer runs. The trained weights still come back into the notebook's `model`.\n\n"
        "A tiny character-level language model on two CPU workers, so it runs anywhere in a minute; on GPUs "
        "the same cell shards across them."
    ),
    nbf.v4.new_code_cell(
        "import torch, torch.nn as nn, torch.nn.functional as F\n"
        "import nbddp\n"
        "%load_ext nbddp"
    ),
    nbf.v4.new_code_cell("%ddp start -n 2"),
    nbf.v4.new_markdown_cell(
        "## The model\n\n"
        "A stack of identical transformer blocks in an `nn.ModuleList`. nbddp shards each block as one unit "
        "(a repeated child of the model), then the rest (embeddings, final norm, head)."
    ),
    nbf.v4.new_code_cell(
        "class Block(nn.Module):\n"
        "    def __init__(self, d, heads):\n"
        "        super().__init__()\n"
        "        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)\n"
        "        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)\n"
        "        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))\n"
        "\n"
        "    def forward(self, x):\n"
        "        T = x.shape[1]\n"
        "        causal = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), 1)\n"
        "        h = self.ln1(x)\n"
        "        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]\n"
        "        return x + self.mlp(self.ln2(x))\n"
        "\n"
        "class TinyLM(nn.Module):\n"
        "    def __init__(self, vocab, d=64, heads=4, layers=2, block_size=32):\n"
        "        super().__init__()\n"
        "        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(block_size, d)\n"
        "        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])\n"
        "        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)\n"
        "\n"
        "    def forward(self, idx):\n"
        "        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))\n"
        "        for block in self.blocks:\n"
        "            x = block(x)\n"
        "        return self.head(self.ln(x))"
    ),
    nbf.v4.new_markdown_cell("## The data: next-character prediction on a short text"),
    nbf.v4.new_code_cell(
        "text = ('the quick brown fox jumps over the lazy dog. ' * 40 + 'pack my box with five dozen liquor jugs. ' * 40)\n"
        "chars = sorted(set(text))\n"
        "ids = torch.tensor([chars.index(c) for c in text])\n"
        "block = 32\n"
        "starts = torch.arange(0, len(ids) - block - 1, 4)\n"
        "x = torch.stack([ids[s:s + block] for s in starts])\n"
        "y = torch.stack([ids[s + 1:s + block + 1] for s in starts])\n"
        "\n"
        "def lm_loss(logits, target):\n"
        "    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))\n"
        "\n"
        "print(f'{len(x)} sequences of {block} characters, vocabulary {len(chars)}')"
    ),
    nbf.v4.new_markdown_cell(
        "## Train, sharded\n\n"
        "`strategy=\"fsdp\"` is `nbddp.FSDP()` with its defaults; `activation_checkpointing=True` also "
        "recomputes each block's activations in backward instead of keeping them (same weights, less memory)."
    ),
    nbf.v4.new_code_cell(
        "torch.manual_seed(0)\n"
        "model = TinyLM(len(chars))\n"
        "history = dist_fit(model, (x, y), epochs=4, batch_size=16, lr=3e-3, loss_fn=lm_loss,\n"
        "                   strategy='fsdp', activation_checkpointing=True, live='text')\n"
        "total = sum(p.numel() * p.element_size() for p in model.parameters())\n"
        "for r in history.ranks:\n"
        "    print(f\"rank {r['rank']} held {r['param_bytes'] / total:.0%} of the {total / 1e6:.2f} MB of parameters\")"
    ),
    nbf.v4.new_markdown_cell("The full trained weights are back in the notebook's `model`: generate some text here."),
    nbf.v4.new_code_cell(
        "model.eval()\n"
        "idx = torch.tensor([[chars.index(c) for c in 'the quick ']])\n"
        "with torch.no_grad():\n"
        "    for _ in range(30):\n"
        "        nxt = model(idx[:, -block:])[0, -1].argmax()\n"
        "        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)\n"
        "sample = ''.join(chars[i] for i in idx[0])\n"
        "print(repr(sample))\n"
        "print('loss per epoch:', [round(e['loss'], 3) for e in history.epochs])\n"
        "assert history.epochs[-1]['loss'] < 0.5 * history.epochs[0]['loss']"
    ),
    nbf.v4.new_markdown_cell(
        "## Keep the sharded model on the workers\n\n"
        "For a model too big for the notebook, `return_weights=False` leaves `model` alone and `keep=\"lm\"` binds "
        "the trained (still sharded) module to `lm` on every rank, for `%%ddp` cells. Every rank must run the "
        "forward (it gathers each block's weights from all ranks)."
    ),
    nbf.v4.new_code_cell(
        "dist_fit(TinyLM(len(chars)), (x, y), epochs=1, batch_size=16, loss_fn=lm_loss, strategy='fsdp',\n"
        "         keep='lm', return_weights=False, live=False)\n"
        "nbddp.push(probe=x[:2])"
    ),
    nbf.v4.new_code_cell(
        "%%ddp\n"
        "import torch\n"
        "with torch.no_grad():\n"
        "    logits = lm(probe)\n"
        "print(type(lm).__name__, tuple(logits.shape))"
    ),
    nbf.v4.new_code_cell("%ddp stop"),
]
nb = nbf.v4.new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
nbf.write(nb, "notebooks/sharded_transformer.ipynb")
