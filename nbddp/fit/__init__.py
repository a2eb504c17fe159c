"""``dist_fit`` in the kernel: arguments checked, the run watched, the handle and the History.

Owns its options as typed records (``arguments.py``), the checks before any worker works (``preflight.py``,
``option_checks.py``, ``parallel_checks.py``), the running fit
(``fit_run.py``), ``FitHandle`` and ``History``. Sends ``worker/tasks/entry.py``.
"""
