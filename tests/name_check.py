"""The names and files that nbddp's docstrings and comments mention, checked against the tree (``tests/test_house.py``).

A module moves, and the prose around the code keeps its old name: ``worker.entry``, ``tasks.RankTasks``,
``slurm_jobs.JobState``. These read the source (``ast`` and ``tokenize``), run nothing, and say which mention
names something that is not there. What is checked, in docstrings and comments under ``nbddp/``:

* ``nbddp.x.y``: a module, then at most a top-level name and one of its members (a class's method);
* ``a/b/c.py``: a file from the repository's root, from ``nbddp/``, or from a package that encloses the mention;
  a bare ``c.py`` that is an nbddp module must sit beside the mention (else say its folder); a path or a file
  name that is no nbddp folder or module (``train.py``, ``mylib.py``) is someone else's and is not checked;
* ``pkg.name``, where ``pkg`` is one of nbddp's packages (``worker.monitor``), and ``mod.Name``, where ``mod`` is
  one of its modules and ``Name`` a class or a constant (``early_stop.Patience``): they must resolve from a
  package or module of that name;
* ``a.b`` where no nbddp module is called ``a`` but ``b`` is a top-level name of one (``slurm_jobs.JobState``,
  ``rank_stacks.collect``): a module that no longer exists. A lowercase ``b`` counts only when no module of
  nbddp uses ``a`` as a name of its own (``study.tell``, ``group.x`` are objects in prose).

Not checked: a name the module itself binds (an import alias such as ``shipping`` for ``shipping/pickling.py``
is followed; a variable, ``handle.stop``, is not), names of other libraries, words in double backticks.
"""

from __future__ import annotations

import ast
import io
import re
import sys
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbddp"
ROOT_DIRS = {"nbddp", "docs", "tests", "scripts", "benchmarks"}
NAME = re.compile(r"(?<![\w./-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?![\w/-]|\.\w)")
PY_PATH = re.compile(r"(?<![\w./-])((?:[\w-]+/)*\w+\.py)\b")
FILE_ENDINGS = {"py", "md", "pt", "json", "txt", "log", "ipynb", "h", "distcp", "png", "html", "sh", "toml", "max"}
# other libraries, and the names the code gives them (``import torch.nn as nn``), read in prose as they are
LIBRARIES = set(sys.stdlib_module_names) | {
    "torch", "nn", "F", "dist", "dcp", "aten", "ipyparallel", "ipp", "ipywidgets", "IPython", "optuna", "datasets",
    "transformers", "accelerate", "lightning", "cloudpickle", "matplotlib", "numpy", "np", "pandas", "pd", "wandb",
    "mlflow", "torchmetrics", "psutil", "jupyter_client", "zmq", "self", "cls"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
TREES = {m: ast.parse(p.read_text()) for m, p in MODULES.items()}
PACKAGES = {m.rsplit(".", 1)[-1] for m, p in MODULES.items() if p.name == "__init__.py" and m != "nbddp"}
BASENAMES: dict[str, list[str]] = {}
for _m in MODULES:
    if _m != "nbddp":
        BASENAMES.setdefault(_m.rsplit(".", 1)[-1], []).append(_m)
FOLDERS = ROOT_DIRS | {p.name for p in PACKAGE.rglob("*") if p.is_dir() and p.name != "__pycache__"}


def _members(cls: ast.ClassDef) -> set[str]:
    """What ``Class.x`` can name: methods, nested classes, class attributes, ``self.x`` set anywhere in it."""
    names = set()
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
              and isinstance(node.ctx, ast.Store)):
            names.add(node.attr)
    return names


def _top_level(body: list[ast.stmt], names: dict[str, set[str] | None]) -> None:
    """Module-level names (``None``: not a class), into ``names``, through ``if``/``try``/``with`` blocks."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        elif isinstance(node, ast.ClassDef):
            names[node.name] = _members(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update({n.id: None for n in ast.walk(target) if isinstance(n, ast.Name)})
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in (node.body, getattr(node, "orelse", []), getattr(node, "finalbody", []),
                          *[h.body for h in getattr(node, "handlers", [])]):
                _top_level(block, names)


def _index() -> dict[str, dict[str, set[str] | None]]:
    top: dict[str, dict[str, set[str] | None]] = {}
    for m, tree in TREES.items():
        top[m] = {}
        _top_level(tree.body, top[m])
    for m in MODULES:  # a package's submodules are its attributes
        if "." in m:
            top[m.rsplit(".", 1)[0]].setdefault(m.rsplit(".", 1)[1], None)
    for node in TREES["nbddp"].body:  # nbddp.dist_fit and the other lazy public names
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("_LAZY", "_MOVED") for t in node.targets):
            top["nbddp"].update({k.value: None for k in node.value.keys})
    return top


TOP = _index()
def _defined() -> set[str]:
    """Names nbddp's modules define themselves (not imports): what ``gone_module.name`` is recognised by."""
    names = set()
    for tree in TREES.values():
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


DEFINED = _defined()


