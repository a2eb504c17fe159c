"""Code lines per module and per function, without docstrings, comments or blank lines.

    python scripts/code_size.py            # modules over 300 and functions over 50 code lines
    python scripts/code_size.py --all      # every module

The house rules (issue "one place for each rule"): no function over about 50
code lines, no module over about 300. tests/test_house.py runs this check.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

MAX_MODULE = 300
MAX_FUNCTION = 50


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code: not blank, not only a comment, not part of a docstring."""
    tree = ast.parse(source)
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
                    and isinstance(body[0].value.value, str):
                doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines: set[int] = set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                        tokenize.ENDMARKER):
            continue
        for line in range(tok.start[0], tok.end[0] + 1):
            if line not in doc_lines:
                lines.add(line)
    return lines


def measure(path: Path) -> tuple[int, list[tuple[str, int]]]:
    source = path.read_text()
    lines = code_lines(source)
    functions = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = len([ln for ln in lines if node.lineno <= ln <= node.end_lineno])
            functions.append((node.name, n))
    return len(lines), functions


def violations(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        total, functions = measure(path)
        if total > MAX_MODULE:
            out.append(f"{path}: {total} code lines (limit {MAX_MODULE})")
        out += [f"{path}:{name}: {n} code lines (limit {MAX_FUNCTION})" for name, n in functions if n > MAX_FUNCTION]
    return out


def main(argv: list[str]) -> int:
    root = Path(__file__).resolve().parent.parent / "nbddp"
    if "--all" in argv:
        for path in sorted(root.rglob("*.py")):
            total, functions = measure(path)
            biggest = max((n for _, n in functions), default=0)
            print(f"{total:5d}  {biggest:4d}  {path.relative_to(root.parent)}")
    found = violations(root)
    print("\n".join(found) or "every module and function is within the limits")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
