"""Kernel side of ``nbddp.predict`` and ``nbddp.evaluate``: argument checks, the run on every rank, outputs in order.

Imports kernel packages, the shared layer, and of ``worker/`` only ``worker/tasks/predict.py``.
"""
