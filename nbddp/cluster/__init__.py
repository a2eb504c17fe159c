"""The engines: starting, attaching to and stopping ipyparallel clusters, on one host or through launchers.

Owns the engine set (``engines.py``), attaching to a running ipcluster, how an
engine ended (``engine_exits.py``), the reaper that outlives no kernel, the
IOPub guard, and Slurm (``slurm/``). Imports the shared layer only.
"""
