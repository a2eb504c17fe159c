"""``nbddp.predict``'s outputs in one shared file, each sample's rows written once at their final place.

On the kernel's host the ranks do not pack their outputs and the kernel does
not join them: the kernel creates one empty owner-only file in ``/dev/shm``
(``create``), every rank writes each batch's outputs straight into it at the
rows of that batch's samples (the dataset's order is known: a rank's block
starts at ``first``), and the kernel maps the finished file as the result
(``load``): no ``torch.cat`` on the ranks, no pickling, no copy in the kernel.

The file holds one region per output tensor (one for a tensor output, one
per key of a dict), each ``n`` rows of that tensor's per-sample shape and
dtype: the ``Layout``. A rank only learns the layout from its first batch,
and ranks do not talk during a plain predict, so the first rank to get there
claims it (``claim``: a note linked into place, which fails if one exists);
a rank whose outputs do not fit the claimed layout (other shapes, a batch
that differs from its first) keeps its outputs itself and packs them as
before, and the kernel puts the two kinds together.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import secrets
from dataclasses import dataclass
from typing import Any

_ALIGN = 4096  # each region starts on a page


@dataclass(frozen=True)
class Leaf:
    key: str | None  # None: the output is one tensor; else its key in the dict
    shape: tuple[int, ...]  # one sample's
    dtype: str  # "float32", ...

    @property
    def row_bytes(self) -> int:
        import torch

        return math.prod(self.shape) * torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()


@dataclass(frozen=True)
class Layout:
    n: int  # samples in the dataset: rows of every region
    leaves: tuple[Leaf, ...]

    def starts(self) -> list[int]:
        """Byte offset of each leaf's region."""
        offsets, at = [], 0
        for leaf in self.leaves:
            offsets.append(at)
            at += -(-leaf.row_bytes * self.n // _ALIGN) * _ALIGN
        return offsets

    @property
    def nbytes(self) -> int:
        starts = self.starts()
        return starts[-1] + self.leaves[-1].row_bytes * self.n if self.leaves else 0

    def to_json(self) -> str:
        return json.dumps({"n": self.n, "leaves": [[f.key, list(f.shape), f.dtype] for f in self.leaves]})

    @staticmethod
    def from_json(text: str) -> "Layout":
        raw = json.loads(text)
        return Layout(raw["n"], tuple(Leaf(k, tuple(s), d) for k, s, d in raw["leaves"]))


def layout_of(out: object, n: int) -> Layout | None:
    """The layout a batch's output implies for ``n`` samples; None when it has none (not a tensor with a sample
    dimension, nor a non-empty dict of them with string keys)."""
    import torch

    def leaf(key: str | None, t: object) -> Leaf | None:
        if type(t) is not torch.Tensor or t.dim() < 1 or t.layout != torch.strided:
            return None
        return Leaf(key, tuple(t.shape[1:]), str(t.dtype).removeprefix("torch."))

    if isinstance(out, dict):
        if not out or not all(isinstance(k, str) for k in out):
            return None
        leaves = tuple(leaf(k, v) for k, v in out.items())
    else:
        leaves = (leaf(None, out),)
    found = tuple(f for f in leaves if f is not None)
    return Layout(n, found) if len(found) == len(leaves) else None


def create(prefix: str) -> str:
    """A new empty owner-only file for one call's outputs, named with the session's prefix (removed with it)."""
    from nbddp.protocol.notes import shm_dir

    path = os.path.join(shm_dir(), f"{prefix}-out-{secrets.token_hex(8)}")
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600))
    return path


def note_path(path: str) -> str:
    return f"{path}.layout"


def claim(path: str, layout: Layout) -> Layout | None:
    """The file's layout: ``layout`` if this rank is the first to say, else the one a peer claimed first; None
    when the file is gone (the kernel ended the call: a peer failed, or it was stopped).

    The note is written under a name of its own, then hard-linked into place:
    the link fails when a note is there already, and a note in place is
    always whole. The kernel removes the file, then the note; a note linked
    after that is removed here, so none outlives the call.
    """
    tmp = f"{note_path(path)}.{os.getpid()}-{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(layout.to_json())
        os.link(tmp, note_path(path))
        if not os.path.exists(path):
            os.unlink(note_path(path))
            return None
        return layout
    except FileExistsError:
        return claimed(path)
    finally:
        os.unlink(tmp)


def claimed(path: str) -> Layout | None:
    """The layout a rank claimed for the file; None when no rank wrote to it."""
    try:
        with open(note_path(path)) as f:
            return Layout.from_json(f.read())
    except FileNotFoundError:
        return None


def remove(path: str) -> None:
    """Remove the file and its note (a tensor mapping it keeps its memory until the tensor goes)."""
    for p in (path, note_path(path)):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def map_file(path: str, size: int, populate: bool = True) -> mmap.mmap:
    """The file mapped shared and writable (writes change no one else's copy once the file is unlinked).

    ``populate``: the page tables are filled now (``MAP_POPULATE``), in one
    call, rather than one fault per page at first touch.
    """
    flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
    with open(path, "r+b") as f:
        return mmap.mmap(f.fileno(), max(size, 1), flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def regions(mm: mmap.mmap, layout: Layout) -> dict[str | None, Any]:
    """Every leaf's whole region as a tensor of ``n`` rows viewing the mapping (which the tensors keep alive)."""
    import torch

    flat = torch.frombuffer(mm, dtype=torch.uint8) if len(mm) else torch.empty(0, dtype=torch.uint8)
    out = {}
    for leaf, start in zip(layout.leaves, layout.starts()):
        raw = flat[start:start + leaf.row_bytes * layout.n]
        out[leaf.key] = raw.view(getattr(torch, leaf.dtype)).view(layout.n, *leaf.shape)
    return out


def load(path: str, layout: Layout) -> Any:
    """The whole output, viewing the file: one tensor, or a dict of tensors in the claimed key order."""
    views = regions(map_file(path, layout.nbytes), layout)
    return views[None] if list(views) == [None] else views