def resolves(name: str) -> bool:
    """``nbddp.a.b.C.m``: the longest module prefix, then a top-level name, then (for a class) one member."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in MODULES:
            rest, names = parts[cut:], TOP[module]
            if not rest:
                return True
            if rest[0] not in names or len(rest) > 2:
                return False
            return len(rest) == 1 or (names[rest[0]] is not None and rest[1] in names[rest[0]])
    return False


def _bound(tree: ast.AST) -> dict[str, str | None]:
    """Every name a module binds: the nbddp module an import alias stands for, else None."""
    out: dict[str, str | None] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname or a.name.split(".")[0]: a.name if a.asname and a.name in MODULES else None
                        for a in node.names})
        elif isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                        else None for a in node.names})
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out.setdefault(node.id, None)
        elif isinstance(node, ast.arg):
            out.setdefault(node.arg, None)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.setdefault(node.name, None)
    return out


BOUND_ANYWHERE = set().union(*(_bound(tree) for tree in TREES.values()))


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(source).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            text = first.value.value if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) else None
            if isinstance(text, str):
                found.append((first.lineno, text))
    return found


def name_problem(name: str, bound: dict[str, str | None]) -> str | None:
    """Why ``name`` (a dotted mention in a module that binds ``bound``) names nothing, or None."""
    head, parts = name.split(".")[0], name.split(".")
    if parts[-1] in FILE_ENDINGS:
        return None
    if head == "nbddp":
        return None if resolves(name) else "no such module or name"
    if head in bound:
        alias = bound[head]
        return None if alias is None or resolves(".".join([alias, *parts[1:]])) else f"{alias} has no {parts[1]}"
    if head in LIBRARIES or head[0].isupper():
        return None
    if head in PACKAGES or (head in BASENAMES and not parts[1][0].islower()):
        found = any(resolves(".".join([m, *parts[1:]])) for m in BASENAMES[head])
        return None if found else f"no {'.'.join(parts[1:])} in {' or '.join(BASENAMES[head])}"
    if head not in BASENAMES and parts[1] in DEFINED and (parts[1][0].isupper() or head not in BOUND_ANYWHERE):
        return f"no module {head} in nbddp"
    return None


def path_problem(where: Path, path: str) -> str | None:
    """Why ``path`` (a ``.py`` mentioned in the module at ``where``) is not there, or None."""
    if "/" in path:
        if path.split("/")[0] not in FOLDERS:
            return None
        enclosing = [p for p in where.parents if PACKAGE in p.parents]
        return None if any((base / path).is_file() for base in [ROOT, PACKAGE, *enclosing]) else "no such file"
    owners = sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob(path))
    if owners and not (where.parent / path).is_file():
        return f"not beside this module: write {' or '.join(owners)}"
    return None


def problems(where: Path, source: str) -> list[tuple[str, int, str, str]]:
    """(file, line, mention, why) for every mention in ``source`` (the module at ``where``) that names nothing."""
    rel, bound = where.relative_to(ROOT).as_posix(), _bound(ast.parse(source))
    found = []
    for line, text in prose(source):
        for name in sorted(set(NAME.findall(text))):
            why = name_problem(name, bound)
            if why:
                found.append((rel, line, name, why))
        for path in sorted(set(PY_PATH.findall(text))):
            why = path_problem(where, path)
            if why:
                found.append((rel, line, path, why))
    return found


# ---- citations: nothing outside the repository ------------------------------------------------------
MD_MENTION = re.compile(r"(?<![\w/.-])((?:\.\.?/|[\w-]+/)*[\w-]+\.md)\b")
LINK = re.compile(r"\]\(([^)\s#]+)")
OUTSIDE = re.compile(r"ipyparallel-facts|facts file|/work/")


def cited_files() -> list[Path]:
    """The files whose prose may cite: nbddp's code, tests, scripts, benchmarks, and the Markdown docs."""
    code = [*PACKAGE.rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "scripts").glob("*.py"),
            *(ROOT / "benchmarks").glob("*.py")]
    docs = [ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "benchmarks" / "README.md",
            *(ROOT / "docs").glob("*.md")]
    checkers = {ROOT / "tests" / "name_check.py", ROOT / "tests" / "test_house.py"}  # they name what not to cite
    return sorted(set(code) - checkers) + sorted(p for p in docs if p.is_file())


def citation_problems(where: Path, text: str) -> list[tuple[str, str]]:
    """(file, what) for each file outside the repository that ``text`` (from ``where``) cites."""
    rel = where.relative_to(ROOT).as_posix()
    if where.suffix == ".py":
        text = "\n".join(t for _, t in prose(text))
    found = [(rel, m.group(0)) for m in OUTSIDE.finditer(text)]
    for mention in MD_MENTION.findall(text):
        candidates = [(ROOT / mention).resolve(), (where.parent / mention).resolve()]
        if not any(c.is_file() and ROOT in c.parents for c in candidates):
            found.append((rel, mention))
    for target in LINK.findall(text) if where.suffix == ".md" else []:
        if not re.match(r"[a-z]+:", target) and ROOT not in (where.parent / target).resolve().parents:
            found.append((rel, target))
    return found
