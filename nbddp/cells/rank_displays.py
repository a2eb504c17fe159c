"""The ranks' rich output under the cell: figures, HTML, widgets' snapshots, from the ranks asked for.

What a rank displays (``plt.show()``, ``display(fig)``, HF's notebook
progress table, a widget) reaches the kernel as ``display_data``, then
``update_display_data`` for a display handle's updates and ``clear_output``.
They are published again in the notebook through IPython's display
publisher, as ipyparallel's ``%px`` does (``AsyncResult.display_outputs``),
with the rank in the output's metadata:

* only the ranks chosen (``displays=``: by default the lowest rank the
  call runs on, rank 0); the others' are dropped, not kept;
* updates of one display are folded to the newest per tick, so a rank that
  updates a table at every step costs the notebook at most one message a
  tick; outside a Jupyter kernel (a terminal: nothing can be updated in
  place) only each display's final state is shown, at the end;
* ``clear_output`` from a chosen rank clears the cell's output, as it does
  in a local cell (so ``clear_output(wait=True); display(fig)`` in a loop
  animates a figure); outside a Jupyter kernel it is ignored.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

from nbddp.cells.rank_messages import RankMessage

Displays = int | list[int] | slice | str | bool | None  # a rank, a list, a slice, "all", "none"/False; None: the first


class RankDisplays:
    """Publish the chosen ranks' rich output; ``take`` each message, ``flush`` at every tick."""

    def __init__(self, shown: set[int] | None, notebook: bool, live: bool = True, label: bool = False,
                 before_print: Callable[[], None] | None = None):
        """``shown``: the ranks whose output is published (None: every rank); ``notebook``: a Jupyter kernel
        (updates and clears work); ``live``: publish at each tick, else all at ``flush(final=True)``;
        ``label``: print ``[rank N] display:`` before each new display (several ranks shown);
        ``before_print``: called before text is printed outside a notebook (a terminal's bars make room)."""
        self.shown, self.notebook, self.live, self.label = shown, notebook, live, label
        self.before_print = before_print
        self.pending: list[RankMessage] = []  # in order; updates folded by display id
        self.updates: dict[str, int] = {}  # display id -> index of its pending update
        self.cleared = False  # a clear_output was published since the caller last asked

    def wants(self, rank: int) -> bool:
        return self.shown is None or rank in self.shown

    def take(self, message: RankMessage) -> None:
        if not self.wants(message.rank):
            return
        display_id = (message.content.get("transient") or {}).get("display_id")
        if message.kind == "update_display_data" and display_id:
            if display_id in self.updates:
                self.pending[self.updates[display_id]] = message
                return
            self.updates[display_id] = len(self.pending)
        self.pending.append(message)

    def flush(self, final: bool = False) -> None:
        """Publish what is pending (``final``: the call ended, publish even when not live)."""
        if not self.pending or not (self.live or final):
            return
        if not self.notebook and not final:  # a terminal: new displays now, updates only at the end
            now = [m for m in self.pending if m.kind == "display_data"]
            self.pending = [m for m in self.pending if m.kind == "update_display_data"]
            self.updates = {str((m.content.get("transient") or {}).get("display_id")): i
                            for i, m in enumerate(self.pending)}
        else:
            now, self.pending, self.updates = self.pending, [], {}
        for message in now:
            self._publish(message)

    def _publish(self, message: RankMessage) -> None:
        content = message.content
        if message.kind == "clear_output":
            if self.notebook:
                clear(bool(content.get("wait")))
                self.cleared = True
            return
        data = content.get("data") or {}
        metadata = dict(content.get("metadata") or {})
        metadata["nbddp"] = {"rank": message.rank}
        transient = content.get("transient") or None
        update = message.kind == "update_display_data"
        if not self.notebook and self.before_print is not None:
            self.before_print()
        if self.label and not update:
            sys.stdout.write(f"[rank {message.rank}] display:\n")
            sys.stdout.flush()
        publish(data, metadata, transient, update=update and self.notebook)


def publish(data: dict[str, Any], metadata: dict[str, Any], transient: dict[str, Any] | None, update: bool) -> None:
    """One output in the notebook through IPython's display publisher (text/plain printed where there is none)."""
    from IPython import get_ipython

    ip = get_ipython()
    if ip is None:
        text = data.get("text/plain")
        if text:
            print(text)
        return
    kwargs: dict[str, Any] = {"update": True} if update else {}
    if transient:
        kwargs["transient"] = transient
    ip.display_pub.publish(data=data, metadata=metadata, **kwargs)


def clear(wait: bool) -> None:
    """Clear the cell's output through the shell's display publisher (as ``IPython.display.clear_output``)."""
    from IPython import get_ipython

    ip = get_ipython()
    if ip is not None:
        ip.display_pub.clear_output(wait)


def shown_ranks(displays: Displays, running: list[int], world_size: int, where: str) -> set[int] | None:
    """``displays=`` as the set of ranks whose rich output is shown (None: every rank); checked.

    The default (None) is the lowest rank the call runs on: rank 0, unless
    ``--targets`` leaves it out.
    """
    if displays is None:
        return set(sorted(running)[:1])
    if displays is False or displays == "none":
        return set()
    if displays is True or displays == "all":
        return None
    if isinstance(displays, slice):
        listed = list(range(world_size))[displays]
    elif isinstance(displays, int) and not isinstance(displays, bool):
        listed = [displays]
    elif isinstance(displays, (list, tuple)) and all(isinstance(r, int) and not isinstance(r, bool) for r in displays):
        listed = list(displays)
    else:
        raise ValueError(f"{where}(displays=...) takes a rank (1), a list of ranks ([0, 1]), a slice, 'all' or 'none'; "
                         f"got {displays!r}")
    unknown = [r for r in listed if not -world_size <= r < world_size]
    if unknown:
        raise ValueError(f"{where}(displays={displays!r}): no rank {', '.join(map(str, unknown))}; the workers have "
                         f"ranks 0..{world_size - 1}")
    return {r + world_size if r < 0 else r for r in listed}
