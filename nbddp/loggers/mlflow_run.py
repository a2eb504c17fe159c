"""MLflow: one MLflow run per fit, written from the kernel with ``MlflowClient``.

The store is opened before any worker starts (``check``), so a wrong
``tracking_uri``, an unreachable server or a missing driver fails the call
at once. The default store is MLflow's own default (``MLFLOW_TRACKING_URI``,
else ``sqlite:///mlflow.db`` in the current directory), read by
``mlflow ui`` there. Metrics are sent in one ``log_batch`` per arrival of
records. A resumed fit continues the same run id; MLflow keeps every value
it was sent, so resume from the latest checkpoint for a series without
repeated steps.
"""

from __future__ import annotations

import time
from typing import Any

from nbddp.loggers.fit_info import FitInfo
from nbddp.loggers.base import Logger, need

_STATUS = {"completed": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}
_BATCH = 1000  # MLflow's limit of metrics per log_batch
_PARAMS = 100  # ... and of params
_VALUE_CHARS = 6000


class MLflow(Logger):
    """``dist_fit(loggers=[MLflow(tracking_uri="sqlite:///mlflow.db", experiment="digits")])``.

    Args:
        tracking_uri: any MLflow tracking URI (a database, a server); default MLflow's.
        experiment: the experiment's name, created when missing.
        run_name: the run's name (default: the fit's run name).
        tags: extra run tags.
    """

    name = "mlflow"

    def __init__(self, tracking_uri: str | None = None, experiment: str = "nbddp", run_name: str | None = None,
                 tags: dict[str, str] | None = None):
        self.tracking_uri, self.experiment, self.run_name, self.tags = tracking_uri, experiment, run_name, tags or {}
        self.client: Any = None
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.buffer: list[Any] = []

    def check(self) -> None:
        tracking = need("mlflow.tracking", "mlflow-skinny", "nbddp.loggers.MLflow")
        try:
            self.client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
            found = self.client.get_experiment_by_name(self.experiment)
            self.experiment_id = found.experiment_id if found else self.client.create_experiment(self.experiment)
        except Exception as exc:  # noqa: BLE001 - the store's own error, with what was asked of it
            raise RuntimeError(f"MLflow(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r}): cannot "
                               f"open the tracking store: {type(exc).__name__}: {str(exc)[:500]}") from None

    def start(self, info: FitInfo, resume: dict[str, Any] | None) -> dict[str, Any]:
        params = {k: str(v)[:_VALUE_CHARS] for k, v in info.hparams.items()}
        if resume and resume.get("run_id"):
            self.run_id = resume["run_id"]
            self.client.update_run(self.run_id, status="RUNNING")
            logged = self.client.get_run(self.run_id).data.params  # a param's value cannot change once logged
            for key, value in params.items():
                if key in logged and logged[key] != value:
                    self.client.set_tag(self.run_id, f"nbddp.resumed.{key}", value)
            params = {k: v for k, v in params.items() if k not in logged}
        else:
            tags = {"mlflow.source.name": "nbddp.dist_fit", **self.tags}
            run = self.client.create_run(self.experiment_id, run_name=self.run_name or info.run_name, tags=tags)
            self.run_id = run.info.run_id
        self._params(params)
        return {"run_id": self.run_id, "tracking_uri": self.client.tracking_uri}

    def _params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k, v) for k, v in params.items()]
        for i in range(0, len(items), _PARAMS):
            self.client.log_batch(self.run_id, params=items[i:i + _PARAMS])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.buffer += [Metric(key, value, now, step) for key, value in metrics.items()]

    def flush(self) -> None:
        batch, self.buffer = self.buffer, []
        for i in range(0, len(batch), _BATCH):
            self.client.log_batch(self.run_id, metrics=batch[i:i + _BATCH])

    def finish(self, status: str) -> None:
        if self.run_id is not None:
            self.flush()
            self.client.set_terminated(self.run_id, status=_STATUS.get(status, "FINISHED"))

    def where(self) -> str:
        return f"{self.client.tracking_uri} run {self.run_id}" if self.run_id else ""

    def __repr__(self) -> str:
        return f"MLflow(tracking_uri={self.tracking_uri!r}, experiment={self.experiment!r})"
