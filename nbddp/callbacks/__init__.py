"""Kernel-side callbacks of a fit: ``Callback``, ``EarlyStopping``, and the hooks that call them.

Owns what runs in the kernel while a fit streams its records. Imports the
shared layer, ``loggers/`` and the session; never ``worker/``. ``fit/``
imports this package, so what the hooks read of a fit, its History and its
link to rank 0 are small Protocols here (``HookedFit``, ``EndedFit``,
``Rank0Reach``).
"""

from nbddp.callbacks.base import Callback, Record, stop_fit
from nbddp.callbacks.early_stopping import EarlyStopping

__all__ = ["Callback", "EarlyStopping", "Record", "stop_fit"]
