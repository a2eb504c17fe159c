"""Weights & Biases: one W&B run per fit, written from the kernel (never from a worker).

The run's config is the fit's hyperparameters. The API key stays in the
kernel (``wandb login``, ``WANDB_API_KEY``): nothing of W&B is shipped, and
the workers never import it. A resumed fit continues the same run
(``wandb.init(id=..., resume="allow")``); W&B keeps a run's steps
increasing, so resume from the latest checkpoint for a series without a
gap. ``mode="offline"`` (or ``WANDB_MODE=offline``) writes the run under
``dir`` for ``wandb sync`` later.
"""

from __future__ import annotations

import os
from typing import Any

from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers.base import Logger, metrics_of, need, writable_dir

_LOCAL_MODES = ("offline", "disabled", "dryrun")


class WandB(Logger):
    """``dist_fit(loggers=[WandB(project="my-project")])``.

    Args:
        project, entity, group, tags, notes: as in ``wandb.init``.
        name: the run's display name (default: the fit's run name).
        dir: where W&B keeps its files (default: W&B's, the current directory).
        mode: ``"online"``, ``"offline"`` or ``"disabled"`` (default: ``WANDB_MODE``, else online).
        **init: any other ``wandb.init`` argument (``settings=...``, ...).
    """

    name = "wandb"

    def __init__(self, project: str | None = None, *, entity: str | None = None, name: str | None = None,
                 dir: str | os.PathLike | None = None, mode: str | None = None, group: str | None = None,
                 tags: list[str] | None = None, notes: str | None = None, **init: Any):
        self.project, self.entity, self.run_name, self.dir = project, entity, name, dir
        self.mode, self.group, self.tags, self.notes, self.init = mode, group, tags, notes, init
        self.run: Any = None
        self.location = ""

    def check(self) -> None:
        wandb = need("wandb", "wandb", "nbddp.loggers.WandB")
        if self.dir is not None:
            self.dir = writable_dir(self.dir, f"WandB(dir={self.dir!r})")
        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        if mode not in _LOCAL_MODES:
            try:  # in the notebook's thread, before training: W&B's own prompt when no key is known
                wandb.login()
            except Exception as exc:  # noqa: BLE001 - re-raised with the ways out
                raise RuntimeError(f"WandB: cannot log in to W&B ({type(exc).__name__}: {exc}). Run `wandb login` "
                                   "or set WANDB_API_KEY in the notebook's environment, or pass WandB(mode='offline') "
                                   "to write the run locally and `wandb sync` it later") from None

    def start(self, info: FitInfo, resume: dict[str, Any] | None) -> dict[str, Any]:
        import wandb

        kwargs: dict[str, Any] = dict(project=self.project or "nbddp", entity=self.entity,
                                      name=self.run_name or info.run_name, dir=self.dir, mode=self.mode,
                                      group=self.group, tags=self.tags, notes=self.notes, config=info.hparams,
                                      reinit="create_new")
        kwargs.setdefault("settings", wandb.Settings(console="off"))  # the notebook's output is not the run's
        kwargs.update(self.init)
        if resume and resume.get("id"):
            kwargs.update(id=resume["id"], resume="allow", project=resume.get("project") or kwargs["project"])
            kwargs["config"] = {k: v for k, v in info.hparams.items() if k not in ("resume", "epochs", "max_steps")}
        self.run = wandb.init(**kwargs)
        self.location = self.run.url or os.path.dirname(self.run.dir)  # online: the run's page; offline: its folder
        return {"id": self.run.id, "project": self.run.project}

    def log(self, kind: str, record: dict[str, Any]) -> None:
        metrics = metrics_of(kind, record)
        if metrics:
            self.run.log({**metrics, "epoch": record.get("epoch", 0)}, step=int(record["step"]))

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.summary["status"] = status
            self.run.finish(exit_code=1 if status == "failed" else 0)
            self.run = None

    def where(self) -> str:
        return self.location

    def __repr__(self) -> str:
        return f"WandB(project={self.project!r})"
