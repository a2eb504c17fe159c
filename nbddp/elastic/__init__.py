"""Elastic fits, in the kernel: ``dist_fit(max_restarts=..., snapshot_every=..., retry_on=...)``.

Owns the check of those options (``policy.py``), the fit's snapshot folder in
``/dev/shm`` (``snapshot_folder.py``) and what happens after a lost rank
(``recovery.py``: retry or not, wait for the supervisor's heal, relaunch the
same ``FitRun`` from the last snapshot, ``History.restarts``; ``contracts.py``:
what a relaunch needs of the fit it relaunches). Imports the
kernel's packages and the shared layer; the snapshots are written by
``worker/checkpoints/snapshots.py``.
"""
