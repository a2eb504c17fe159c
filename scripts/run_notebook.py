"""Execute a notebook with a real kernel (nbclient) from the repository root; save the result.

usage: python scripts/run_notebook.py IN.ipynb OUT.ipynb [--timeout S]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import nbformat
from nbclient import NotebookClient

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def execute(path: str, out: str | None = None, timeout: int = 600, cwd: str = ROOT) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": cwd}})
    client.execute()
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        nbformat.write(nb, out)
    return nb


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("notebook")
    parser.add_argument("output")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per cell")
    args = parser.parse_args()
    t0 = time.perf_counter()
    execute(args.notebook, args.output, args.timeout)
    print(f"executed {args.notebook} in {time.perf_counter() - t0:.1f} s -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
