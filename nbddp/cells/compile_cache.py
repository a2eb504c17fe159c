"""``nbddp.compile_cache(save=path)`` / ``(load=path)``: what the workers compiled, kept in a file and brought back.

The session's Inductor cache directory lives as long as the session (it is
removed by ``nbddp.stop()``). To start a new session, or the machine a
Slurm job lands on, warm, save torch's portable cache artifacts
(``torch.compiler.save_cache_artifacts``) from every rank into one file,
and load them (``load_cache_artifacts``) into every rank of the new session
before its first compiled fit.

The file: one JSON line (format, torch version, each blob's size, a
signature), then the blobs. Ranks that compiled the same graphs give
identical blobs; each is kept once. The blobs are code (torch unpickles
them, then runs the graphs they hold), so ``load`` takes only a file this
user's ``save`` signed (``nbddp/fit/signing.py``), or one the person vouches for with
``trust_checkpoint=True``. It lives here, beside ``nbddp.run``, because it is
a call of nbddp's own functions on every rank (``function_calls.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import TYPE_CHECKING, Any

from nbddp.fit import signing
from nbddp.protocol.errors import UntrustedCheckpointError

if TYPE_CHECKING:
    from nbddp.session.session import Session

FORMAT = "nbddp-compile-cache/1"


def compile_cache(save: str | os.PathLike[str] | None = None,
                  load: str | os.PathLike[str] | None = None, *, trust_checkpoint: bool = False) -> dict[str, Any]:
    """Save what every rank compiled to ``save``, or load ``load`` into every rank; returns what moved.

    Returns ``{"path", "bytes", "artifacts": {kind: count}}`` (for ``load``,
    the counts rank 0 loaded). The file is owner-only (0600) and signed with a
    key only this user reads; ``load`` refuses a file that signature does not
    match (someone else's: loading it would run their code on every rank)
    unless ``trust_checkpoint=True``.

    Raises:
        ValueError: neither or both of ``save`` and ``load``; nothing compiled yet; a file of
            another format, or saved by another torch version.
        UntrustedCheckpointError: ``load`` of a file this user's ``save`` did not sign.
    """
    from nbddp.session.session import get_session

    if save is not None and load is None:
        path, saving = save, True
    elif load is not None and save is None:
        path, saving = load, False
    else:
        raise ValueError(f"nbddp.compile_cache() takes one of save=path or load=path, got save={save!r}, "
                         f"load={load!r}")
    session = get_session()
    session.ensure_started()
    path = os.path.abspath(os.fspath(path))
    if not isinstance(trust_checkpoint, bool):
        raise TypeError(f"nbddp.compile_cache(trust_checkpoint=...) must be True or False, got {trust_checkpoint!r}")
    return _save(session, path) if saving else _load(session, path, trust_checkpoint)


def _save(session: Session, path: str) -> dict[str, Any]:
    import torch

    from nbddp.cells.function_calls import call_everywhere
    from nbddp.worker.tasks.compile_cache import save_artifacts

    blobs: list[bytes] = []
    kinds: dict[str, int] = {}
    seen: set[str] = set()
    for found in call_everywhere(session, save_artifacts, (), {}):
        digest = hashlib.sha256(found[0]).hexdigest() if found is not None else None
        if digest is None or digest in seen:
            continue
        seen.add(digest)
        blobs.append(found[0])
        for kind, n in found[1].items():
            kinds[kind] = kinds.get(kind, 0) + n
    if not blobs:
        raise ValueError("nbddp.compile_cache(save=...): no rank has compiled anything in this session; run "
                         "dist_fit(..., compile=True) first, then save")
    header = {"format": FORMAT, "torch": torch.__version__, "sizes": [len(b) for b in blobs], "artifacts": kinds,
              "signature": signing.sign(blobs)}
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(json.dumps(header).encode() + b"\n")
            for blob in blobs:
                f.write(blob)
        os.replace(tmp, path)
    except BaseException:  # a full disk, an interrupt: no half-written file left beside the path
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return {"path": path, "bytes": os.path.getsize(path), "artifacts": kinds}


def read_file(path: str, trust_checkpoint: bool = False) -> tuple[dict[str, Any], list[bytes]]:
    """The header and blobs of a file ``_save`` wrote, checked against this torch and this user's signature."""
    import torch

    with open(path, "rb") as f:
        line = f.readline()
        try:
            header = json.loads(line)
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"nbddp.compile_cache(load={path!r}): not a file nbddp.compile_cache(save=...) wrote "
                             f"(its first line should name {FORMAT!r})")
        blobs = [f.read(n) for n in header["sizes"]]
    if header["torch"] != torch.__version__:
        raise ValueError(f"nbddp.compile_cache(load={path!r}) was saved with torch {header['torch']}, and the workers "
                         f"run torch {torch.__version__}: compiled code is only valid for the torch that made it. "
                         "Compile afresh (the first fit will) and save again")
    if not trust_checkpoint and not signing.signed_here(blobs, header.get("signature")):
        raise UntrustedCheckpointError(
            f"nbddp.compile_cache(load={path!r}): this file was not saved by your nbddp.compile_cache(save=...) (its "
            f"signature does not match your key, {signing.key_path()}), and a compile cache is code that every rank "
            "would run. If you trust who wrote it, pass nbddp.compile_cache(load=path, trust_checkpoint=True)",
            path=path)
    return header, blobs


def _load(session: Session, path: str, trust_checkpoint: bool) -> dict[str, Any]:
    from nbddp.protocol.compile_settings import session_cache_dir
    from nbddp.cells.function_calls import call_everywhere
    from nbddp.worker.tasks.compile_cache import load_artifacts

    _, blobs = read_file(path, trust_checkpoint)
    counts = call_everywhere(session, load_artifacts, (blobs, session_cache_dir(session.file_prefix)), {})
    return {"path": path, "bytes": os.path.getsize(path), "artifacts": counts[0]}
