"""The one ``Session`` of a kernel: starting and stopping workers, the process group, healing.

Owns the session and its start options, forming process groups
(``process_group.py``), the supervisor that replaces lost ranks, resident
datasets and the source-line ledger. Sends only ``worker/tasks/``.
"""
