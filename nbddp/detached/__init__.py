"""Sessions that outlive their kernel: detach, the record, attach, and the fit found running (issue reattach).

KERNEL side. It builds on ``session/`` (the one ``Session`` it fills in
again), ``cluster/`` (the engines reached from a new kernel, the reaper's
idle end), ``fit/`` (the handle and History of a fit that ran while no kernel
was attached) and the record format in ``protocol/session_record.py``.
"""
