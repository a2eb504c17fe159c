"""Reading a checkpoint someone may have handed you, without running code from it.

A pickle can run any code while it loads, and a checkpoint is a pickle. Every file a person points nbddp at
(``dist_fit(resume=...)``: a ``step-*.pt`` file, a sharded ``step-*`` folder's ``loop.pt``, DCP's
``.metadata`` and the plain values DCP keeps as bytes; ``nbddp.export_checkpoint``) is read here, so that
loading it can only build tensors and plain data:

* ``torch.save`` files with ``torch.load(weights_only=True)``, torch's own safe unpickler;
* DCP's ``.metadata`` with ``MetadataUnpickler``, which builds DCP's own metadata records, torch's sizes,
  dtypes and layouts, and paths, and nothing else;
* DCP's byte items (an optimizer's ``lr``, any non-tensor value) with ``torch.load(weights_only=True)``
  (DCP's own planner reads them with ``weights_only=False``).

A file that needs more is refused with ``UntrustedCheckpointError``, naming the file and the option that
trusts it (``trust_checkpoint=True``). A file is read in full only when the person passed that option, or
when it lies in a folder that this fit's kernel made for its own snapshots (``cfg.snapshot_dir``: owned by
this user, 0700, no one else can write there).

Which files are trusted is set for a stretch of code with ``trusting`` (a context variable), so that a
strategy's ``load_checkpoint(path, optimizer)`` keeps its signature, and third-party strategies stay safe.
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from nbddp.protocol.errors import UntrustedCheckpointError

#: what a resume=... names as the option that trusts a file (``export_checkpoint`` names its own)
RESUME_OPTION = "dist_fit(..., trust_checkpoint=True)"


@dataclass(frozen=True)
class Trust:
    """Which files may be unpickled in full: all (``everything``), or those under ``roots`` (folders this
    user owns that no one else may enter); ``option`` is what a refusal tells the person to pass."""

    everything: bool = False
    roots: tuple[str, ...] = ()
    option: str = RESUME_OPTION

    def covers(self, path: str) -> bool:
        if self.everything:
            return True
        real = os.path.realpath(path)
        return any(private_folder(root) and (real == root or real.startswith(root + os.sep))
                   for root in (os.path.realpath(r) for r in self.roots))


_TRUST: ContextVar[Trust] = ContextVar("nbddp_checkpoint_trust", default=Trust())


def private_folder(folder: str) -> bool:
    """Whether ``folder`` is owned by this user and closed to everyone else (0700 or tighter)."""
    try:
        st = os.stat(folder)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077 == 0


@contextmanager
def trusting(everything: bool = False, roots: tuple[str | None, ...] = (),
             option: str = RESUME_OPTION) -> Iterator[Trust]:
    """Within the block, the files ``everything`` or ``roots`` cover are read in full; the rest safely."""
    token = _TRUST.set(Trust(everything, tuple(r for r in roots if r), option))
    try:
        yield _TRUST.get()
    finally:
        _TRUST.reset(token)


def trusted(path: str) -> bool:
    return _TRUST.get().covers(path)


def refusal(path: str, reason: str) -> UntrustedCheckpointError:
    """The error for a file that needs a full unpickle: the file, what it holds, and the option."""
    option = _TRUST.get().option
    return UntrustedCheckpointError(
        f"{path}: this checkpoint holds more than tensors and plain data ({reason}), and loading it in full would "
        f"run code the file names. nbddp loads checkpoints with torch.load(weights_only=True). If you trust who "
        f"wrote it, pass {option}", path=path)


def _weights_only_failure(exc: pickle.UnpicklingError) -> str | None:
    """torch's reason (the line naming the global) when ``exc`` is weights_only's refusal, else None."""
    text = str(exc)
    if "weights_only" not in text and "Weights only load failed" not in text:
        return None
    for line in text.splitlines():
        if "GLOBAL" in line or "Unsupported" in line:
            return line.strip()
    return text.splitlines()[0].strip() if text else "an object torch's safe loader does not build"


def load_file(source: str | BinaryIO, path: str | None = None, mmap: bool = False) -> Any:
    """``torch.load`` of ``source`` on the CPU: in full when ``path`` is trusted, else with ``weights_only=True``.

    Raises:
        UntrustedCheckpointError: the file needs a full unpickle and is not trusted.
    """
    name = path if path is not None else str(source)
    if trusted(name):
        return torch.load(source, map_location="cpu", weights_only=False)
    try:
        return torch.load(source, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        reason = _weights_only_failure(exc)
        if reason is None:
            raise
        raise refusal(name, reason) from None


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's ``.metadata``: its own records, torch's sizes, dtypes, layouts, memory formats, and paths."""

    _MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
    _NAMES = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
              ("pathlib", "PureWindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")}

    def __init__(self, file: BinaryIO, path: str):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise refusal(self.path, f"its metadata names {module}.{name}, which is not part of DCP's metadata")
        return found

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._NAMES:
            return True
        if module in self._MODULES:
            return isinstance(getattr(importlib.import_module(module), name, None), type)
        if module == "torch":
            return isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format))
        return False


def read_metadata(path: str) -> Any:
    """DCP's ``.metadata`` file ``path``: in full when trusted, else with ``MetadataUnpickler``."""
    with open(path, "rb") as f:
        if trusted(path):
            return pickle.load(f)
        return MetadataUnpickler(f, path).load()


def reader(folder: str) -> Any:
    """A DCP ``FileSystemReader`` of ``folder`` whose ``.metadata`` is read now, by ``read_metadata``: a refusal is
    raised here, before DCP starts, and DCP plans with exactly the metadata that was checked."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    metadata = read_metadata(os.path.join(folder, ".metadata"))

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:  # a rank's own metadata: nbddp's checkpoints have one for all
                raise FileNotFoundError(f"{folder}: one .metadata for every rank, no __{kwargs['rank']}.metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(folder)


def planner(folder: str, empty: bool = False) -> Any:
    """DCP's load planner (``empty``: the one that rebuilds the whole state dict, as an export needs), with its
    byte items checked by ``load_file`` before DCP reads them."""
    from torch.distributed.checkpoint import default_planner

    base: Any = default_planner._EmptyStateDictLoadPlanner if empty else default_planner.DefaultLoadPlanner

    class SafePlanner(base):
        refused: UntrustedCheckpointError | None = None  # DCP wraps what a read raises: ``refusals_raised``

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            raw = value.read()
            if not trusted(folder):
                try:
                    load_file(io.BytesIO(raw), path=f"{folder} (its value {read_item.storage_index.fqn!r})")
                except UntrustedCheckpointError as exc:
                    self.refused = exc
                    raise
            super().load_bytes(read_item, io.BytesIO(raw))

    return SafePlanner()


@contextmanager
def refusals_raised(safe_planner: Any) -> Iterator[None]:
    """Around a DCP load with ``planner``'s planner: its refusal raised as itself, not inside DCP's
    ``CheckpointException``."""
    try:
        yield
    except BaseException:  # DCP's CheckpointException is a BaseException
        if safe_planner.refused is not None:
            raise safe_planner.refused from None
        raise
