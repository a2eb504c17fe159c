"""``torch.compile`` on a rank: Inductor's caches set up first, then the modules a strategy names compiled in place.

* *In place*: each module's ``forward`` is replaced by its compiled twin
  for the fit, and put back after it. The module keeps its class and its
  state dict's names (``torch.compile(m)`` would wrap it and prefix every
  name with ``_orig_mod.``), so checkpoints, ``keep`` and the weights sent
  back are those of an eager fit, and the module still pickles. Its hooks
  (DDP's, FSDP's all-gathers) stay outside the graph.
  ``nn.Module.compile()`` is not used: on torch's own modules
  (``nn.Sequential``, measured on torch 2.13) it compiles nothing, since
  Dynamo skips frames in ``torch.nn``. The compile itself happens at the
  first forward.
* *One cache per session and host*: the FX graph cache and the autotune
  cache live in the directory the kernel chose (``CompileSpec.cache_dir``,
  owner-only), set through the environment and ``torch._inductor.config``
  before anything compiles. Every rank of the host reads and writes it, and
  so does every later fit of the session: a fit's code arrives unpickled
  afresh, so Dynamo traces again, but Inductor finds the compiled graph.
* *No fork after CUDA is up*: Inductor compiles in a pool of worker
  processes; where this rank has initialised CUDA it compiles in-process
  instead (``compile_threads = 1``, the workaround of pytorch #184643).
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.nn as nn
from nbddp.worker.strategies.compile_globals import importable

from nbddp.protocol.compile_settings import CompileSpec


def prepare_inductor(spec: CompileSpec) -> str:
    """Point Inductor's caches at the session's directory (0700, made if missing); return it."""
    directory = spec.cache_dir
    if directory:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.chmod(directory, 0o700)  # made by an earlier fit with another umask, or by a peer rank: owner-only all the same
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = directory
        os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(directory, "triton"))
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    import torch._dynamo as dynamo  # noqa: F401 - seconds of imports on a first compiled fit: counted as compiling
    import torch._inductor.config as inductor_config

    inductor_config.fx_graph_cache = True
    inductor_config.autotune_local_cache = True
    if os.environ.get("TORCHINDUCTOR_COMPILE_THREADS") == "1":
        inductor_config.compile_threads = 1  # the config was read at import: set it, not only the environment
    return directory


def compile_in_place(modules: Iterable[nn.Module], spec: CompileSpec) -> list[nn.Module]:
    """Give each module a compiled ``forward`` (an instance attribute) with ``spec``'s arguments; return them."""
    modules = list(modules)
    importable(modules)  # a class shipped from python -c or exec: its globals where Dynamo's guards look
    done = []
    for module in modules:
        module.forward = torch.compile(module.forward, backend=spec.backend, fullgraph=spec.fullgraph,
                                       dynamic=spec.dynamic, mode=spec.mode)
        done.append(module)
    return done


def uncompile(modules: Iterable[nn.Module]) -> None:
    """Put back each module's own ``forward``: the trained module pickles and runs as the person wrote it."""
    for module in modules:
        module.__dict__.pop("forward", None)


def regions(model: nn.Module, units: list[nn.Module], spec: CompileSpec) -> list[nn.Module]:
    """What to compile: each unit (``regional`` with units), else the whole model."""
    return list(units) if spec.regional and units else [model]

