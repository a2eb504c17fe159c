"""The package type-checks: ``mypy`` as ``pyproject.toml`` configures it (``[tool.mypy]``) finds nothing.

The execution package and the shared layer (``protocol/``, ``shipping/``)
are checked inside untyped functions too (``check_untyped_defs``). The
kernel-side parameters typed ``Any`` are counted, so that what issue 42
brought under 100 stays there.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nbddp"
MOST_ANY = 100  # kernel-side parameters annotated ``Any`` (issue 42: 488 before)


@pytest.mark.heavy
def test_mypy_finds_nothing():
    """Heavy: mypy reads torch's, ipyparallel's and IPython's typed sources too: about 60-90 CPU-seconds with a
    cold cache (a fresh clone), a few with the cache it leaves in ``.mypy_cache/``."""
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]


def any_parameters(root: Path) -> list[str]:
    """``file:line name`` of every parameter annotated exactly ``Any`` in ``root``, outside ``worker/``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if "worker" in path.relative_to(root).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                found += [f"{path.relative_to(root)}:{node.lineno} {a.arg}" for a in args
                          if a.annotation is not None and ast.unparse(a.annotation) in ("Any", "typing.Any")]
    return found


def test_kernel_side_parameters_typed_any_stay_under_the_bound():
    found = any_parameters(PACKAGE)
    assert len(found) < MOST_ANY, f"{len(found)} parameters typed Any (bound {MOST_ANY}):\n" + "\n".join(found)


def test_the_count_sees_an_any_parameter(tmp_path):
    (tmp_path / "m.py").write_text("from typing import Any\ndef f(a: Any, b: int, c: 'Any') -> None: ...\n")
    (tmp_path / "worker").mkdir()
    (tmp_path / "worker" / "w.py").write_text("from typing import Any\ndef g(a: Any) -> None: ...\n")
    assert any_parameters(tmp_path) == ["m.py:2 a"]


OVERLOADS = '''
from typing import Any

from typing_extensions import assert_type

import nbddp
from nbddp.cells.call_handle import CallHandle
from nbddp.fit.handle import FitHandle
from nbddp.fit.history import History
from nbddp.inference.predict_run import PredictHandle
from nbddp.sweeps.handle import SweepHandle
from nbddp.sweeps.result import SweepResult


def calls(model: Any, data: Any, flag: bool) -> None:
    assert_type(nbddp.dist_fit(model, data), History)
    assert_type(nbddp.dist_fit(model, data, epochs=2, block=True), History)
    assert_type(nbddp.dist_fit(model, data, block=False), FitHandle)
    assert_type(nbddp.dist_fit(model, data, block=flag), History | FitHandle)
    assert_type(nbddp.dist_fit(model, data, block=False).result(), History)
    assert_type(nbddp.sweep(model, data, space={}, n_trials=2), SweepResult)
    assert_type(nbddp.sweep(model, data, space={}, n_trials=2, block=False), SweepHandle)
    assert_type(nbddp.sweep(model, data, space={}, n_trials=2, block=False).result(), SweepResult)
    assert_type(nbddp.predict(model, data, block=False), PredictHandle[Any])
    assert_type(nbddp.evaluate(model, data, metrics={}), dict[str, Any])
    assert_type(nbddp.evaluate(model, data, metrics={}, block=False).result(), dict[str, Any])
    assert_type(nbddp.run(print, 1), list[Any])
    assert_type(nbddp.run(print, 1, block=False), CallHandle)
    reveal_type(nbddp.dist_fit(model, data, block=False))


async def awaited(model: Any, data: Any) -> None:
    assert_type(await nbddp.dist_fit(model, data, block=False), History)
    assert_type(await nbddp.run(print, block=False), list[Any])
'''


@pytest.mark.heavy
def test_an_ide_can_tell_what_block_false_gives(tmp_path):
    """Heavy: one mypy run over a snippet (and, through its imports, the package): about as long as
    ``test_mypy_finds_nothing``. ``typing.overload`` on ``block`` types ``dist_fit``, ``sweep``, ``predict``,
    ``evaluate`` and ``run``; ``assert_type`` fails the run if a return type differs."""
    snippet = tmp_path / "overloads.py"
    snippet.write_text(OVERLOADS)
    proc = subprocess.run([sys.executable, "-m", "mypy", "--python-version", "3.10", str(snippet)], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert 'Revealed type is "nbddp.fit.handle.FitHandle"' in proc.stdout, proc.stdout[-4000:]
