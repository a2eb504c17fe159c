"""A shipped class's globals made importable under their own name, so that Dynamo can guard them.

When Dynamo inlines a function whose globals are not the compiled frame's, it guards each global it reads as
an attribute of ``sys.modules[globals["__name__"]]`` (``import_source``). A class that travelled by value
(cloudpickle) keeps the kernel's ``__name__``, ``"__main__"`` for code run by ``python -c``, ``exec`` or a
script, and on an engine ``sys.modules["__main__"]`` is the engine's own namespace, which has none of that
code's globals: every rank failed with ``InternalTorchDynamoError: module __main__ has no attribute torch``.

``importable`` gives each such globals dict a module of its own in ``sys.modules`` (``nbddp_shipped_<id>``) whose
attributes are that dict's entries, read live, and names the dict after it. A module that is imported on the
engine (``torch.nn``, a package the workers have) is its own globals' module already and is left alone.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable, Iterator
from typing import Any

import torch.nn as nn

PREFIX = "nbddp_shipped_"


class GlobalsModule(types.ModuleType):
    """A module whose attributes are one globals dict's entries, read at each access (the dict stays the truth)."""

    def __init__(self, name: str, scope: dict[str, Any]):
        super().__init__(name)
        self.__dict__["_scope"] = scope

    def __getattr__(self, attr: str) -> Any:
        try:
            return self.__dict__["_scope"][attr]
        except KeyError:
            raise AttributeError(f"module {self.__name__} has no attribute {attr}") from None


def functions_of(modules: Iterable[nn.Module]) -> Iterator[types.FunctionType]:
    """The plain functions of every class (and base class) of ``modules`` and their submodules."""
    seen: set[type] = set()
    for root in modules:
        for module in root.modules():
            for cls in type(module).__mro__:
                if cls in seen or cls.__module__.startswith(("torch.", "builtins")):
                    continue
                seen.add(cls)
                for value in vars(cls).values():
                    func = getattr(value, "__func__", value)
                    if isinstance(func, types.FunctionType):
                        yield func


def importable(modules: Iterable[nn.Module]) -> int:
    """Give every shipped globals dict that ``modules``' code reads a module in ``sys.modules``; how many."""
    made = 0
    for func in functions_of(modules):
        scope = func.__globals__
        name = scope.get("__name__")
        if not isinstance(name, str) or name.startswith(PREFIX):
            continue
        module = sys.modules.get(name)
        if module is not None and getattr(module, "__dict__", None) is scope:
            continue  # imported here: Dynamo finds these globals already
        alias = f"{PREFIX}{id(scope):x}"
        sys.modules[alias] = GlobalsModule(alias, scope)
        scope["__name__"] = alias
        made += 1
    return made
