"""The engine process itself: its state, torchrun's environment, the heartbeat and stack dumps, device meshes,
the figures a cell leaves open (``figures.py``).

Also how the groups beyond the world group end (``group_lifetime.py``: a
subgroup destroyed, DTensor's caches forgotten), which the tasks, the data
readers and the meshes all call. Imports only ``worker/`` and the shared layer.
"""
