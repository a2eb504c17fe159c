"""Which modules travel by value, so that edited code reaches the workers.

cloudpickle pickles a function or class by *reference* when its module is
importable (``mylib.Net`` travels as the name ``"mylib.Net"``), and the
worker then uses whatever ``mylib`` it imported first: after the notebook
edits ``mylib.py`` and reloads it, the workers would train the old
``forward``. So nbddp sorts modules in two:

* installed code (the standard library, ``site-packages``, ``dist-packages``)
  travels by reference, as usual: it does not change under a running kernel;
* everything else the kernel has imported (modules next to the notebook, a
  project on ``sys.path``, an editable install) travels *by value*, like
  the notebook's own ``__main__``: the workers get the code the kernel runs.

``ship_by_reference(module)`` and ``ship_by_value(module)`` force either
(a module or a name; a package name covers its submodules). nbddp's own
package always travels by reference: the workers import it.

Workers also reload such modules when their file changed, for code that
imports them itself (``import mylib`` in a ``%%ddp`` cell or a script); see
``worker/tasks/module_reload.py``.
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import threading
from types import ModuleType
from typing import Any

_LOCK = threading.Lock()
_FORCED: dict[str, str] = {}  # module or package name -> "value" | "reference"
_KINDS: dict[str, tuple[int, bool]] = {}  # module name -> (id of the module object, travels by value)
_LAST: dict[str, Any] = {"names": None, "objects": None, "found": []}  # the last walk, reused while unchanged
_REGISTERED: dict[str, int] = {}  # module name -> id of the module object registered with cloudpickle by value


def _installed_roots() -> tuple[str, ...]:
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    try:
        paths.update(site.getsitepackages())
        paths.add(site.getusersitepackages())
    except AttributeError:  # a virtualenv's old site.py
        pass
    return tuple(os.path.realpath(p) + os.sep for p in paths if p)


_ROOTS = _installed_roots()


def is_installed(module: ModuleType) -> bool:
    """Installed (or built-in) code: the standard library or a ``site-packages``/``dist-packages`` folder."""
    path = getattr(module, "__file__", None)
    if not path:
        return True  # built-in, frozen or a namespace package: nothing to edit
    real = os.path.realpath(path)
    return real.startswith(_ROOTS) or f"{os.sep}site-packages{os.sep}" in real or f"{os.sep}dist-packages{os.sep}" in real


def _forced(name: str) -> str | None:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        choice = _FORCED.get(".".join(parts[:i]))
        if choice is not None:
            return choice
    return None


def travels_by_value(name: str, module: ModuleType) -> bool:
    """The rule of the module docstring, for one module."""
    if name == "__main__" or name == "nbddp" or name.startswith("nbddp."):
        return False  # __main__ is by value anyway; nbddp is imported on the workers
    forced = _forced(name)
    if forced is not None:
        return forced == "value"
    return not is_installed(module)


def by_value_modules() -> list[tuple[str, ModuleType]]:
    """The imported modules that travel by value, each module object sorted once.

    A module is sorted again only when ``sys.modules`` holds a new object
    under its name (a re-import) or a choice was forced for it since, and
    while ``sys.modules`` holds the same objects under the same names the
    last answer is reused (two list copies and an identity comparison):
    ~0.1 ms with 5,000 modules imported, where a ``realpath`` of each cost
    0.1 s with 1,580.
    """
    with _LOCK:
        names, objects = list(sys.modules), list(sys.modules.values())
        if names == _LAST["names"] and _same(objects, _LAST["objects"]):
            return list(_LAST["found"])
        found = []
        for name, module in zip(names, objects):
            seen = _KINDS.get(name)
            if seen is None or seen[0] != id(module):
                by_value = isinstance(module, ModuleType) and travels_by_value(name, module)
                seen = _KINDS[name] = (id(module), by_value)
            if seen[1]:
                found.append((name, module))
        _LAST.update(names=names, objects=objects, found=found)
        return list(found)


def _same(objects: list[Any], before: list[Any] | None) -> bool:
    """The same objects in the same order (compared by identity first, as lists compare)."""
    try:
        return objects == before
    except Exception:  # noqa: BLE001 - an odd object in sys.modules whose == raises: sort again
        return False


def register_edited_modules() -> list[str]:
    """Register every not-installed module the kernel imported for pickling by value; return their names.

    Cheap to call before every pack (see ``by_value_modules``).
    """
    import cloudpickle

    registered = []
    for name, module in by_value_modules():
        if _REGISTERED.get(name) != id(module):
            cloudpickle.register_pickle_by_value(module)
            _REGISTERED[name] = id(module)
        registered.append(name)
    return registered


def _name_of(module: ModuleType | str, what: str) -> str:
    if isinstance(module, ModuleType):
        return module.__name__
    if isinstance(module, str) and module:
        return module
    raise TypeError(f"{what}(module) takes a module or its name, e.g. {what}('mylib'); got {type(module).__name__} {module!r}")


def ship_by_value(module: ModuleType | str) -> None:
    """Pickle this module's (or package's) functions and classes by value, even if it is installed."""
    name = _name_of(module, "ship_by_value")
    if name == "nbddp" or name.startswith("nbddp."):
        raise ValueError("nbddp itself must travel by reference: the workers import it")
    _choose(name, "value")


def ship_by_reference(module: ModuleType | str) -> None:
    """Pickle this module's (or package's) functions and classes by name: the workers import it themselves."""
    _choose(_name_of(module, "ship_by_reference"), "reference")


def _choose(name: str, choice: str) -> None:
    import cloudpickle

    with _LOCK:
        _FORCED[name] = choice
        _LAST["names"] = None
        for other in [n for n in _KINDS if n == name or n.startswith(name + ".")]:
            del _KINDS[other]
            _REGISTERED.pop(other, None)
            module = sys.modules.get(other)
            if choice == "reference" and module is not None:
                try:
                    cloudpickle.unregister_pickle_by_value(module)
                except ValueError:  # it was not registered
                    pass
