"""What the kernel and the workers agree on: messages, errors, option records, placements, parallel settings.

The bottom of the shared layer: plain data and checks, importable on both
sides, importing nothing of nbddp outside ``protocol/``. ``shipping/`` and
``partitioning/`` build on it, never the reverse: the errors and records are
the vocabulary everyone shares (``shipping/`` raises ``ShippingError``, and
its files live where ``notes.py`` says), while how objects travel is one
mechanism among its users.
"""
