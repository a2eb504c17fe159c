"""``nbddp.run_script`` and ``%ddp script``: a torchrun script, unchanged, on the warm workers.

``torchrun --nproc-per-node N train.py --lr 0.1`` becomes
``%ddp script train.py --lr 0.1``: the same script on every rank, with
torchrun's environment, but no new processes, no new group, and the
workers still warm for the next cell.
"""

from __future__ import annotations

import os
from typing import Any

from nbddp.cells.rank_displays import Displays
from nbddp.cells.rank_output import shown_for
from nbddp.cells.reported_call import RankResults, hooks_for, run_reporting
from nbddp.live.choice import LiveChoice
from nbddp.session.session import get_session


def run_script(path: str | os.PathLike, *args: Any, loggers: Any = None, callbacks: Any = None,
               live: LiveChoice = None, displays: Displays = None) -> RankResults:
    """Run the script at ``path`` on every rank as ``__main__`` with ``sys.argv = [path, *args]``.

    Relative paths, in ``path`` and inside the script, resolve from the
    notebook's folder (the kernel's working directory). Output is labelled
    by rank, progress bars drawn in place; ``displays`` says whose rich
    output (``plt.show()``, ``display(...)``) is shown: rank 0 by default, a
    rank, a list, ``"all"`` or ``"none"``. ``sys.exit(0)`` counts as success; an exception or another exit
    status raises ``WorkerError`` naming the rank. Kernel > Interrupt stops
    the script on every rank.

    What the script reports (``nbddp.report``) is shown live (``live=``) and
    given to ``loggers`` and ``callbacks``, as for ``nbddp.run``.

    Returns:
        One ``ScriptResult`` per rank, in rank order (``exit_code`` 0), with
        ``.history``: what the script reported (None if nothing).
    """
    from nbddp.worker.tasks.scripts import run_script as remote_script

    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"run_script(path=...) takes the script's path, got {type(path).__name__} {path!r}")
    full = os.path.abspath(os.fspath(path))
    if not os.path.isfile(full):
        raise FileNotFoundError(f"run_script({os.fspath(path)!r}): no such file (looked for {full}); paths are "
                                f"relative to the notebook's folder, {os.getcwd()}")
    with open(full, encoding="utf-8") as f:
        source = f.read()
    compile(source, full, "exec")  # a SyntaxError is raised here, before any rank runs
    argv = [str(a) for a in args]
    s = get_session()
    what = f"the script {os.path.basename(full)}"
    shown = shown_for(s, displays, None, "run_script")
    cwd = os.getcwd()
    hooks = hooks_for(loggers, callbacks)
    results, history = run_reporting(s, what, remote_script, lambda p: (source, full, argv, cwd, s.generation),
                                     output=True, live=live, hooks=hooks, shown=shown)
    values = RankResults(results[rank] for rank in sorted(results))
    values.history = history
    return values
