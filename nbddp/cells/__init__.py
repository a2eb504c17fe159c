"""The person's own code on every rank: ``%%ddp`` cells, ``nbddp.run``, scripts, push and pull, and their output.

Each is a ``nbddp.execution.calls.RankCall`` (one task per rank, the fault
contract, interrupts); this package says what runs (``cell_code.py``,
``function_calls.py``, ``scripts.py``) and prints each rank's output
labelled (``rank_output.py``); what the ranks report (``nbddp.report``) is
shown, kept as a History and handed to the loggers and callbacks by
``reported_call.py``. Sends only ``worker/tasks/``.
"""
