"""Notices for the person: through ``warnings`` (``NbddpWarning``), and the ``logging`` logger ``"nbddp"``.

A notice is something a person may want to see once and then silence: a
guess nbddp made (a scheduler's interval), a stalled rank, a logger that
failed. ``print`` to stderr could not be filtered; a warning category can
(``warnings.filterwarnings("ignore", category=nbddp.NbddpWarning)``), and
the logger carries the rest (``logging.getLogger("nbddp")``), as Lightning
and HF do. Shared by both sides: a worker's notice travels to the kernel as
text and is raised there.
"""

from __future__ import annotations

import logging
import threading
import warnings

LOGGER_NAME = "nbddp"
logger = logging.getLogger(LOGGER_NAME)


class NbddpWarning(UserWarning):
    """Category of every notice nbddp gives through ``warnings``: filter it to silence them."""


class NbddpDeprecationWarning(NbddpWarning, DeprecationWarning):
    """An old spelling that still works (``sweep(live="html")``, ``nbddp.modules``): the message names the new one.

    A ``DeprecationWarning`` too, so ``-W error::DeprecationWarning`` and
    pytest's ``deprecated_call`` see it, and an ``NbddpWarning``, so one
    filter on that category silences every notice of nbddp's.
    """


def deprecated(text: str, stacklevel: int = 3) -> None:
    """Warn that an old spelling was used (``text`` names the new one): an ``NbddpDeprecationWarning``."""
    warnings.warn(text, NbddpDeprecationWarning, stacklevel=stacklevel)


def notify(text: str, stacklevel: int = 3) -> None:
    """Warn with ``text`` (an ``NbddpWarning``); ``stacklevel`` points at the person's call where it can.

    With ``warnings.filterwarnings("error", category=NbddpWarning)`` the
    notice is raised, in the thread that asked for it. A fit's watcher and
    hooks threads give notices too (a stalled rank, a logger that failed):
    there an exception would end the watching while the ranks go on, so a
    notice raised as an error is logged on the ``nbddp`` logger at ERROR
    instead, and the work goes on.
    """
    try:
        warnings.warn(text, NbddpWarning, stacklevel=stacklevel)
    except NbddpWarning:
        if threading.current_thread() is threading.main_thread():
            raise
        logger.error("%s (an NbddpWarning the warnings filters raise as an error; from the %s thread it is "
                     "logged, and the work goes on)", text, threading.current_thread().name)


def report(text: str, details: str) -> None:
    """A one-line notice (a warning), and its details (a traceback) on the ``nbddp`` logger at WARNING.

    The line can be silenced with a warnings filter; the details with
    ``logging.getLogger("nbddp").setLevel(logging.ERROR)`` (Python prints a
    logger's warnings to stderr when nothing was configured).
    """
    notify(text)
    logger.warning("%s\n%s", text, details.rstrip())
