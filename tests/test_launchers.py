"""The ipyparallel launchers the README names, started for real: MPI (``mpiexec`` from the ``mpich`` wheel).

``nbddp.start(cluster=ipp.Cluster(engines="mpi", n=2))`` has ipyparallel run ``mpiexec -n 2 python -m
ipyparallel.engine``; each engine takes its id from MPI (``mpi4py``), and nbddp forms its own gloo group over
them and trains. The commands are those of docs/multi-node.md's MPI section.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nbddp


def _mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (the ``mpich`` wheel puts it in the venv's bin/), else on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def _mpi_missing() -> str | None:
    if _mpiexec() is None:
        return "no mpiexec (pip install mpich: the test extra has it)"
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return "no mpi4py (the test extra has it)"
    return None


def pmi_rank() -> str | None:
    """The rank MPI's launcher gave this engine's process."""
    return os.environ.get("PMI_RANK")


@pytest.mark.fresh_workers  # stops the suite's workers: its own come from mpiexec
@pytest.mark.skipif(_mpi_missing() is not None, reason=f"MPI test skipped: {_mpi_missing()}")
def test_mpi_launcher_starts_two_engines_and_a_fit_trains_on_them():
    import ipyparallel as ipp
    from traitlets.config import Config

    nbddp.stop()
    config = Config()
    config.MPILauncher.mpi_cmd = [_mpiexec()]
    try:
        nbddp.start(cluster=ipp.Cluster(engines="mpi", n=2, config=config), backend="gloo")
        assert sorted(nbddp.run(pmi_rank)) == ["0", "1"]  # both engines are processes of one mpiexec job
        x, y = torch.randn(64, 8), torch.randint(0, 3, (64,))
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        before = [p.detach().clone() for p in model.parameters()]
        history = nbddp.dist_fit(model, (x, y), epochs=1, batch_size=8, loss_fn=F.cross_entropy, live=False)
        assert history.status == "completed" and len(history.ranks) == 2
        assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # trained weights came back
    finally:
        nbddp.stop()
