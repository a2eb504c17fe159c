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


SHARED = ("nbddp.protocol", "nbddp.shipping", "nbddp.partitioning")  # what both sides import
WORKER = ("nbddp.worker",)
ENTRY_POINTS = ("nbddp.worker.tasks",)  # the only part of worker/ the kernel imports: what it sends


def inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _violations(where: tuple[str, ...], allowed: tuple[str, ...], unless: tuple[str, ...] = ()) -> list[str]:
    """Imports of nbddp modules from modules ``where`` that are not ``allowed``."""
    out = []
    for name, path in MODULES.items():
        if not inside(name, where) or inside(name, unless):
            continue
        for target, line, _ in imports_of(path):
            if target.startswith("nbddp") and not inside(target, allowed):
                out.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return out


def test_the_worker_side_imports_only_itself_and_the_shared_layer():
    assert _violations(WORKER, WORKER + SHARED) == []


def test_the_shared_layer_imports_nothing_above_it():
    assert _violations(SHARED, SHARED) == []


def test_the_kernel_imports_only_the_workers_entry_points():
    kernel_allowed = tuple(m for m in MODULES if not inside(m, WORKER)) + ENTRY_POINTS
    assert _violations(("nbddp",), kernel_allowed, unless=WORKER + SHARED) == []




def test_the_shared_layer_is_ordered_protocol_first():
    """``protocol/`` imports nothing of ``shipping/`` or ``partitioning/``; those two import ``protocol/`` only.

    The order (``nbddp/protocol/__init__.py`` says why): errors and records are what everyone shares, how
    objects travel and how a model is cut are built on them.
    """
    protocol = ("nbddp.protocol",)
    assert _violations(protocol, protocol) == []
    assert _violations(("nbddp.shipping",), protocol + ("nbddp.shipping",)) == []
    assert _violations(("nbddp.partitioning",), protocol + ("nbddp.partitioning",)) == []


def package_of(module: str) -> str:
    """The unit of the two-way rule: ``nbddp.fit``, ``nbddp.worker.data``, ``nbddp.api`` (a top-level file)."""
    parts = module.split(".")
    return ".".join(parts[:3] if parts[1:2] == ["worker"] and len(parts) > 2 else parts[:2])


def two_way_ties(edges: dict[str, set[str]]) -> list[str]:
    """Pairs of packages that import each other, each with one import of either way."""
    between: dict[tuple[str, str], str] = {}
    for source, targets in edges.items():
        for target in targets:
            a, b = package_of(source), package_of(target)
            if a != b:
                between.setdefault((a, b), f"{source} -> {target}")
    return sorted(f"{a} <-> {b}: {between[a, b]}, {between[b, a]}" for a, b in between if a < b and (b, a) in between)


def test_no_two_packages_import_each_other():
    """A package that imports another and is imported by it is one concept in two folders, or a move half made:
    put the shared part where both can import it (``nbddp/protocol/``, ``nbddp/worker/engine/``), or pass a
    callback in (``cluster/`` is handed ``live/job_line.py``'s ``JobLine``)."""
    assert two_way_ties(graph()) == []


def test_the_two_way_rule_would_see_a_tie():
    tied = {"nbddp.live.timeline": {"nbddp.profiling.trace_analysis"}, "nbddp.profiling.timeline": {"nbddp.live.plot"},
            "nbddp.worker.data.loaders": {"nbddp.worker.tasks.process_group"},
            "nbddp.worker.tasks.entry": {"nbddp.worker.data.loaders"}, "nbddp.worker.tasks.cells": {"nbddp.worker"}}
    assert two_way_ties(tied) == [
        "nbddp.live <-> nbddp.profiling: nbddp.live.timeline -> nbddp.profiling.trace_analysis, "
        "nbddp.profiling.timeline -> nbddp.live.plot",
        "nbddp.worker.data <-> nbddp.worker.tasks: nbddp.worker.data.loaders -> nbddp.worker.tasks.process_group, "
        "nbddp.worker.tasks.entry -> nbddp.worker.data.loaders"]

def test_the_engines_package_imports_only_itself_and_the_shared_layer():
    """``cluster/`` runs processes; what draws their wait (``live/job_line.py``) is handed to it by the session."""
    assert _violations(("nbddp.cluster",), ("nbddp.cluster",) + SHARED) == []

