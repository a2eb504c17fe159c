"""Engine-side code: runs inside the ipyparallel engines, one per rank.

Nothing here imports ipywidgets or IPython display code; the kernel side
(``nbddp.live``, ``nbddp.magics``) never imports this package's training
loop. Functions called from the kernel live in ``worker.entry``.
"""
