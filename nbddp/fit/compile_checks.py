"""``dist_fit(compile=...)`` checked in the kernel, against the torch the kernel runs, before any worker compiles.

A bad mode or backend would otherwise fail on every rank at the first
forward, minutes into a fit, with torch's message from deep inside Dynamo.
The workers run the same torch as the kernel (the session checks versions
when the process group forms), so the kernel's answer holds for them.
"""

from __future__ import annotations

import sys
from dataclasses import replace

from nbddp.protocol.compile_settings import COMPILE_KEYS, CompileSpec, session_cache_dir


def resolve_compile(value: object) -> CompileSpec | None:
    """``False``/``None``: no compile; ``True``: torch's defaults, regional; a dict of ``COMPILE_KEYS``.

    Raises:
        TypeError: ``compile`` is not a bool or a dict, or a field has the wrong type.
        ValueError: an unknown key, mode or backend, or a torch whose Dynamo does not run on this Python.
    """
    if value is None or value is False:
        return None
    if value is True:
        value = {}
    if not isinstance(value, dict):
        raise TypeError(f"dist_fit(compile=...) must be True, False or a dict with keys {COMPILE_KEYS}, "
                        f"got {type(value).__name__} {value!r}")
    unknown = sorted(set(value) - set(COMPILE_KEYS))
    if unknown:
        raise ValueError(f"dist_fit(compile=...) got unknown key(s) {unknown}; the keys are {COMPILE_KEYS}")
    check_dynamo_supported()
    spec = CompileSpec(**value)
    for name in ("fullgraph", "regional"):
        if not isinstance(getattr(spec, name), bool):
            raise TypeError(f"dist_fit(compile={{'{name}': ...}}) must be True or False, got {getattr(spec, name)!r}")
    if spec.dynamic is not None and not isinstance(spec.dynamic, bool):
        raise TypeError(f"dist_fit(compile={{'dynamic': ...}}) must be None, True or False, got {spec.dynamic!r}")
    _check_backend(spec.backend)
    _check_mode(spec.mode, spec.backend)
    return spec


def check_dynamo_supported() -> None:
    """torch.compile needs TorchDynamo, which each torch release supports on some Python versions only."""
    import torch
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        raise RuntimeError(
            f"dist_fit(compile=...) needs TorchDynamo, which torch {torch.__version__} does not support on Python "
            f"{sys.version_info.major}.{sys.version_info.minor} ({sys.platform}). Use a Python version that torch "
            "release supports for torch.compile (see its release notes), or a newer torch; or train without compile."
        )


def _check_backend(backend: object) -> None:
    import torch._dynamo

    if not isinstance(backend, str):
        raise TypeError(f"dist_fit(compile={{'backend': ...}}) must be a backend name (a str), got {backend!r}")
    known = torch._dynamo.list_backends(exclude_tags=())
    if backend not in known:
        raise ValueError(f"dist_fit(compile={{'backend': {backend!r}}}) is not a backend torch knows; "
                         f"torch._dynamo.list_backends() names {known} (with exclude_tags=()); "
                         "'inductor' is the default")


def _check_mode(mode: object, backend: str) -> None:
    from torch._inductor import list_mode_options

    modes = ["default", *[m for m in list_mode_options() if m != "default"]]
    if mode is None:
        return
    if mode not in modes:
        raise ValueError(f"dist_fit(compile={{'mode': {mode!r}}}) is not a mode of torch.compile; the modes are "
                         f"{modes} (torch._inductor.list_mode_options())")
    if backend != "inductor":
        raise ValueError(f"dist_fit(compile={{'mode': {mode!r}}}) is a mode of the 'inductor' backend, but backend "
                         f"is {backend!r}; drop 'mode' or use backend='inductor'")


def with_cache_dir(spec: CompileSpec | None, file_prefix: str) -> CompileSpec | None:
    """The spec with this session's cache directory filled in."""
    return None if spec is None else replace(spec, cache_dir=session_cache_dir(file_prefix))
