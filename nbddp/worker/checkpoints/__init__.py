"""Checkpoints on a rank: whole files (``files.py``) and sharded ones (``sharded.py``, torch DCP).

Imports only ``worker/`` and the shared layer.
"""
