"""Data on a rank: datasets and samplers, loaders, streams sharded by rank, prefetch, batches.

Imports only ``worker/`` and the shared layer.
"""
