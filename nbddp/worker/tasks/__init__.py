"""The entry points: every function the kernel sends to a rank, and what wraps each task.

The kernel imports nothing else of ``worker/``. Each module is one kind of
task (a fit, a call, a cell, a script, a probe, a process group, debugging,
status, trials). Imports only ``worker/`` and the shared layer.
"""
