"""Files nbddp wrote for this user, told apart from files anyone else could have written: an HMAC.

A compile cache (``nbddp.compile_cache``) is code: torch unpickles its artifacts and runs the graphs Inductor
generated. Loading one that someone else wrote runs their code on every rank. So ``compile_cache(save=...)``
signs what it writes with a key only this user can read (``$XDG_CONFIG_HOME/nbddp/signing.key``, else
``~/.config/nbddp/signing.key``: 0600 in a 0700 folder, made on first use), and ``load`` takes a file whose
signature matches, or one the person vouches for (``trust_checkpoint=True``). A home shared by the machines
(a cluster's login node and its compute nodes) shares the key, so a cache saved on one loads on another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from collections.abc import Iterable


def key_path() -> str:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "nbddp", "signing.key")


def _key(create: bool) -> bytes | None:
    path = key_path()
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        if not create:
            return None
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    key = secrets.token_bytes(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another kernel made it first: use theirs
        return _key(create=False)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def sign(parts: Iterable[bytes]) -> str:
    """The signature of ``parts`` (in order) with this user's key, made if it is missing."""
    key = _key(create=True)
    assert key is not None
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(hashlib.sha256(part).digest())
    return mac.hexdigest()


def signed_here(parts: Iterable[bytes], signature: object) -> bool:
    """Whether ``signature`` is this user's signature of ``parts`` (False without a key, or a signature)."""
    key = _key(create=False)
    if key is None or not isinstance(signature, str):
        return False
    mac = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(hashlib.sha256(part).digest())
    return hmac.compare_digest(mac.hexdigest(), signature)