def test_the_rules_would_see_a_violation():
    """Each rule's scanner finds a forbidden import when there is one (else the rules above could not fail)."""
    assert inside("nbddp.worker.tasks.entry", ENTRY_POINTS) and not inside("nbddp.workerx", WORKER)
    entry = MODULES["nbddp.worker.tasks.entry"]
    assert any(t.startswith("nbddp.worker.training") for t, _, _ in imports_of(entry))
    assert _violations(("nbddp.worker.tasks.entry",), SHARED)  # entry imports worker/ modules: not shared ones


def test_the_tree_reads_as_packages_by_concern():
    """No more than 12 files directly under nbddp/, 8 under nbddp/worker/, and every package says what it owns."""
    top = [p for p in PACKAGE.iterdir() if p.is_file() and p.suffix == ".py"]
    worker = [p for p in (PACKAGE / "worker").iterdir() if p.is_file() and p.suffix == ".py"]
    assert len(top) <= 12 and len(worker) <= 8, (sorted(p.name for p in top), sorted(p.name for p in worker))
    for init in PACKAGE.rglob("__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)} has no docstring saying what the folder owns"


def test_worker_side_never_imports_the_kernels_display_code():
    forbidden = ("IPython.display", "IPython.core", "ipywidgets", "matplotlib")
    found = [f"{path.relative_to(ROOT)}:{line} imports {target}" for name, path in MODULES.items()
             if inside(name, WORKER) for target, line, _ in imports_of(path) if target.startswith(forbidden)]
    assert found == []


def test_live_views_never_import_torch_distributed():
    found = [f"{path.relative_to(ROOT)}:{line} imports {target}" for name, path in MODULES.items()
             if inside(name, ("nbddp.live",)) for target, line, _ in imports_of(path)
             if target.startswith(("torch.distributed", "nbddp.worker"))]
    assert found == []


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
    probe = PACKAGE / "worker" / "training" / "loop.py"
    targets = {t for t, _, _ in imports_of(probe)}
    assert "nbddp.worker.training.setup" in targets and "torch.distributed" in targets
    assert "nbddp.worker.training.loop" in graph()["nbddp.worker.tasks.entry"]  # a function-level import in entry.fit_task


DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_PYTHON = {"nbddp.resumed"}  # an MLflow tag prefix (docs/loggers.md), not a Python name


def test_every_dotted_name_in_the_docs_resolves_after_a_plain_import():
    """``nbddp.callbacks.Callback`` and every other ``nbddp.x.y`` the docs name: public ones from ``import nbddp``
    alone, module paths (``python -m nbddp.cluster.reaper``) by importing them."""
    import re
    import subprocess

    names = sorted({m for f in DOC_FILES for m in re.findall(r"\bnbddp(?:\.[A-Za-z_]\w*)+", f.read_text())}
                   - NOT_PYTHON)
    assert "nbddp.callbacks.Callback" in names and len(names) > 30
    script = r'''
import importlib, json, sys
import nbddp
bad = []
for name in json.loads(sys.argv[1]):
    obj, parts = nbddp, name.split(".")[1:]
    try:
        for part in parts:
            obj = getattr(obj, part)
        continue
    except AttributeError:
        pass
    public = parts[0] in nbddp.__all__ or parts[0] in ("callbacks", "shipping", "loggers")
    for cut in range(len(parts), 0, -1):  # a module path: import the longest module, then its attributes
        try:
            obj = importlib.import_module(".".join(["nbddp", *parts[:cut]]))
            for part in parts[cut:]:
                obj = getattr(obj, part)
            break
        except (ImportError, AttributeError):
            obj = None
    if obj is None or (public and cut < len(parts)):
        bad.append(name)
print(json.dumps(bad))
'''
    import json

    out = subprocess.run([sys.executable, "-c", script, json.dumps(names)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_moved_module_name_still_works_with_a_warning():
    import warnings

    import nbddp
    from nbddp.shipping import by_value

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert nbddp.modules.ship_by_value is by_value.ship_by_value
    assert any(issubclass(w.category, DeprecationWarning) and "nbddp.shipping" in str(w.message) for w in seen)


EXECUTION = ("nbddp.execution",)
SENDING = {"apply_async", "apply_sync", "apply", "map_async", "map_sync", "execute", "run"}  # ipyparallel's View


def _sends(path: Path, source: str | None = None) -> list[str]:
    """``x.apply_async(...)``-style calls in ``path`` (ipyparallel's ways to send a task), as ``file:line name``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                node.func.attr in ("apply_async", "apply_sync", "map_async", "map_sync") or _view_call(node)):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.func.attr}")
    return found


def _view_call(node: ast.Call) -> bool:
    """``client[...].apply(...)`` / ``.execute`` / ``.run``: a view made by subscripting, then a task sent on it."""
    assert isinstance(node.func, ast.Attribute)
    return node.func.attr in SENDING and isinstance(node.func.value, ast.Subscript)


def test_only_the_execution_package_sends_tasks_to_engines():
    """Every task the kernel sends goes through ``nbddp/execution/send.py`` (one AsyncResult per engine, the fault
    contract applied to it); the worker side sends none."""
    found = [hit for name, path in MODULES.items() if not inside(name, EXECUTION + WORKER) for hit in _sends(path)]
    assert found == []
    inside_execution = [hit for name, path in MODULES.items() if inside(name, EXECUTION) for hit in _sends(path)]
    assert inside_execution and all("execution/send.py" in hit for hit in inside_execution), inside_execution


def test_the_send_rule_would_see_a_task_sent_elsewhere():
    source = ("def f(client, p, g, view, df):\n    client[p].apply_async(g)\n    client[[1, 2]].apply(g)\n"
              "    view.apply_sync(g)\n    df.apply(g)\n")
    hits = _sends(PACKAGE / "fit" / "fit_run.py", source)
    assert [h.split()[-1] for h in hits] == ["apply_async", "apply", "apply_sync"]  # not a DataFrame's apply


OUTCOME_WORDS = ("EngineError", "Connection closed by peer", "PeerFailed")  # how a death and a consequence are told


def test_one_module_decides_what_became_of_a_rank():
    """Whether a rank died, raised, or failed because of a peer is decided in ``nbddp/execution/outcome.py`` alone:
    no other kernel module reads ipyparallel's ``EngineError`` or the words of a peer's failure."""
    found = []
    for name, path in MODULES.items():
        if inside(name, WORKER) or name == "nbddp.execution.outcome":
            continue
        text = path.read_text()
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        body = ast.get_docstring(ast.parse(text)) or ""
        found += [f"{path.relative_to(ROOT)}: {w}" for w in OUTCOME_WORDS if w in code.replace(body, "")]
    assert found == []


# ---- the prose around the code names what is there (tests/name_check.py says how) ----------------------------
import functools  # noqa: E402
import textwrap  # noqa: E402

import name_check  # noqa: E402

# Mentions the rules must let stand (none today): an entry that no longer matches anything fails
# test_each_exemption_still_names_a_stale_mention, so this list only shrinks.
BEING_MOVED: set[tuple[str, str]] = set()


@functools.cache
def stale_mentions() -> list[tuple[str, int, str, str]]:
    return [found for path in name_check.MODULES.values() for found in name_check.problems(path, path.read_text())]


@functools.cache
def outside_citations() -> list[tuple[str, str]]:
    return [c for path in name_check.cited_files() for c in name_check.citation_problems(path, path.read_text())]


def test_every_name_and_file_the_codes_docstrings_and_comments_mention_exists():
    """``nbddp.x.y``, ``worker/tasks/entry.py``, ``jobs.Job``: a module that moved takes its mentions with it."""
    found = [f"{path}:{line} {name}: {why}" for path, line, name, why in stale_mentions()
             if (path, name) not in BEING_MOVED]
    assert found == []


def test_the_name_check_would_see_a_stale_mention():
    source = textwrap.dedent('''\
        """Stale: ``worker.entry.fit_task``, ``tasks.RankTasks``, ``slurm_jobs.JobState``, ``nbddp.worker.monitor``,
        ``early_stop.Patience``, ``nbddp.fit.history.History.nothing``, ``worker/group.py``, ``fewer_ranks.py``,
        ``shipping.Nothing``.

        Fine: ``nbddp.worker.tasks.entry.fit_task``, ``nbddp.dist_fit``, ``nbddp.fit.history.History.plot``,
        ``worker/tasks/entry.py``, ``data/streams.py`` (from an enclosing package), ``setup.py`` (beside it),
        ``mylib.py``, ``handle.stop()``, ``history.steps``, ``torch.distributed``, ``shipping.Parcel`` (the alias
        below), ``fit_options.BestSpec``, ``e.g.``, ``step-1.pt``.
        """
        from nbddp.shipping import pickling as shipping  # ``slurm_jobs.query``: a comment counts too
        ''')
    where = name_check.PACKAGE / "worker" / "training" / "setup.py"
    found = {name: why for _, _, name, why in name_check.problems(where, source)}
    assert sorted(found) == sorted(["worker.entry.fit_task", "tasks.RankTasks", "slurm_jobs.JobState",
                                    "nbddp.worker.monitor", "early_stop.Patience", "nbddp.fit.history.History.nothing",
                                    "worker/group.py", "fewer_ranks.py", "shipping.Nothing", "slurm_jobs.query"])
    assert found["fewer_ranks.py"] == ("not beside this module: write elastic/fewer_ranks.py or "
                                      "worker/data/fewer_ranks.py")
    assert found["shipping.Nothing"] == "nbddp.shipping.pickling has no Nothing"
    assert found["slurm_jobs.JobState"] == "no module slurm_jobs in nbddp"


def test_every_file_path_the_docs_mention_exists():
    """``worker/tasks/entry.py`` in docs/design.md: paths from the repository's root or from ``nbddp/``."""
    import re

    paths = re.compile(r"(?<![\w./-])((?:[\w-]+/)+\w+\.py)\b")
    found = [f"{doc.relative_to(ROOT)}: {path}" for doc in DOC_FILES for path in paths.findall(doc.read_text())
             if name_check.path_problem(doc, path)]
    assert found == []


def test_nothing_cites_a_file_outside_the_repository():
    """No ``ipyparallel-facts.md``, no ``/work/...`` path, no ``design.md`` that is not the repository's own: what the
    code relies on is in ``docs/`` (``docs/ipyparallel-notes.md``)."""
    assert [c for c in outside_citations() if c not in BEING_MOVED] == []


def test_the_citation_check_would_see_one():
    doc = ROOT / "docs" / "faults.md"
    text = ("see `ipyparallel-facts.md`, [the spec](../../shared/design.md), /work/shared/style.md, `spec.md`;\n"
            "fine: [faults](faults.md#how-it-works), `docs/design.md`, [docs](https://ipyparallel.readthedocs.io)")
    assert sorted(w for _, w in name_check.citation_problems(doc, text)) == sorted(
        ["ipyparallel-facts", "../../shared/design.md", "../../shared/design.md", "/work/", "ipyparallel-facts.md",
         "spec.md"])
    code = '"""As ``design.md`` states (see the facts file); ``docs/dist_fit.md`` says it to a person."""\n'
    where = name_check.PACKAGE / "worker" / "data" / "batches.py"
    assert sorted(w for _, w in name_check.citation_problems(where, code)) == ["design.md", "facts file"]


def test_each_exemption_still_names_a_stale_mention():
    """Once the move fixed a mention (or moved its file), its entry in ``BEING_MOVED`` goes too."""
    seen = {(path, name) for path, _, name, _ in stale_mentions()} | set(outside_citations())
    assert sorted(BEING_MOVED - seen) == []


def package_cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Circles of imports through several packages (module ``edges`` folded into ``package_of``)."""
    folded: dict[str, set[str]] = {}
    for source, targets in edges.items():
        for target in targets:
            a, b = package_of(source), package_of(target)
            if a != b:
                folded.setdefault(a, set()).add(b)
    found, done = [], set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(folded.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                if frozenset(cycle) not in done:
                    done.add(frozenset(cycle))
                    found.append(cycle)
            elif len(path) < 12:
                walk(nxt, path + [nxt])

    for start in sorted(folded):
        walk(start, [start])
    return found


def test_the_packages_form_layers():
    """No circle of imports through several packages (``elastic`` -> ``jobs`` -> ``session`` -> ``elastic`` was one):
    every package sits below those that import it, and the public face (``api``, ``magics``) above all."""
    assert package_cycles(graph()) == []
    above = [f"{name} imports {t}" for name, targets in graph().items() for t in targets
             if t in ("nbddp", "nbddp.api", "nbddp.magics") and name not in ("nbddp", "nbddp.api", "nbddp.magics")]
    assert above == []


def test_the_layer_rule_would_see_a_circle():
    circle = {"nbddp.elastic.recovery": {"nbddp.jobs.rank_tasks"}, "nbddp.jobs.rank_tasks": {"nbddp.session.session"},
              "nbddp.session.session": {"nbddp.elastic.spare"}, "nbddp.fit.fit_run": {"nbddp.elastic.recovery"}}
    assert package_cycles(circle) == [["nbddp.elastic", "nbddp.jobs", "nbddp.session"]]
