"""Render a results JSON as the markdown tables of docs/performance.md.

    python benchmarks/report.py benchmarks/results/<date>.json > /tmp/tables.md

The figures in the docs are pasted from this output, so each one traces back
to a results file and the command that made it.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
    return str(v)


def render(results: dict[str, Any]) -> str:
    env = results.get("environment", {})
    out = [
        f"Run: {env.get('time', '?')} on `{env.get('platform', '?')}`, {env.get('cpu_count', '?')} CPU cores, "
        f"{env.get('cuda_devices', 0)} GPU(s); Python {env.get('python', '?')}, torch {env.get('torch', '?')}, "
        f"ipyparallel {env.get('ipyparallel', '?')}, accelerate {env.get('accelerate', '-')}, nbddp {env.get('nbddp', '?')}.",
        "",
        "| benchmark | competitor | metric | median | ratio | ratio of |",
        "|---|---|---|---|---|---|",
    ]
    for row in results.get("summary_rows", []):
        out.append("| " + " | ".join(_fmt(row.get(k)) for k in ("bench", "competitor", "metric", "median", "ratio", "ratio_of")) + " |")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        sys.stdout.write(render(json.load(f)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
