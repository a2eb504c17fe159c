"""The training loop on a rank: set-up, the loop, validation, the reports it streams, the best weights.

Imports only ``worker/`` and the shared layer.
"""
