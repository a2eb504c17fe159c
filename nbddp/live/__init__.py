"""Kernel-side views of a running fit: widget, text, or nothing.

The choice is made in one place, ``choose_view``:

* ``live=False``: nothing is shown;
* inside a Jupyter kernel with ipywidgets: the dashboard widget, plus a
  static final summary for saved notebooks (``live.widget``);
* anywhere else (terminal IPython, a script), or without ipywidgets: a
  compact text line and a final summary (``live.text``);
* ``live="widget"`` / ``live="text"`` force one of them.

``live=`` means the same for every call that shows itself (``choice.py``).

A view has three methods, called from the fit's watcher thread:
``start(run)``, ``update(run)`` (throttled by the view), ``finish(run)``.
``run.live_state`` holds status, per-rank figures and metadata;
``run.history`` the records so far. ``live/`` never imports torch.distributed.

Everything nbddp draws lives here: the views, the figures (``plot.py``,
``compare.py``, ``timeline.py``) and a Slurm job's waiting line
(``job_line.py``). The packages that measure (``profiling/``) or run the
engines (``cluster/``) hand this one their numbers, or are handed its
drawing, and import nothing of it.
"""

from __future__ import annotations

from typing import Protocol

from nbddp.live.choice import LiveChoice, in_notebook_kernel, live_choice
from nbddp.live.state import ViewedFit


class View(Protocol):
    """What a fit's watcher calls: ``start`` in the calling cell, ``update`` (the view throttles), ``finish``."""

    def start(self, run: ViewedFit) -> None: ...

    def update(self, run: ViewedFit) -> None: ...

    def finish(self, run: ViewedFit) -> None: ...


class NullView:
    def start(self, run: ViewedFit) -> None:
        pass

    def update(self, run: ViewedFit) -> None:
        pass

    def finish(self, run: ViewedFit) -> None:
        pass


def choose_view(live: LiveChoice | str) -> View:
    """The view for ``dist_fit(live=...)``: ``None`` and ``True`` mean automatic (``live/choice.py``); any other
    value is refused there."""
    live = live_choice(live, "dist_fit", stacklevel=5)
    if live is False:
        return NullView()
    if live == "widget" or (live != "text" and in_notebook_kernel() and _has_widgets()):
        from nbddp.live.widget import WidgetView

        return WidgetView()
    from nbddp.live.text import TextView

    return TextView()


def _has_widgets() -> bool:
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return True
