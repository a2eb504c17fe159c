"""Kernel-side callbacks of a fit: ``Callback``, ``EarlyStopping``, and the hooks that call them.

Owns what runs in the kernel while a fit streams its records. Imports the
shared layer and ``fit/``'s records; never ``worker/``.
"""

from nbddp.callbacks.base import Callback, Record, stop_fit
from nbddp.callbacks.early_stopping import EarlyStopping

__all__ = ["Callback", "EarlyStopping", "Record", "stop_fit"]
