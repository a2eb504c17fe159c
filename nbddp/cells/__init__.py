"""The person's own code on every rank: ``%%ddp`` cells, ``nbddp.run``, scripts, push and pull, and their output.

Each is a ``nbddp.execution.calls.RankCall`` (one task per rank, the fault
contract, interrupts); this package says what runs (``cell_code.py``,
``function_calls.py``, ``scripts.py``) and shows each rank's output
(``rank_output.py``): lines labelled, progress bars redrawn in place
(``line_buffer.py``, ``live_lines.py``), the chosen ranks' figures and
displays (``rank_displays.py``), every message taken in order
(``rank_messages.py``); what the ranks report (``nbddp.report``) is
shown, kept as a History and handed to the loggers and callbacks by
``reported_call.py``. Sends only ``worker/tasks/``.
"""
