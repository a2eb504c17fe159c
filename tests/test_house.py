"""The house rules, checked on the source: sizes, import direction, no cycles, no private names across modules.

These read the code (``ast``), they run nothing: a rule broken by a change
fails here with the module and line that broke it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbddp"
sys.path.insert(0, str(ROOT / "scripts"))

import code_size  # noqa: E402


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path) -> list[tuple[str, int, list[str]]]:
    """(module imported, line, names taken from it) for every import in the file, function-level ones too."""
    tree = ast.parse(path.read_text())
    this = module_name(path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                package = this.split(".")[: len(this.split(".")) - node.level + (path.name == "__init__.py")]
                base = ".".join([*package, base] if base else package)
            names = [alias.name for alias in node.names]
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
            rest = [n for n in names if f"{base}.{n}" not in MODULES]
            if rest or not submodules:  # `from nbddp import shipping` imports the submodule, not the package's names
                found.append((base, node.lineno, rest))
            found += [(m, node.lineno, []) for m in submodules]
    return found


def graph() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {m: set() for m in MODULES}
    for name, path in MODULES.items():
        for target, _, _ in imports_of(path):
            if target in MODULES and target != name:
                edges[name].add(target)
    return edges


def test_no_function_over_50_and_no_module_over_300_code_lines():
    assert code_size.violations(PACKAGE) == []


def test_the_line_counter_skips_docstrings_comments_and_blank_lines():
    source = 'def f():\n    """doc\n    string"""\n    # comment\n\n    return 1\n'
    assert code_size.code_lines(source) == {1, 6}


def test_no_import_cycle():
    edges = graph()
    index, low, stack, on_stack, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert cycles == []


def _violations(prefix: str, forbidden: tuple[str, ...]) -> list[str]:
    out = []
    for name, path in MODULES.items():
        if not name.startswith(prefix):
            continue
        for target, line, _ in imports_of(path):
            if target.startswith(forbidden):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return out


def test_worker_side_never_imports_the_kernels_display_code():
    forbidden = ("nbddp.live", "nbddp.magics", "nbddp.health", "nbddp.cells", "nbddp.output", "IPython.display",
                 "IPython.core", "ipywidgets", "matplotlib")
    assert _violations("nbddp.worker", forbidden) == []


def test_live_views_never_import_torch_distributed():
    assert _violations("nbddp.live", ("torch.distributed", "nbddp.worker")) == []


def test_no_private_name_crosses_a_module():
    """``from nbddp.x import _y`` and ``nbddp_module._y`` are private names used from outside."""
    found = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for target, line, names in imports_of(path):
            found += [f"{path.relative_to(ROOT)}:{line} imports {target}.{n}" for n in names
                      if target.startswith("nbddp") and n.startswith("_") and not n.startswith("__")]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nbddp"):
                aliases.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names
                                if f"{node.module}.{a.name}" in MODULES})
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("nbddp")})
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} uses {node.value.id}.{node.attr}")
            if isinstance(node, ast.Attribute) and node.attr == "_config":
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} reads ipyparallel's private ._config")
    assert found == []


def test_the_checks_see_what_they_look_for(tmp_path):
    """The import scanner finds function-level and relative imports (else the rules above could not fail)."""
    probe = PACKAGE / "worker" / "loop.py"
    targets = {t for t, _, _ in imports_of(probe)}
    assert "nbddp.worker.setup" in targets and "torch.distributed" in targets
    assert "nbddp.worker.loop" in graph()["nbddp.worker.entry"]  # a function-level import in entry.fit_task
