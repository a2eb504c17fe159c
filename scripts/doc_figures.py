"""Every measured figure in the README and the docs names its result file, and equals it.

    .venv/bin/python scripts/doc_figures.py README.md docs/performance.md    # each mismatch, or "ok"

Two markups, both HTML comments (invisible on GitHub and in the API site):

* a figure written in prose or a table carries its source right after it::

      0.99<!-- src: 2026-11-30_104055.json row throughput/mlp nbddp_live_off "samples/s" ratio -->

  ``row BENCH COMPETITOR METRIC FIELD`` picks a row of the file's ``summary_rows`` (what
  ``benchmarks/report.py`` prints); ``key K1 K2 ...`` walks the JSON (integers index lists). A last
  ``x1000`` scales the value (seconds written as ms). The written figure must equal the value rounded to
  as many decimals as it is written with (``0.99`` for 0.994; ``2.0`` for 1.95; ``15,654`` for 15654.2).
  The file is under ``benchmarks/results/``.

* ``<!-- figures -->`` ... ``<!-- /figures -->`` marks measured prose: every number in it (outside
  backticks) must carry a source, so a figure typed by hand, with none, fails too.

* ``<!-- report: FILE -->`` ... ``<!-- /report -->`` holds ``benchmarks/report.py FILE``'s output exactly
  (the table is generated from the file; an edit by hand fails).

``tests/test_doc_figures.py`` runs ``check`` on README.md, docs/performance.md and docs/sessions.md.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
NUMBER = r"(?<![\w.])-?\d[\d,]*(?:\.\d+)?"
SOURCED = re.compile(rf"({NUMBER})\s?<!-- src: (.*?) -->")
REGION = re.compile(r"<!-- figures -->(.*?)<!-- /figures -->", re.S)
REPORT = re.compile(r"<!-- report: (\S+) -->\n(.*?)<!-- /report -->", re.S)


def _load(name: str) -> Any:
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        return json.load(f)


def value_of(source: str) -> float:
    """The number ``source`` (``FILE row ...`` or ``FILE key ...``, maybe ``xN`` last) names."""
    parts = shlex.split(source)
    scale = 1.0
    if len(parts) > 2 and re.fullmatch(r"x[\d.]+", parts[-1]):
        scale = float(parts.pop()[1:])
    name, how, *path = parts
    data = _load(name)
    if how == "row":
        bench, competitor, metric, field = path
        rows = [r for r in data["summary_rows"] if (r["bench"], r["competitor"], r["metric"]) == (bench, competitor,
                                                                                                  metric)]
        if len(rows) != 1:
            raise KeyError(f"{name} has {len(rows)} summary rows {bench} / {competitor} / {metric}")
        value = rows[0][field]
    elif how == "key":
        value = data
        for key in path:
            value = value[int(key)] if isinstance(value, list) else value[key]
    else:
        raise ValueError(f"a source is 'FILE row ...' or 'FILE key ...', got {source!r}")
    return float(value) * scale


def matches(written: str, value: float) -> bool:
    """``written`` is ``value`` rounded to as many decimals as it is written with."""
    text = written.replace(",", "")
    decimals = len(text.split(".")[1]) if "." in text else 0
    return abs(round(value, decimals) - float(text)) < 10 ** -(decimals + 6) or \
        f"{value:.{decimals}f}" == text


def _line(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def _bare_numbers(region: str) -> list[str]:
    """The numbers of ``region`` with no source after them (backticked text and the comments left out)."""
    plain = re.sub(r"`[^`]*`", "", SOURCED.sub("", region))
    plain = re.sub(r"<!--.*?-->", "", plain, flags=re.S)
    return re.findall(NUMBER, plain)


def check_text(text: str, where: str) -> list[str]:
    """Every problem of one document: a figure unlike its source, a source that does not resolve, a number in a
    figures region with no source, a report block unlike its file."""
    problems = []
    for m in SOURCED.finditer(text):
        written, source = m.group(1), m.group(2)
        try:
            value = value_of(source)
        except (OSError, KeyError, IndexError, ValueError, TypeError) as exc:
            problems.append(f"{where}:{_line(text, m.start())}: {written}: its source {source!r} does not resolve "
                            f"({type(exc).__name__}: {exc})")
            continue
        if not matches(written, value):
            problems.append(f"{where}:{_line(text, m.start())}: {written} is written, and {source!r} says {value:.6g}")
    for m in REGION.finditer(text):
        for bare in _bare_numbers(m.group(1)):
            problems.append(f"{where}:{_line(text, m.start())}: {bare} in a figures region has no source "
                            "(add <!-- src: FILE ... --> after it)")
    for m in REPORT.finditer(text):
        sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
        import report

        if m.group(2).strip() != report.render(_load(m.group(1))).strip():
            problems.append(f"{where}:{_line(text, m.start())}: the table differs from benchmarks/report.py "
                            f"{m.group(1)}; regenerate it, never edit it by hand")
    return problems


def check(*relative: str) -> list[str]:
    problems = []
    for rel in relative:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            problems += check_text(f.read(), rel)
    return problems


if __name__ == "__main__":
    found = check(*(sys.argv[1:] or ["README.md", "docs/performance.md"]))
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
