"""Where a fit's time goes, per rank: the time split every fit carries (``History.time_split()``).

The workers time the phases their loop marks (``worker/engine/heartbeat.py``)
and send the seconds in the per-record reduction and in each rank's result;
this package turns them into communication against waiting, shares, the
efficiency and the sentence the views print.
"""
