"""``live=``: one vocabulary for every call that shows itself while it runs.

``dist_fit``, ``predict``, ``evaluate``, ``sweep`` and ``run`` take the same
values, checked here:

* ``True`` or ``None`` (automatic): the notebook's view in a Jupyter kernel
  (the dashboard, the leaderboard, a progress bar), text elsewhere;
* ``"widget"``: the notebook's view; ``"text"``: lines of text;
* ``False``: nothing.

An old spelling goes on working, with an ``NbddpDeprecationWarning`` that
names the new one: ``sweep(live="html")`` is ``live="widget"``.
"""

from __future__ import annotations

from typing import Literal

from nbddp.protocol.notices import deprecated

LiveChoice = bool | Literal["widget", "text"] | None  # what live= takes (see the module docstring)
OLD_SPELLINGS = {"html": "widget"}  # nbddp.sweep(live="html") before the vocabulary was one


def live_choice(live: object, where: str, stacklevel: int = 4) -> LiveChoice:
    """``live`` checked for ``where(live=...)``; an old spelling, warned about, becomes its new one."""
    if isinstance(live, str) and live in OLD_SPELLINGS:
        new = OLD_SPELLINGS[live]
        deprecated(f"{where}(live={live!r}) is now live={new!r} (one vocabulary for live=: True, False, 'widget', "
                   f"'text'); {live!r} will go in a later release", stacklevel=stacklevel)
        return "widget" if new == "widget" else "text"
    if live is None or isinstance(live, bool) or live in ("widget", "text"):
        return live
    raise ValueError(f"{where}(live=...) must be True, False, None (automatic), 'widget' or 'text'; got {live!r}")


def in_notebook_kernel() -> bool:
    """Whether this runs in a Jupyter kernel (where the notebook's views can be drawn)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def resolved(live: LiveChoice) -> Literal["widget", "text", "off"]:
    """Which view ``live`` means here: the notebook's (in a Jupyter kernel), text, or none."""
    if live is False:
        return "off"
    if live in ("widget", "text"):
        return live
    return "widget" if in_notebook_kernel() else "text"
