#!/usr/bin/env bash
# Creates .venv (if missing) and installs nbddp with its test extras.
# torch is pinned by constraints-dev.txt to the CPU build this kind of machine keeps on disk;
# pyproject.toml itself leaves the range open for users.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-dev.txt -e ".[test${EXTRAS:+,$EXTRAS}]" 2>&1 \
  | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import nbddp, torch, ipyparallel; print('nbddp', nbddp.__version__, '| torch', torch.__version__, '| ipyparallel', ipyparallel.__version__)"
