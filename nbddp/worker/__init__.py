"""Engine-side code: runs inside the ipyparallel engines, one per rank.

Imports only ``worker/`` and the shared layer (``protocol/``, ``shipping/``,
``partitioning/``); never ipywidgets or IPython display code. The kernel
imports only the entry points in ``worker/tasks/``.
"""
