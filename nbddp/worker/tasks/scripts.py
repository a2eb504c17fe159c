"""Running a script written for ``torchrun`` on a warm worker, unchanged.

The script runs as ``__main__`` with its own ``sys.argv``, from the
notebook's folder, with the script's folder first on ``sys.path`` (as
``python script.py`` does). Its ``init_process_group`` and
``destroy_process_group`` calls meet nbddp's group (``worker/engine/torchrun.py``).
``sys.exit(0)`` (or falling off the end) is success; any other exit status
is raised as ``ScriptExit``, which the kernel reports like any failure.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import types
from typing import Any, Iterator

from nbddp.protocol.messages import ScriptResult
from nbddp.shipping.source_lines import register_text
from nbddp.worker.memory.release import run_task
from nbddp.worker.engine.rank_state import STATE
from nbddp.worker.tasks.user_task import user_task
class ScriptExit(RuntimeError):
    """The script called ``sys.exit`` with a non-zero status."""


@contextlib.contextmanager
def _as_main(path: str, argv: list[str], cwd: str | None) -> Iterator[dict[str, Any]]:
    """A fresh ``__main__`` module for the script; argv, cwd and sys.path as ``python path`` sets them."""
    module = types.ModuleType("__main__")
    module.__file__ = path
    module.__builtins__ = __builtins__  # type: ignore[attr-defined]
    try:
        here = os.getcwd()
    except FileNotFoundError:  # the folder was removed under the worker
        here = os.path.expanduser("~")
    saved = sys.modules.get("__main__"), list(sys.argv), list(sys.path), here
    sys.modules["__main__"] = module
    sys.argv = [path, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    if cwd is not None and os.path.isdir(cwd):
        os.chdir(cwd)
    try:
        yield module.__dict__
    finally:
        main, sys.argv, sys.path, old_cwd = saved
        if main is not None:
            sys.modules["__main__"] = main
        os.chdir(old_cwd)


def run_script(source: str, path: str, argv: list[str], cwd: str | None, generation: int) -> ScriptResult:
    """Execute the script's ``source`` as ``path``; return this rank's exit status."""
    return run_task(_run_script, source, path, argv, cwd, generation)


def _run_script(source: str, path: str, argv: list[str], cwd: str | None, generation: int) -> ScriptResult:
    code = compile(source, path, "exec")
    register_text(path, source)  # the script's lines, for tracebacks, stacks and pdb (the file may be elsewhere)
    t0 = time.perf_counter()
    status = 0
    here = cwd if STATE.placement.local else None
    with user_task(generation, "script"), _as_main(path, argv, here) as namespace:
        try:
            exec(code, namespace)  # noqa: S102 - running the person's script is the point
        except SystemExit as exc:
            status = _exit_status(exc.code)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
    if status != 0:
        raise ScriptExit(f"{os.path.basename(path)} exited with status {status} (sys.exit({status}))")
    return ScriptResult(rank=STATE.placement.rank, exit_code=status, seconds=time.perf_counter() - t0)


def _exit_status(code: Any) -> int:
    """``sys.exit`` semantics: None is 0, an int is itself, anything else is printed and means 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
