"""Objects between the kernel and the workers by value: cloudpickle, ``/dev/shm`` files, source lines.

Part of the shared layer, above ``protocol/``: imports only ``protocol/`` of
nbddp (its errors, and where the session's files live), and ``protocol/``
imports nothing of it, so a record or an error never depends on how objects
travel.
"""

from nbddp.shipping.by_value import ship_by_reference, ship_by_value

__all__ = ["ship_by_reference", "ship_by_value"]
