"""KERNEL: ``nbddp.report``'s records from every rank, reduced per step (``collector.py``).

The ranks' half is ``worker/engine/report_channel.py`` (records kept and
published off the training thread). ``collector.py`` takes each rank's
stream in, reduces each step over the ranks once every rank reported it or
went past it, keeps each rank's own value, and tells mismatched names. The
call that shows them (view, History, hooks, the agreed stop) is
``cells/reported_call.py``.
"""
