"""Moving Python objects between the kernel and the workers, by value.

Two facts shape this module (``docs/ipyparallel-notes.md``, "Shipping objects"):

* ipyparallel's own canning breaks notebook-defined ``nn.Module`` classes that
  call ``super()``; pickling with cloudpickle to *bytes* and loading the
  bytes on the engine works. So every user object travels as cloudpickle
  bytes.
* ipyparallel messages move large payloads at 0.2-0.4 GB/s, while a memory
  copy runs at 5-13 GB/s. So on one host, tensors do not go into the pickle:
  the pickler replaces each tensor by a reference (``persistent_id``) and the
  tensor bytes go into one file in ``/dev/shm``, which the other side maps
  and copies straight into its tensors. Hosts that do not share the file
  system get the tensors inside the pickle instead.

A ``Parcel`` is what travels: the pickle bytes plus the path of the tensor
file (or ``None``). It is plain data, so ipyparallel sends it as is.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
import secrets
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeGuard, cast

import cloudpickle

from nbddp.protocol.errors import ShippingError
from nbddp.shipping.by_value import register_edited_modules
from nbddp.protocol.notes import shm_dir
from nbddp.shipping.shm_files import BufferPool, release_pooled
from nbddp.shipping.source_lines import NamingPickler
from nbddp.shipping.source_lines import register as register_sources

if TYPE_CHECKING:
    from torch import Tensor

_ALIGN = 64


@dataclass
class TensorMeta:
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    kind: str  # "tensor" or "param"
    requires_grad: bool


@dataclass
class Parcel:
    """Pickled bytes plus, when tensors went by file, the file and its index."""

    data: bytes
    path: str | None = None
    tensors: list[TensorMeta] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return len(self.data) + sum(t.nbytes for t in self.tensors)

    pooled: bool = False  # the file belongs to a BufferPool of the process that wrote it
    source_files: tuple[str, ...] = ()  # files of the code inside, by the kernel's names (nbddp.shipping.source_lines)
    sources: tuple = ()  # sources.Source: the lines of those files this worker lacks (SourceLedger.attach)

    def discard(self) -> None:
        """Done with the parcel: a pooled file goes back to its pool, another is removed.

        Only the writer's process holds the pool; on the reading side a pooled
        parcel's file is left alone (the writer reuses it).
        """
        if not self.path:
            return
        if self.pooled:
            release_pooled(self.path)
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _torch():
    return sys.modules.get("torch")


def _is_plain_tensor(obj: object) -> TypeGuard[Tensor]:
    torch = _torch()
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return False
    t = cast("Tensor", obj)  # its type was just checked: exactly a Tensor or a Parameter
    return (
        t.layout == torch.strided
        and not t.is_quantized
        and t.device.type != "meta"
        and (t.is_leaf or not t.requires_grad)
    )


class _Pickler(NamingPickler):
    """cloudpickle that lifts plain tensors out of the stream (unless ``lifted`` is None), keeping code's file names.

    The same tensor object seen twice (tied weights) gets one reference, so
    it is still one shared tensor after loading.
    """

    def __init__(self, file: io.BytesIO, lifted: list[Tensor] | None):
        super().__init__(file, protocol=5)
        self._lifted = lifted
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: object) -> tuple[str, int] | None:  # noqa: D401 - pickle hook
        if self._lifted is None or not _is_plain_tensor(obj):
            return None
        key = id(obj)
        index = self._seen.get(key)
        if index is None:
            index = self._seen[key] = len(self._lifted)
            self._lifted.append(obj)
        return ("nbddp-tensor", index)


def fingerprint(obj: object) -> str | None:
    """A content key for ``obj``, cheap even for gigabytes of tensors (``None``: cannot tell).

    The object is pickled with its tensors lifted out (so only the small
    rest is hashed); each tensor contributes its storage address, shape,
    dtype, strides and version counter, which PyTorch bumps on every in-place
    change. The same unchanged dataset passed again gets the same key.
    """
    import hashlib

    register_edited_modules()
    lifted: list[Tensor] = []
    buf = io.BytesIO()
    try:
        _Pickler(buf, lifted).dump(obj)
    except Exception:  # noqa: BLE001 - unpicklable objects fail later, with a better message
        return None
    h = hashlib.sha256(buf.getvalue())
    for t in lifted:
        h.update(repr((t.data_ptr(), tuple(t.shape), str(t.dtype), t.stride(), t._version, str(t.device))).encode())
    return h.hexdigest()[:32]


def dumps(obj: object, *, what: str = "object", label: str = "object") -> bytes:
    """cloudpickle ``obj`` with tensors inline (for other hosts), naming what failed.

    ``label`` is how the person calls the object (``data``), used to name the
    failing part (``data.lock``) and in the hint.
    """
    return _pickle(obj, None, what, label)[0]


def _pickle(obj: object, lifted: list[Tensor] | None, what: str, label: str) -> tuple[bytes, tuple[str, ...]]:
    """(pickle bytes, the files of the code inside); tensors go into ``lifted`` unless it is None."""
    register_edited_modules()
    buf = io.BytesIO()
    pickler = _Pickler(buf, lifted)
    try:
        pickler.dump(obj)
    except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
        raise _explain(obj, what, exc, label) from exc
    return buf.getvalue(), tuple(sorted(pickler.code_files))


def pack(obj: object, *, what: str = "object", local: bool = True, label: str = "object",
         pool: BufferPool | None = None, prefix: str | None = None) -> Parcel:
    """Pickle ``obj`` for the workers; with ``local`` its tensors go by shared file.

    Args:
        pool: reuse one of its files (large, repeated transfers).
        prefix: name of a new file (default ``nbddp-<pid>``), so its owner can
            find and remove it.
    """
    lifted: list[Tensor] | None = [] if local and _torch() is not None else None
    data, files = _pickle(obj, lifted, what, label)
    if not lifted:
        return Parcel(data, source_files=files)
    metas, total = [], 0
    for t in lifted:
        nbytes = t.numel() * t.element_size()
        metas.append(
            TensorMeta(
                offset=total,
                nbytes=nbytes,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=tuple(t.shape),
                kind="param" if isinstance(t, _torch().nn.Parameter) else "tensor",
                requires_grad=bool(t.requires_grad),
            )
        )
        total += -(-nbytes // _ALIGN) * _ALIGN
    if pool is not None:
        path, mm = pool.acquire(total)
        try:
            _write_tensors(mm, lifted, metas, total)
        except BaseException:
            pool.release(path)
            raise
        return Parcel(data, path, metas, pooled=True, source_files=files)
    path = os.path.join(shm_dir(), f"{prefix or f'nbddp-{os.getpid()}'}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(total, 1))
        with mmap.mmap(fd, max(total, 1)) as mm:
            _write_tensors(mm, lifted, metas, total)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return Parcel(data, path, metas, source_files=files)


def _write_tensors(mm: mmap.mmap, tensors: list[Tensor], metas: list[TensorMeta], total: int) -> None:
    """Copy each tensor straight into its slot of the mapped file (from any device, any strides)."""
    torch = _torch()
    flat = torch.frombuffer(mm, dtype=torch.uint8, count=max(total, 1))
    for t, meta in zip(tensors, metas):
        if meta.nbytes:
            slot = flat[meta.offset : meta.offset + meta.nbytes].view(t.dtype).view(t.shape)
            slot.copy_(t.detach())
    del flat


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Tensor]):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Tensor:  # pickle.Unpickler's hook: pid is what persistent_id gave
        tag, index = pid
        if tag != "nbddp-tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tensors[index]


def unpack(parcel: Parcel, *, copy: bool = True) -> Any:
    """Load a parcel. With ``copy=False`` tensors are views of the mapped file.

    Views are only for reading straight into existing tensors (the kernel's
    ``load_state_dict``); anything kept must be copied, the default.
    """
    register_sources(parcel.sources)
    if parcel.path is None:
        return pickle.loads(parcel.data)
    torch = _torch() or __import__("torch")
    with open(parcel.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    tensors: list[Tensor] = []
    for meta in parcel.tensors:
        dtype = getattr(torch, meta.dtype)
        raw = flat[meta.offset : meta.offset + meta.nbytes]
        t = raw.view(dtype).reshape(meta.shape) if meta.nbytes else torch.empty(meta.shape, dtype=dtype)
        if copy:
            t = t.clone()
        if meta.kind == "param":
            t = torch.nn.Parameter(t, requires_grad=meta.requires_grad)
        elif meta.requires_grad:
            t.requires_grad_(True)
        tensors.append(t)
    return _Unpickler(io.BytesIO(parcel.data), tensors).load()


# --------------------------------------------------------------------------
# Pre-flight: say which part of an object cannot be pickled.


def _explain(obj: object, what: str, exc: Exception, label: str) -> ShippingError:
    found = _find_unpicklable(obj, label)
    culprit = ""
    if found is not None and found[0] != label:
        culprit = f" The part that fails is `{found[0]}` ({type(found[1]).__name__})."
    return ShippingError(
        f"{what} cannot be sent to the workers: {type(exc).__name__}: {exc}.{culprit} "
        "Objects holding open files, locks, sockets, generators or live connections do not pickle. "
        f"HINT: pass a zero-argument function that builds it on each worker instead (`{label}=lambda: ...`), "
        "or drop that attribute before the call."
    )


def _find_unpicklable(obj: object, path: str, depth: int = 0) -> tuple[str, object] | None:
    """Walk attributes/items to the deepest part that still fails to pickle: (path, object)."""
    if depth > 6:
        return path, obj
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001
        pass
    children: list[tuple[str, object]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    else:
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict):
            for name, value in state.items():
                if name in ("_modules", "_parameters", "_buffers") and isinstance(value, dict):
                    children += [(f"{path}.{k}", v) for k, v in value.items()]
                else:
                    children.append((f"{path}.{name}", value))
    for child_path, child in children:
        found = _find_unpicklable(child, child_path, depth + 1)
        if found:
            return found
    return path, obj
