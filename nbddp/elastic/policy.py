"""``dist_fit``'s elastic options checked: how many restarts, how often a snapshot, which errors are retried.

Checked in the kernel before anything is shipped, so a typo costs an error
message; the result is the fit's ``FailurePolicy`` (``nbddp/execution/policy.py``),
which decides what is retried. Only the snapshot interval travels to the
workers (in ``FitConfig.snapshot_every``).
"""

from __future__ import annotations

import datetime
import numbers
import re
from collections.abc import Iterable
from typing import TypeAlias

from nbddp.execution.policy import FailurePolicy

# dist_fit(snapshot_every=...): int steps, "epoch", a duration ("30s" or a timedelta), "auto" (None: "auto")
SnapshotEvery: TypeAlias = "int | str | datetime.timedelta | None"
# dist_fit(retry_on=...): exception classes retried besides lost ranks
RetryOn: TypeAlias = "type[BaseException] | Iterable[type[BaseException]] | None"

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|sec|seconds?|m|min|minutes?|h|hours?)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
FORMS = ("an int of optimizer steps (snapshot_every=200), 'epoch', a duration ('30s', '2min', '1h', or a "
         "datetime.timedelta), or 'auto' (the default: every 30 s or more, so that writing costs at most 2 %)")


def check_elastic(max_restarts: int, snapshot_every: SnapshotEvery, retry_on: RetryOn) -> FailurePolicy:
    """``dist_fit(max_restarts=, snapshot_every=, retry_on=)`` as the fit's ``FailurePolicy``.

    Raises:
        TypeError / ValueError: naming the option, the value and the fix.
    """
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, numbers.Integral):
        raise TypeError(f"dist_fit(max_restarts=...) must be an int, got {type(max_restarts).__name__} "
                        f"{max_restarts!r}")
    if max_restarts < 0:
        raise ValueError(f"dist_fit(max_restarts={max_restarts}): the number of times a lost rank is replaced and the "
                         "fit goes on must be 0 (the default: a lost rank ends the fit) or more, e.g. max_restarts=3")
    types = exception_types(retry_on)
    if not max_restarts:
        given = [name for name, value in (("snapshot_every", snapshot_every), ("retry_on", types)) if value]
        if given:
            raise ValueError(f"dist_fit({given[0]}=...) takes effect only in a fit that restarts after a "
                             f"lost rank; pass max_restarts=N (N >= 1) too, or leave {' and '.join(given)} out")
        return FailurePolicy()
    return FailurePolicy(int(max_restarts), snapshot_interval(snapshot_every), types)


def snapshot_interval(value: SnapshotEvery) -> int | str | float:
    """``snapshot_every`` as the workers read it: int steps, ``"epoch"``, float seconds or ``"auto"``."""
    if value is None or value == "auto":
        return "auto"
    if value == "epoch":
        return "epoch"
    if isinstance(value, datetime.timedelta):
        value = f"{value.total_seconds()}s"
    duration = _DURATION.match(value) if isinstance(value, str) else None
    amount: float
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        amount, seconds = int(value), False
    elif duration is not None:
        number, unit = duration.groups()
        amount, seconds = float(number) * _UNIT_S[unit[0]], True
    else:
        raise ValueError(f"dist_fit(snapshot_every={value!r}) must be {FORMS}")
    if amount <= 0:
        raise ValueError(f"dist_fit(snapshot_every={(amount if seconds else value)!r}): a snapshot interval must be "
                         f"above 0 {'seconds' if seconds else 'steps'}; give {FORMS}")
    return amount if seconds else int(amount)


def exception_types(retry_on: RetryOn) -> tuple[type[BaseException], ...]:
    """``retry_on``: an exception class or several (matched by name: the worker's exception comes back as text)."""
    if retry_on is None:
        return ()
    items: tuple[object, ...]
    try:
        items = (retry_on,) if isinstance(retry_on, type) else tuple(retry_on)
    except TypeError:
        items = (retry_on,)
    bad = [item for item in items if not (isinstance(item, type) and issubclass(item, BaseException))]
    if bad:
        raise TypeError(f"dist_fit(retry_on=...) takes exception classes to retry besides lost ranks, such as "
                        f"retry_on=[OSError, TimeoutError]; {bad[0]!r} is not one")
    return tuple(item for item in items if isinstance(item, type) and issubclass(item, BaseException))
