"""Work one cell waits for, on every rank: ``%%ddp`` cells, ``nbddp.run``, scripts, and their output.

Owns the ``Job`` a cell waits on, one task per rank (``rank_tasks.py``), the
interruptible wait, and each rank's labelled output. Sends only
``worker/tasks/``.
"""
