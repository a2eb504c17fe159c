"""pdb on a rank: the rank's debugger over its line to the kernel, and the failure kept for a post-mortem.

Imports only ``worker/`` and the shared layer.
"""
