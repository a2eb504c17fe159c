"""The figures a ``%%ddp`` cell leaves open, drawn at its end as a notebook's inline backend draws them.

In a notebook, ``plt.plot(x)`` as a cell's last line shows the figure with
no ``plt.show()``: matplotlib's inline backend draws every open figure after
the cell runs, then closes it. A ``%%ddp`` cell is not a kernel cell on the
worker (the engine runs it as a task: no ``post_execute`` event), so the
cell's task does the same here. The workers already draw with that backend:
ipykernel sets ``MPLBACKEND`` to it in every engine, so ``plt.show()`` and
``display(fig)`` send ``image/png`` with no setting from the person; a
backend the person chose (``MPLBACKEND``, ``matplotlib.use``) is left alone.

Only a rank whose displays the cell shows renders its figures (a PNG costs
tens of milliseconds); the others close theirs, as the inline backend would
after drawing them.
"""

from __future__ import annotations

import sys


def show_open_figures(shown: bool) -> None:
    """Draw (``shown``) or drop the figures left open by the code that just ran, with the inline backend only."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    import matplotlib

    if "inline" not in str(matplotlib.get_backend()):
        return
    if not pyplot.get_fignums():
        return
    if shown:
        from matplotlib_inline.backend_inline import show

        show(close=True)
    else:
        pyplot.close("all")
