"""Memory given back after every task: the C allocator's settings, heap trims, usage figures, what is kept.

Imports only ``worker/`` and the shared layer.
"""
