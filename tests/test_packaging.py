"""nbddp as a person installs it: every import declared, a licence in the wheel and the sdist, and the wheel,
installed with no extras into a fresh venv, trains from a Jupyter kernel.

The build test is the one slow test here (a fresh venv gets torch and nbddp's dependencies: pip's cache and
the machine's own wheel folder keep it offline where they can); the import check is a quick unit test.
"""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import subprocess
import sys
import tarfile
import zipfile

import pytest

from kernel_cells import HELPERS, Kernel

ROOT = pathlib.Path(__file__).resolve().parent.parent

#: an import name -> the distribution that provides it, where the two differ
DISTRIBUTION = {"IPython": "ipython", "zmq": "pyzmq", "hta": "holistictraceanalysis", "mlflow": "mlflow-skinny",
                "torch.utils.tensorboard": "tensorboard"}
#: imported only when the person's own code already imported it, so never missing where it runs: the module that
#: imports it says so at the import (``sys.modules`` is checked first)
BROUGHT_BY_THE_PERSON = {"pytorch_lightning": "nbddp/worker/tasks/report_loggers.py"}


def _project() -> dict:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, (ast.Name, ast.Attribute)) and ast.unparse(node.test).endswith("TYPE_CHECKING")


def _runtime_imports() -> dict[str, set[str]]:
    """Every third-party module nbddp's code imports at run time (not under ``if TYPE_CHECKING:``), by file."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "nbddp").rglob("*.py"):
        tree = ast.parse(path.read_text())
        skip = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and _is_type_checking(block)
                for part in block.body for n in ast.walk(part)}
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                name = "torch.utils.tensorboard" if module.startswith("torch.utils.tensorboard") else module.split(".")[0]
                if name not in sys.stdlib_module_names and name != "nbddp":
                    found.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_runtime_import_is_a_dependency_or_in_an_extra():
    project = _project()
    required = _names(project["dependencies"])
    extras = {extra: _names(reqs) for extra, reqs in project["optional-dependencies"].items()}
    missing = []
    for module, files in sorted(_runtime_imports().items()):
        if files == {BROUGHT_BY_THE_PERSON.get(module)}:
            continue
        dist = DISTRIBUTION.get(module, module).lower()
        if dist not in required and not any(dist in names for names in extras.values()):
            missing.append(f"{module} ({dist}), imported by {sorted(files)}")
    assert missing == [], "declare these in pyproject.toml: " + "; ".join(missing)
    assert "pandas" in required  # History.to_pandas(), History.time_split(): public methods of every fit
    assert re.search(r"ipyparallel>=9[.0]*,<10", " ".join(project["dependencies"])), "ipyparallel bounded to 9.x"
    assert project["optional-dependencies"]["all"] == ["nbddp[loggers,hf,sweep,metrics,profile]"]


def test_the_package_says_it_is_typed_and_licensed():
    assert (ROOT / "nbddp" / "py.typed").exists()
    licence = (ROOT / "LICENSE").read_text()
    assert licence.startswith("BSD 3-Clause License") and _project()["license"] == "BSD-3-Clause"
    assert "Typing :: Typed" in _project()["classifiers"]
    assert "## Unreleased" in (ROOT / "CHANGELOG.md").read_text()


KERNEL_CELLS = [
    HELPERS + "%load_ext nbddp\n%ddp start -n 2",
    "import torch, torch.nn as nn, torch.nn.functional as F\n"
    "x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))\n"
    "model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))\n"
    "history = dist_fit(model, (x, y), epochs=1, batch_size=8, loss_fn=F.cross_entropy, live=False)\n"
    "import nbddp, sys\n"
    "out([history.status, len(history.epochs), nbddp.__file__.startswith(sys.prefix)])",
    "%ddp stop",
]


def _build(out: pathlib.Path) -> tuple[pathlib.Path, pathlib.Path]:
    """``python -m build``: the sdist and the wheel, each checked for the licence and its parts."""
    subprocess.run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], check=True,
                   capture_output=True, text=True, timeout=300)
    wheel, = out.glob("nbddp-*.whl")
    sdist, = out.glob("nbddp-*.tar.gz")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names
    assert "nbddp/py.typed" in names and "nbddp/worker/checkpoints/trust.py" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: BSD-3-Clause" in metadata and "Requires-Dist: pandas>=2.0" in metadata
    members = {m.split("/", 1)[1] for m in tarfile.open(sdist).getnames() if "/" in m}
    assert {"LICENSE", "CHANGELOG.md", "README.md", "pyproject.toml", "nbddp/py.typed"} <= members
    return wheel, sdist


def _clean_env() -> dict[str, str]:
    """This process's environment without what would let the fresh venv see the suite's packages."""
    from conftest import RUN_MARKER

    return {k: v for k, v in os.environ.items() if k not in (RUN_MARKER, "PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def _fresh_venv(where: pathlib.Path, wheel: pathlib.Path) -> pathlib.Path:
    """A new venv with the wheel and nothing else asked for: its declared dependencies, no extras. torch comes from
    the same CPU build as the suite's (the constraints file: an open range would pull a multi-GB CUDA build)."""
    subprocess.run([sys.executable, "-m", "venv", str(where)], check=True, timeout=120)
    python = where / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "-c",
                    str(ROOT / "constraints-dev.txt"), str(wheel)], check=True, capture_output=True, text=True,
                   timeout=900, env=_clean_env())
    return python


def _run_in_kernel(python: pathlib.Path, cwd: pathlib.Path) -> list:
    """The cells in a Jupyter kernel of ``python`` (a kernelspec of its own): what the fit cell handed back."""
    kernel = Kernel(env=_clean_env(), cwd=cwd, argv=[str(python), "-m", "ipykernel_launcher", "-f",
                                                     "{connection_file}"], spec_dir=cwd)  # nothing of the suite's
    try:
        return [kernel.run(code, timeout=300) for code in KERNEL_CELLS][1]
    finally:
        kernel.close()


@pytest.mark.slow
def test_the_wheel_installs_with_no_extras_and_trains_from_a_kernel(tmp_path):
    """Slow: it builds the sdist and the wheel (hatchling in build's own venv), makes a fresh venv and installs the
    wheel's declared dependencies into it (torch among them, about 1 GB unpacked), then starts a kernel and two
    workers there. It cannot be faster: sharing anything with the suite's venv would defeat the point, which is
    that the declared dependencies alone are enough."""
    wheel, _ = _build(tmp_path / "dist")
    python = _fresh_venv(tmp_path / "venv", wheel)
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json"], check=True, capture_output=True,
                            text=True, env=_clean_env()).stdout
    installed = {p["name"].lower() for p in json.loads(listed)}
    assert {"nbddp", "torch", "ipyparallel", "ipykernel", "pandas", "pyzmq", "traitlets"} <= installed
    assert not {"optuna", "wandb", "mlflow-skinny", "datasets", "pytest"} & installed  # no extras came along
    assert _run_in_kernel(python, tmp_path) == ["completed", 1, True]  # trained, with the venv's nbddp
