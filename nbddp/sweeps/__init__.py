"""KERNEL: ``nbddp.sweep``, independent trials on groups of the warm workers, sampled and pruned by Optuna.

Imports the kernel packages (``fit``, ``jobs``, ``session``) and, of ``worker/``, only the entry points
of ``worker/tasks/sweep.py``.
"""
