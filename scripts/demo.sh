#!/usr/bin/env bash
# The main job, no GPU needed: set up, then execute notebooks/quickstart.ipynb headless with a real
# Jupyter kernel (2 workers). Leaves artifacts/quickstart.ipynb (executed) and artifacts/quickstart_loss.png.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python scripts/run_notebook.py notebooks/quickstart.ipynb artifacts/quickstart.ipynb
echo "executed notebook: artifacts/quickstart.ipynb   loss curves: artifacts/quickstart_loss.png"
