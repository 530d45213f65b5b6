"""MLflow: a run in ``run.mlflow_tracking_uri`` (default a file store in ``<run>/mlruns``);
epoch scalars at step = epoch, the steps' diagnostics at step = the optimizer step, the
sample grids and the config as artifacts."""

from __future__ import annotations

import os
import time
from urllib.parse import urlparse

from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.loggers.base import (
    EpochLog,
    Logger,
    LogTarget,
    epoch_scalars,
    remember_id,
    remembered_id,
)

BATCH = 1000  # the most metrics one log_batch call takes
FOLDER_SUFFIX = "all"


def tracking_uri(target: LogTarget) -> str:
    """The configured tracking URI, else a file store inside the run directory."""
    configured = target.settings.mlflow_tracking_uri
    return configured or (target.directory / "mlruns").resolve().as_uri()


class MlflowLogger(Logger):
    name = "mlflow"
    requires = "mlflow"
    install = "pip install 'mogradient-diffusion[mlflow]'"

    def __init__(self, target: LogTarget) -> None:
        super().__init__(target)
        uri = tracking_uri(target)
        if urlparse(uri).scheme in ("", "file"):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless asked;
            # a store inside the run directory needs no server. An explicit "false" stays.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.tracking import MlflowClient

        self._client = client = MlflowClient(tracking_uri=uri)
        run_id = remembered_id(target, self.name)
        if run_id is None:
            experiment = client.get_experiment_by_name(target.settings.mlflow_experiment)
            experiment_id = (
                experiment.experiment_id
                if experiment is not None
                else client.create_experiment(target.settings.mlflow_experiment)
            )
            run_id = client.create_run(experiment_id, run_name=target.directory.name).info.run_id
            remember_id(target, self.name, run_id)
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._folders: set[str] = set()
        client.log_dict(run_id, target.config, "config.yaml")

    def log(self, epoch: EpochLog) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        points = [(k, v, epoch.epoch) for k, v in epoch_scalars(epoch.record).items()]
        for step, scalars in epoch.steps():
            points += [(key, value, step) for key, value in scalars.items()]
        for key, _, _ in points:
            self._folders.update(_ancestors(key))
        metrics = [Metric(self.metric_name(k), v, now, step) for k, v, step in points]
        for start in range(0, len(metrics), BATCH):
            self._client.log_batch(self.run_id, metrics=metrics[start : start + BATCH])
        if epoch.samples is not None:
            self._client.log_image(self.run_id, epoch.samples, key=keys.SAMPLES, step=epoch.epoch)

    def metric_name(self, key: str) -> str:
        """``key``, or ``key/all`` where it is also a folder of other names (``time/reward``
        beside ``time/reward/<reward>``): the file store keeps a metric in a file at its
        name's path, so no name may be another's folder."""
        return f"{key}/{FOLDER_SUFFIX}" if key in self._folders else key

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def _ancestors(key: str) -> list[str]:
    """``a/b/c`` -> ``a``, ``a/b``."""
    parts = key.split("/")
    return ["/".join(parts[:end]) for end in range(1, len(parts))]
