"""Writes docs/img/scaling.png: nbddp.scaling_report on the workers this machine has (the picture in docs/planning.md).

    .venv/bin/python scripts/make_scaling_picture.py      # 2 CPU workers here; all GPUs on a GPU machine
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn as nn

import nbddp

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(8192, 256), torch.randint(0, 10, (8192,))
    nbddp.start()
    try:
        report = nbddp.scaling_report(model, (x, y), batch_size=64, steps=30, warmup=5)
    finally:
        nbddp.stop()
    print(report)
    out = ROOT / "docs" / "img" / "scaling.png"
    report.plot().savefig(out)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
