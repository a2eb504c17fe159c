"""The engine process itself: its state, torchrun's environment, the heartbeat and stack dumps, device meshes.

Imports only ``worker/`` and the shared layer.
"""
