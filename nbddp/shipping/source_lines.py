"""The person's own source lines on the workers: tracebacks, stacks and pdb show them.

cloudpickle ships notebook classes and functions *by value*, and it renames
their code's file to ``<dynamic-code>`` (to make pickles deterministic). On
a worker that code then has no file and no lines: a remote traceback reads
``File <dynamic-code>:9, in Boom.forward`` and "Could not get source".

So nbddp's pickler keeps each code object's real file name (the kernel's:
``/tmp/ipykernel_<pid>/<hash>.py`` for a notebook cell, ``<ipython-input-..>``
in a terminal IPython, a path for a module that travels by value) and notes
which files the pickle needs. The lines of those files, as the kernel's own
``linecache`` holds them (IPython registers every cell there), travel with
the call and are registered in the worker's ``linecache`` under the same
name, the way IPython registers a cell: ``(size, None, lines, name)``. The
worker's IPython then also learns the cell's number, so a remote traceback
says ``Cell In[5], line 3`` exactly as the kernel's would.

Each file's lines go to each worker once per content (``session/source_ledger.py``
remembers what every worker process holds, by a digest of the lines); a
later call that uses the same cell carries only its name. Scripts and
``%%ddp`` cells register their source themselves (they travel as text).
"""

from __future__ import annotations

import linecache
import sys
import types
from dataclasses import dataclass
from typing import IO, Any

import cloudpickle

DYNAMIC = "<dynamic-code>"


@dataclass(frozen=True)
class Source:
    """One file's lines as the kernel holds them; ``cell`` is its IPython execution count, if it is a cell."""

    filename: str
    digest: str
    lines: tuple[str, ...]
    cell: int | None = None


def named_code(code: types.CodeType, filename: str) -> types.CodeType:
    """On loading: the code object back under the kernel's file name (cloudpickle shipped it as ``<dynamic-code>``)."""
    return code.replace(co_filename=filename)


class NamingPickler(cloudpickle.Pickler):
    """cloudpickle that keeps each code object's file name and notes the files (``code_files``) it needs."""

    def __init__(self, file: IO[bytes], protocol: int = 5):
        super().__init__(file, protocol=protocol)
        self.code_files: set[str] = set()

    def reducer_override(self, obj: object) -> Any:
        if type(obj) is types.CodeType and obj.co_filename != DYNAMIC:
            self.code_files.add(obj.co_filename)
            # the renamed copy is reduced by cloudpickle itself; named_code renames it back on loading
            return named_code, (obj.replace(co_filename=DYNAMIC), obj.co_filename)
        return super().reducer_override(obj)


def cell_number(filename: str) -> int | None:
    """IPython's execution count of the cell compiled under ``filename`` (None outside IPython, or not a cell)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    names = getattr(getattr(shell, "compile", None), "_filename_map", None)
    number = names.get(filename) if isinstance(names, dict) else None
    return number if isinstance(number, int) else None


def describe_where(where: str) -> str:
    """``file:line`` as the kernel's own traceback names it: ``Cell In[5], line 3`` for a notebook cell."""
    filename, _, line = where.rpartition(":")
    number = cell_number(filename)
    return f"Cell In[{number}], line {line}" if number is not None else where


# ---- the worker's side -----------------------------------------------------------


def register(sources: tuple[Source, ...] | list[Source]) -> None:
    """Put shipped lines into this process's ``linecache`` (and the cell numbers into its IPython)."""
    for s in sources:
        register_text(s.filename, "".join(s.lines), s.cell)


def register_text(filename: str, text: str, cell: int | None = None) -> None:
    """``text`` becomes ``filename``'s lines for tracebacks, stacks and pdb, as IPython registers a cell."""
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    if cell is None:
        return
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - engines run IPython
        return
    names = getattr(getattr(get_ipython(), "compile", None), "_filename_map", None)
    if isinstance(names, dict):
        names[filename] = cell
