"""The test suite's own rules (docs/contributing.md), checked on the test sources: nothing runs.

* a test marked ``slow`` says in its docstring why it cannot be faster;
* the quick tier of ``scripts/test.sh --quick`` deselects only markers that
  are registered, and every marker a test uses is registered (pytest's
  ``--strict-markers`` enforces the second at collection; this names the file).
"""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _registered() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    return {line.split(":", 1)[0].strip() for line in config["markers"]}


def _marks(node: ast.AST) -> set[str]:
    """Marker names in ``pytest.mark.X`` expressions under ``node`` (a decorator list or a pytestmark value)."""
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Attribute) and sub.value.attr == "mark":
            found.add(sub.attr)
    return found


def _tests(path: Path) -> list[tuple[str, set[str], str]]:
    """(test name, its markers, its docstring) for every test function of a file, module marks included."""
    tree = ast.parse(path.read_text())
    module_marks: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            module_marks |= _marks(node.value)
    out = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = module_marks | set().union(*(_marks(d) for d in node.decorator_list))
            out.append((node.name, marks, ast.get_docstring(node) or ""))
    return out


def test_every_slow_test_says_why_it_cannot_be_faster():
    silent = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_*.py"))
              for name, marks, doc in _tests(path) if "slow" in marks and "faster" not in doc.lower()]
    assert not silent, (f"tests marked slow must say in their docstring why they cannot be faster "
                        f"(the word 'faster' in it): {silent}")


def test_every_heavy_test_says_what_makes_it_heavy():
    silent = [f"{path.name}::{name}" for path in sorted(TESTS.glob("test_*.py"))
              for name, marks, doc in _tests(path) if "heavy" in marks and "heavy" not in doc.lower()]
    assert not silent, f"tests marked heavy must say in their docstring what costs (the word 'heavy' in it): {silent}"


def test_every_marker_used_is_registered_and_the_quick_tier_names_registered_ones():
    registered = _registered()
    used = {m for path in TESTS.glob("test_*.py") for _, marks, _ in _tests(path) for m in marks}
    builtin = {"parametrize", "skip", "skipif", "xfail", "usefixtures", "filterwarnings", "timeout"}
    assert used - builtin <= registered, f"unregistered markers: {sorted(used - builtin - registered)}"
    script = (ROOT / "scripts" / "test.sh").read_text()
    expression = re.search(r'QUICK=\(-m "not \(([^)]*)\)"\)', script)
    assert expression, "scripts/test.sh has no QUICK=(-m \"not (...)\") tier"
    deselected = {w for w in expression.group(1).split() if w != "or"}
    assert deselected <= registered, sorted(deselected - registered)
    assert {"slow", "notebook", "browser", "faults", "bench"} <= deselected


def test_the_test_processes_take_the_files_in_the_order_conftest_gives():
    """pytest-xdist orders the files by their number of tests unless told not to: the one-test benchmark, soak and
    live-cost files then started last and ended the run alone."""
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--dist loadfile --no-loadscope-reorder" in script
