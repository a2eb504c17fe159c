"""Inference on a rank: ``nbddp.predict``'s and ``nbddp.evaluate``'s loops, the shard each rank reads, outputs and metrics.

Imports only ``worker/`` and the shared layer; the kernel reaches it through ``worker/tasks/predict.py``.
"""
