"""Writes docs/img/compare-lr.png: two real fits (two learning rates) on one figure, the picture in docs/loggers.md.

    .venv/bin/python scripts/make_loggers_figure.py     # 2 CPU workers here, about half a minute

The two fits also write one CSV (``CSV(path)``: both runs in one file), which
is read back with pandas and printed, as a later notebook would compare them.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
import torch.nn as nn
from sklearn.datasets import load_digits

import nbddp
from nbddp.loggers import CSV

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x, dtype=torch.float32) / 16.0, torch.tensor(y)
    train, val = (x[:1400], y[:1400]), (x[1400:], y[1400:])
    histories, labels = [], []
    with tempfile.TemporaryDirectory() as tmp:
        csv = Path(tmp) / "metrics.csv"
        nbddp.start(n=2)
        try:
            for lr in (1e-3, 1e-2):
                torch.manual_seed(0)
                model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
                histories.append(nbddp.dist_fit(model, train, val_data=val, epochs=4, batch_size=32, lr=lr,
                                                val_every=10, log_every=2, live=False, loggers=[CSV(csv, name=f"lr={lr:g}")]))
                labels.append(f"lr {lr:g}")
        finally:
            nbddp.stop()
        import pandas as pd

        print(pd.read_csv(csv).query("kind == 'epoch'")[["run", "epoch", "step", "loss", "val_loss"]])
    fig = nbddp.plot_histories(histories, labels=labels, title="two learning rates, AdamW, 2 workers (digits)")
    out = ROOT / "docs" / "img" / "compare-lr.png"
    fig.savefig(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
