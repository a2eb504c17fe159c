"""Engines as a Slurm job: the request (``start(slurm=...)``), the launcher, ``squeue``/``scancel``, and the job watch.

Imports the shared layer and ``cluster/``.
"""
