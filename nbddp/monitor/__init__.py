"""Watching the ranks: stalls, ``nbddp.stacks()`` / ``%ddp stacks``, and ``%ddp status``.

Reads the heartbeats the workers publish and the stack dumps they write;
sends only ``worker/tasks/``.
"""
