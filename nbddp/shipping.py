"""Moving Python objects between the kernel and the workers, by value.

Two facts shape this module (see ``ipyparallel-facts.md``):

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
import tempfile
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

_ALIGN = 64


def shm_dir() -> str:
    """Where tensor files go: RAM-backed ``/dev/shm`` when it is writable."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    return tempfile.gettempdir()


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

    def discard(self) -> None:
        """Remove the tensor file (the side that made it calls this)."""
        if self.path:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


class ShippingError(TypeError):
    """An object could not be pickled for the workers."""


def _torch():
    return sys.modules.get("torch")


def _is_plain_tensor(obj: Any) -> bool:
    torch = _torch()
    if torch is None or type(obj) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return (
        obj.layout == torch.strided
        and not obj.is_quantized
        and obj.device.type != "meta"
        and (obj.is_leaf or not obj.requires_grad)
    )


class _Pickler(cloudpickle.Pickler):
    """cloudpickle that lifts plain tensors out of the stream.

    The same tensor object seen twice (tied weights) gets one reference, so
    it is still one shared tensor after loading.
    """

    def __init__(self, file: io.BytesIO, lifted: list[Any]):
        super().__init__(file, protocol=5)
        self._lifted = lifted
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:  # noqa: D401 - pickle hook
        if not _is_plain_tensor(obj):
            return None
        key = id(obj)
        index = self._seen.get(key)
        if index is None:
            index = self._seen[key] = len(self._lifted)
            self._lifted.append(obj)
        return ("nbddp-tensor", index)


def fingerprint(obj: Any) -> str | None:
    """A content key for ``obj``, cheap even for gigabytes of tensors (``None``: cannot tell).

    The object is pickled with its tensors lifted out (so only the small
    rest is hashed); each tensor contributes its storage address, shape,
    dtype, strides and version counter, which PyTorch bumps on every in-place
    change. The same unchanged dataset passed again gets the same key.
    """
    import hashlib

    lifted: list[Any] = []
    buf = io.BytesIO()
    try:
        _Pickler(buf, lifted).dump(obj)
    except Exception:  # noqa: BLE001 - unpicklable objects fail later, with a better message
        return None
    h = hashlib.sha256(buf.getvalue())
    for t in lifted:
        h.update(repr((t.data_ptr(), tuple(t.shape), str(t.dtype), t.stride(), t._version, str(t.device))).encode())
    return h.hexdigest()[:32]


def dumps(obj: Any, *, what: str = "object") -> bytes:
    """cloudpickle ``obj`` with tensors inline (for other hosts), naming what failed."""
    try:
        return cloudpickle.dumps(obj, protocol=5)
    except Exception as exc:  # noqa: BLE001 - re-raised with the culprit named
        raise _explain(obj, what, exc) from exc


def pack(obj: Any, *, what: str = "object", local: bool = True) -> Parcel:
    """Pickle ``obj`` for the workers; with ``local`` its tensors go by shared file."""
    if not local or _torch() is None:
        return Parcel(dumps(obj, what=what))
    buf = io.BytesIO()
    lifted: list[Any] = []
    try:
        _Pickler(buf, lifted).dump(obj)
    except Exception as exc:  # noqa: BLE001
        raise _explain(obj, what, exc) from exc
    if not lifted:
        return Parcel(buf.getvalue())
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
    path = _write_tensors(lifted, metas, total)
    return Parcel(buf.getvalue(), path, metas)


def _new_file(size: int) -> tuple[str, int]:
    path = os.path.join(shm_dir(), f"nbddp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, max(size, 1))
    return path, fd


def _write_tensors(tensors: list[Any], metas: list[TensorMeta], total: int) -> str:
    torch = _torch()
    path, fd = _new_file(total)
    try:
        with mmap.mmap(fd, max(total, 1)) as mm:
            flat = torch.frombuffer(mm, dtype=torch.uint8)
            for t, meta in zip(tensors, metas):
                if meta.nbytes:
                    src = t.detach()
                    if src.device.type != "cpu":
                        src = src.cpu()
                    src = src.contiguous().reshape(-1).view(torch.uint8)
                    flat[meta.offset : meta.offset + meta.nbytes].copy_(src)
            del flat
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return path


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[Any]):
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> Any:
        tag, index = pid
        if tag != "nbddp-tensor":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self._tensors[index]


def unpack(parcel: Parcel, *, copy: bool = True) -> Any:
    """Load a parcel. With ``copy=False`` tensors are views of the mapped file.

    Views are only for reading straight into existing tensors (the kernel's
    ``load_state_dict``); anything kept must be copied, the default.
    """
    if parcel.path is None:
        return pickle.loads(parcel.data)
    torch = _torch() or __import__("torch")
    with open(parcel.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    flat = torch.frombuffer(mm, dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
    tensors: list[Any] = []
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


def _explain(obj: Any, what: str, exc: Exception) -> ShippingError:
    path = _find_unpicklable(obj, what)
    culprit = f" The part that fails is {path}." if path and path != what else ""
    return ShippingError(
        f"{what} cannot be sent to the workers: {type(exc).__name__}: {exc}.{culprit} "
        "Objects holding open files, locks, sockets, generators or live connections do not pickle. "
        "HINT: pass a zero-argument function that builds it on each worker instead "
        f"(e.g. `lambda: make_{_ident(what)}()`), or drop the attribute before the call."
    )


def _ident(what: str) -> str:
    word = what.split()[0].strip("`'\"")
    return "".join(c for c in word if c.isalnum() or c == "_") or "object"


def _find_unpicklable(obj: Any, path: str, depth: int = 0) -> str | None:
    """Walk attributes/items to the deepest part that still fails to pickle."""
    if depth > 6:
        return path
    try:
        cloudpickle.dumps(obj)
        return None
    except Exception:  # noqa: BLE001
        pass
    children: list[tuple[str, Any]] = []
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
    return path
