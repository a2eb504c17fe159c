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
after drawing them. The worker side imports no display code
(``tests/test_house.py``): it uses the modules the cell's own code loaded,
and does nothing when the cell drew no figure.
"""

from __future__ import annotations

import sys


def show_open_figures(shown: bool) -> None:
    """Draw (``shown``) or drop the figures left open by the code that just ran, with the inline backend only."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    inline = sys.modules.get("matplotlib_inline.backend_inline")  # loaded by pyplot when it drew with it
    if pyplot is None or inline is None or not pyplot.get_fignums():
        return
    if "inline" not in str(pyplot.get_backend()):
        return
    if shown:
        inline.show(close=True)
    else:
        pyplot.close("all")
