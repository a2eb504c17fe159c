"""Objects between the kernel and the workers by value: cloudpickle, ``/dev/shm`` files, source lines.

Part of the shared layer: imports only ``protocol/`` of nbddp.
"""

from nbddp.shipping.by_value import ship_by_reference, ship_by_value

__all__ = ["ship_by_reference", "ship_by_value"]
