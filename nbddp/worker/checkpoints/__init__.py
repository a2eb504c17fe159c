"""Checkpoints on a rank: whole files (``files.py``), sharded ones (``sharded.py``, torch DCP), and an
elastic fit's snapshots, which are checkpoints in ``/dev/shm`` (``snapshots.py``).

Imports only ``worker/`` and the shared layer.
"""
