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
# pip is asked again only when what it installed from changed (pip's own "already satisfied" takes ~10 s)
stamp=$( (cat pyproject.toml constraints-dev.txt; echo "extras=${EXTRAS:-}") | sha256sum | cut -c1-16)
if [ "$(cat .venv/.nbddp-installed 2>/dev/null)" != "$stamp" ]; then
  out=$(.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints-dev.txt \
        -e ".[test${EXTRAS:+,$EXTRAS}]" 2>&1) || { echo "$out"; echo "setup: pip install failed" >&2; exit 1; }
  echo "$out" | grep -v "^WARNING: Location" || true
  echo "$stamp" > .venv/.nbddp-installed
fi
.venv/bin/python -c "import nbddp, torch, ipyparallel; print('nbddp', nbddp.__version__, '| torch', torch.__version__, '| ipyparallel', ipyparallel.__version__)"
