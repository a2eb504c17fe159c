"""``SlurmEngines``: ipyparallel's ``SlurmEngineSetLauncher``, with two things added.

* When ``sbatch`` refuses a job (no such partition, a bad account...), its
  own message is what the person reads. ipyparallel runs it with
  ``check_output``, which leaves ``stderr`` on the kernel's terminal and
  raises "returned non-zero exit status 1".
* Each submission asks for as many nodes as its engines need
  (``{nodes}``, ``{tasks_on_node}`` in the template): the first job spreads
  ``n`` engines over ``--nodes``; a replacement for one lost engine asks for
  one node, not all of them.

Submitting, naming, cancelling (``scancel``) and the batch script itself are
ipyparallel's.
"""

from __future__ import annotations

import subprocess
from typing import Any

from ipyparallel.cluster.launcher import SlurmEngineSetLauncher
from traitlets import Integer

from nbddp.protocol.errors import SlurmError
from nbddp.cluster.slurm.queue import cancel


class SlurmEngines(SlurmEngineSetLauncher):
    """Engines as one Slurm job (see the module docstring)."""

    tasks_per_node = Integer(1, config=True, help="engines per node: one per GPU, or per CPU slot")

    def write_batch_script(self, n: int = 1) -> None:
        per_node = max(1, self.tasks_per_node)
        self.namespace: dict[str, Any] = {**self.namespace, "nodes": -(-n // per_node),
                                          "tasks_on_node": min(n, per_node)}
        super().write_batch_script(n)

    def _run_command(self, command: list[str], **kwargs: Any) -> str:
        done = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, **kwargs)
        if done.returncode != 0:
            said = (done.stderr.strip() or done.stdout.strip() or f"exit status {done.returncode}")
            raise SlurmError(f"Slurm refused the job: {said}\n(the command was: {' '.join(command)}; "
                             f"batch script {self.batch_file})", job_id=self.job_id)
        return done.stdout

    def stop(self) -> str:
        """``scancel`` the job; a job that already ended is stopped, not an error."""
        complaint = cancel([self.job_id]) if self.job_id else ""
        if complaint:
            raise SlurmError(f"could not cancel Slurm job {self.job_id}: {complaint}", job_id=self.job_id)
        self.notify_stop({"job_id": self.job_id, "output": ""})
        return ""
