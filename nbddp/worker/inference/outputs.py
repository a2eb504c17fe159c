"""A rank's outputs, batch by batch: written into the kernel's shared file at their rows, or kept and packed.

On the kernel's host, with map-style data and ``output="tensor"``, each
batch is copied straight to its samples' rows of one file
(``shipping/output_file.py``): nothing is joined or packed at the end. Any
other case (a stream, ``output="list"``, another host, outputs that do not
fit the file's layout) keeps the batches and packs them into one part
(``shipping/batched_outputs.py``'s rules), as the kernel expects.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from nbddp.shipping import output_file
from nbddp.shipping.batched_outputs import batches_of, join


def to_cpu(out: Any) -> Any:
    """``out`` with every tensor detached and on the CPU (tuples, lists and dicts walked)."""
    if isinstance(out, torch.Tensor):
        return out.detach().cpu()
    if isinstance(out, Mapping):
        return {k: to_cpu(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(to_cpu(v) for v in out)
    return out


def predictions(out: Any, ignore: Any = ()) -> Any:
    """What the default step keeps of a model's output: as ``transformers.Trainer.predict``'s ``predictions``.

    A dict-like output (a Hugging Face ``ModelOutput``, a dict) loses its
    ``"loss"`` (one number per batch, not per sample: it would keep the
    outputs from joining), its ``None`` entries and the keys the model's
    config ignores at inference (``keys_to_ignore_at_inference``, e.g.
    ``past_key_values``); when only its ``"logits"`` remain they are the
    output, a tensor, as HF returns them. An object with a ``.logits``
    attribute gives its logits. Anything else is kept as it is.
    """
    if isinstance(out, Mapping):
        kept = {k: v for k, v in out.items() if k != "loss" and v is not None and k not in ignore}
        return kept["logits"] if list(kept) == ["logits"] else kept
    logits = getattr(out, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else out


def ignored_keys(model: Any) -> tuple[str, ...]:
    """A Hugging Face model's ``config.keys_to_ignore_at_inference`` (none for other models)."""
    return tuple(getattr(getattr(model, "config", None), "keys_to_ignore_at_inference", None) or ())


class OutputsDoNotFit(OSError):
    """The shared-memory file system is full: the outputs need more than it has."""


def do_not_fit(path: str, nbytes: int) -> OutputsDoNotFit:
    import shutil

    folder = os.path.dirname(path)
    return OutputsDoNotFit(errno.ENOSPC, f"nbddp.predict's outputs ({nbytes / 2**20:.1f} MiB) do not fit in {folder}: "
                                         f"it is full ({shutil.disk_usage(folder).free / 2**20:.1f} MiB free). Pass "
                                         "to='a/directory' to have each rank write its part to disk, predict fewer "
                                         "samples per call, or give the machine a larger /dev/shm (in a container: "
                                         "docker run --shm-size=...)")


class FileRows:
    """This rank's rows of the shared output file, from dataset index ``first`` on, filled batch by batch.

    Written with ``pwrite``, not through a mapping: a fresh ``/dev/shm`` page
    written through a mapping costs a page fault (128 MiB: 0.16-0.22 s here),
    ``pwrite`` fills the same pages in 0.07-0.08 s.
    """

    def __init__(self, path: str, layout: output_file.Layout, first: int):
        self.layout, self.first, self.at, self.path = layout, first, 0, path
        self.write_s = 0.0  # seconds spent writing: the return path's share of the loop
        self.starts = layout.starts()
        self.fd = os.open(path, os.O_RDWR)  # the kernel created it: owner-only, removed by the kernel
        size = max(layout.nbytes, 1)
        if os.fstat(self.fd).st_size < size:  # every rank sets the same size: the first does it
            os.ftruncate(self.fd, size)

    def fits(self, out: Any, rows: int) -> bool:
        if output_file.layout_of(out, self.layout.n) != self.layout:
            return False
        return all(t.shape[0] == rows for t in (out.values() if isinstance(out, dict) else (out,)))

    def write(self, out: Any, rows: int) -> None:
        t0 = time.perf_counter()
        for leaf, start in zip(self.layout.leaves, self.starts):
            t = (out if leaf.key is None else out[leaf.key]).detach().cpu().contiguous()
            try:
                _write_all(self.fd, t.view(-1).view(torch.uint8).numpy(),
                           start + (self.first + self.at) * leaf.row_bytes)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                raise do_not_fit(self.path, self.layout.nbytes) from exc
        self.at += rows
        self.write_s += time.perf_counter() - t0

    def taken(self) -> tuple[str, Any]:
        """``(kind, the rows written so far)``, read back, to go on without the file."""
        got = {}
        for leaf, start in zip(self.layout.leaves, self.starts):
            t = torch.empty((self.at, *leaf.shape), dtype=getattr(torch, leaf.dtype))
            if t.numel():
                os.preadv(self.fd, [t.view(-1).view(torch.uint8).numpy().data], start + self.first * leaf.row_bytes)
            got[leaf.key] = t
        return ("tensor", got[None]) if list(got) == [None] else ("dict", got)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _write_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done


class Outputs:
    """The batches of one rank, in order."""

    def __init__(self, output: str):
        self.output = output  # "tensor": join where possible; "list": keep the batches as they are
        self.batches: list[Any] = []
        self.rows: list[int] = []
        self.path, self.n, self.first = "", 0, 0
        self.file: FileRows | None = None
        self.write_s = 0.0  # seconds writing into the file (included in the loop's)

    def into_file(self, path: str, n: int | None, first: int) -> None:
        """Write into the kernel's shared file ``path`` (none: ``""``) for a dataset of ``n`` samples (a stream: None)."""
        if path and n is not None and self.output == "tensor":
            self.path, self.n, self.first = path, n, first

    def add(self, out: Any, rows: int) -> None:
        if self.path and not self.rows:  # the first batch says the layout; the first rank there claims the file
            layout = output_file.layout_of(out, self.n)
            if layout is not None and output_file.claim(self.path, layout) == layout:
                try:
                    self.file = FileRows(self.path, layout, self.first)
                except FileNotFoundError:  # the call ended meanwhile: whatever this rank sends is discarded
                    self.file = None
        if self.file is not None:
            if self.file.fits(out, rows):
                self.file.write(out, rows)
                self.write_s = self.file.write_s
                self.rows.append(rows)
                return
            self._leave_file(self.file)
        self.batches.append(to_cpu(out))
        self.rows.append(rows)

    def _leave_file(self, file: FileRows) -> None:
        """A batch that does not fit the file: the rows written so far come back here, the rank goes on without."""
        kind, value = file.taken()
        self.batches = batches_of({"kind": kind, "value": value, "rows": self.rows})
        file.close()
        self.file = None

    def packed(self) -> dict[str, Any]:
        """What travels to the kernel: ``{"kind", "value", "rows"}`` (``kind="file"``: the rows are in the file)."""
        if self.file is not None:
            self.file.close()
            return {"kind": "file", "value": None, "rows": list(self.rows)}
        if not self.batches:
            return {"kind": "empty", "value": None, "rows": []}
        kind, value = join(self.batches) if self.output == "tensor" else ("list", list(self.batches))
        return {"kind": kind, "value": value, "rows": list(self.rows)}

    def close(self) -> None:
        """Unmap the file, whatever happened (a failed or stopped rank)."""
        if self.file is not None:
            self.file.close()
