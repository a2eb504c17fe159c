"""Every measured figure in the README and the docs names its result file, and equals it.

    .venv/bin/python scripts/doc_figures.py README.md docs/performance.md    # each problem, or "ok"

Two markups, both HTML comments (invisible on GitHub and in the API site):

* a figure written in prose or a table carries its source right after it::

      0.99<!-- src: 2026-11-30_104055.json row throughput/mlp nbddp_live_off "samples/s" ratio -->

  ``row BENCH COMPETITOR METRIC FIELD`` picks a row of the file's ``summary_rows`` (what
  ``benchmarks/report.py`` prints); ``key K1 K2 ...`` walks the JSON (integers index lists). In a key
  path, ``*`` takes every item of a list (or every value of a dict) and walks the rest of the path in each,
  and a last ``min``, ``max`` or ``median`` reduces the list reached: the ends of a range written
  ``0.45-0.74`` are often the extremes of per-repetition figures that the file keeps only as a list.
  ``match REGEX`` reads a text file (a log under ``benchmarks/results/``) and takes the first group of the
  first match, for figures that a run kept only in its log. A last
  ``x1000`` scales the value (seconds written as ms). The written figure must equal the value rounded to
  as many decimals as it is written with (``0.99`` for 0.994; ``2.0`` for 1.95; ``15,654`` for 15654.2).
  The file is under ``benchmarks/results/``.

* ``<!-- figures -->`` ... ``<!-- /figures -->`` marks measured prose: every number in it (outside
  backticks) must carry a source, so a figure typed by hand, with none, fails too.

* ``<!-- goal -->`` or ``<!-- setting -->`` right after a number and its unit says it is not a measurement
  (a goal, a threshold, a size chosen for a benchmark). ``unsourced`` lists every number followed by a
  unit of measure (``ms``, ``s``, ``x``, ``%``, ``GB/s``, ``MiB``, ``samples/s``...) outside the figures
  regions, the report blocks and code that has neither a source nor such a mark; the test holds
  docs/performance.md to none.

* ``<!-- report: FILE -->`` ... ``<!-- /report -->`` holds ``benchmarks/report.py FILE``'s output exactly
  (the table is generated from the file; an edit by hand fails).

``tests/test_doc_figures.py`` runs ``check`` and ``unsourced`` on README.md and docs/performance.md, and
``check`` on docs/sessions.md and docs/report.md.
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
NUMBER = r"(?:(?<![\w.>])-)?(?<![\w.])\d[\d,]*(?:\.\d+)?"  # "-->-0.86": a range's dash, not a sign
SOURCED = re.compile(rf"({NUMBER})\s?<!-- src: (.*?) -->")
REGION = re.compile(r"<!-- figures -->(.*?)<!-- /figures -->", re.S)
REPORT = re.compile(r"<!-- report: (\S+) -->\n(.*?)<!-- /report -->", re.S)
UNIT = r"(?:µs|us|ms|s|min|x|%|[KMG]i?B/s|[KMG]i?B|samples/s)"
MEASURE = re.compile(rf"({NUMBER}(?: ?(?:-|to|/|\+) ?{NUMBER})* ?{UNIT})(?![\w/])( ?<!-- (?:goal|setting) -->)?")
REDUCERS = {"min": min, "max": max, "median": lambda xs: sorted(xs)[len(xs) // 2] if len(xs) % 2 else
            (sorted(xs)[len(xs) // 2 - 1] + sorted(xs)[len(xs) // 2]) / 2}


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
    if how == "match":
        return _matched(name, " ".join(path)) * scale
    data = _load(name)
    if how == "row":
        bench, competitor, metric, field = path
        rows = [r for r in data["summary_rows"] if (r["bench"], r["competitor"], r["metric"]) == (bench, competitor,
                                                                                                  metric)]
        if len(rows) != 1:
            raise KeyError(f"{name} has {len(rows)} summary rows {bench} / {competitor} / {metric}")
        value = rows[0][field]
    elif how == "key":
        value = _walk(data, path)
    else:
        raise ValueError(f"a source is 'FILE row ...', 'FILE key ...' or 'FILE match REGEX', got {source!r}")
    return float(value) * scale


def _matched(name: str, pattern: str) -> float:
    """The first group of ``pattern``'s first match in the text file ``name``: some runs kept their figures only
    in a log (``2026-12-04_gpu_check/check.log``), which is the result file then."""
    with open(os.path.join(RESULTS, name), encoding="utf-8") as f:
        found = re.search(pattern, f.read())
    if found is None:
        raise KeyError(f"{name} has no match for {pattern!r}")
    return float(found.group(1).replace(",", ""))


def _flat(values: Any) -> list[float]:
    """The numbers of ``values``, nested lists (a ``*`` inside a ``*``) flattened."""
    return [x for v in values for x in _flat(v)] if isinstance(values, list) else [float(values)]


def _walk(value: Any, path: list[str]) -> Any:
    """``value`` at ``path``: integers index lists, ``*`` maps the rest of the path over every item, and a last
    ``min``/``max``/``median`` reduces a list of numbers (a key of that name in a dict is looked up as usual)."""
    for i, key in enumerate(path):
        if key == "*":
            rest = path[i + 1:]
            reducer = REDUCERS.get(rest[-1]) if rest else None
            items = value if isinstance(value, list) else list(value.values())
            mapped = [_walk(item, rest[:-1] if reducer else rest) for item in items]
            return reducer(_flat(mapped)) if reducer else mapped
        if isinstance(value, list) and key in REDUCERS and i == len(path) - 1:
            return REDUCERS[key](_flat(value))
        value = value[int(key)] if isinstance(value, list) else value[key]
    return value


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


def unsourced(text: str) -> list[str]:
    """The measured-looking figures of ``text`` with no source: a number (or a range ``a-b``) followed by a unit,
    outside figures regions, report blocks, code and backticks, with neither ``<!-- src: -->`` nor
    ``<!-- goal -->``/``<!-- setting -->`` after it. Each as ``LINE: figure``."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))  # noqa: E731 -- keeps the line numbers
    plain = REPORT.sub(blank, text)
    plain = REGION.sub(blank, plain)
    plain = re.sub(r"```.*?```", blank, plain, flags=re.S)
    plain = re.sub(r"`[^`\n]*`", blank, plain)
    plain = SOURCED.sub(blank, plain)
    plain = re.sub(r"<!-- (?!goal -->|setting -->).*?-->", blank, plain, flags=re.S)
    plain = re.sub(r"\]\([^)]*\)", blank, plain)  # link targets
    return [f"{_line(plain, m.start())}: {m.group(1)}" for m in MEASURE.finditer(plain) if not m.group(2)]


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
    files = sys.argv[1:] or ["README.md", "docs/performance.md"]
    found = check(*files)
    for rel in files:
        with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
            found += [f"{rel}:{where} has no source (or mark it <!-- goal --> or <!-- setting -->)"
                      for where in unsourced(f.read())]
    print("\n".join(found) or "ok")
    sys.exit(1 if found else 0)
