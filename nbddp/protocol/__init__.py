"""What the kernel and the workers agree on: messages, errors, option records, placements, parallel settings.

Part of the shared layer: plain data and checks, importable on both sides.
Imports nothing of nbddp outside the shared layer
(``protocol/``, ``shipping/``, ``partitioning/``).
"""
