"""run.loggers: one tiny training run logs to metrics.jsonl, TensorBoard, W&B (offline) and
MLflow (a file store), and each backend's per-step series read back equal metrics.jsonl's.

No mocks: the real packages write, and each is read back with its own reader (TensorBoard's
event accumulator, MLflow's client; W&B has no reader for offline runs, so its transaction
log is decoded with wandb's own record protobuf)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from mogradient_diffusion.cli import main
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training_config import load_config

pytest.importorskip("wandb")
pytest.importorskip("mlflow")

ALL = "run.loggers=[jsonl,tensorboard,wandb,mlflow]"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("loggers") / "run"
    main(
        [
            "train",
            "--preset",
            "tiny",
            f"run.directory={directory}",
            "run.quiet=true",
            "train.epochs=1",
            "run.conflict_probe=true",
            ALL,
        ]
    )
    return directory


def expected_weights(run_dir: Path) -> dict[str, dict[int, float]]:
    """{step/weight/<objective>: {global optimizer step: weight}} from metrics.jsonl."""
    series: dict[str, dict[int, float]] = {}
    step = 0
    for record in read_metrics(run_dir):
        for entry in record[keys.OPTIMIZER_STEPS]:
            for name, weight in zip(record[keys.OBJECTIVES], entry[keys.WEIGHTS], strict=True):
                series.setdefault(keys.step_weight(name), {})[step] = weight
            step += 1
    return series


def test_weights_and_cosines_are_named_by_reward(run_dir: Path) -> None:
    expected = expected_weights(run_dir)
    assert set(expected) == {"step/weight/color_match", "step/weight/jpeg_incompressibility"}
    assert all(len(steps) >= 2 for steps in expected.values())


def test_tensorboard_reads_back_the_steps_and_epochs(run_dir: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps = EventAccumulator(str(run_dir / "tensorboard" / "optimizer_steps")).Reload()
    for key, series in expected_weights(run_dir).items():
        logged = {event.step: event.value for event in steps.Scalars(key)}
        assert logged == pytest.approx(series, rel=1e-6)  # stored as float32
    tags = steps.Tags()["scalars"]
    assert {keys.STEP_COS_MIN, keys.STEP_SOLVED, keys.STEP_GRAD_NORM} <= set(tags)
    assert keys.step_cos("jpeg_incompressibility") in tags
    epochs = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert keys.reward_mean("color_match") in epochs.Tags()["scalars"]
    assert keys.SAMPLES in epochs.Tags()["images"]


def test_mlflow_reads_back_the_steps(run_dir: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    for key, series in expected_weights(run_dir).items():
        logged = {metric.step: metric.value for metric in client.get_metric_history(run_id, key)}
        assert logged == series
    reward = client.get_metric_history(run_id, keys.reward_mean("jpeg_incompressibility"))
    assert [metric.step for metric in reward] == [0]
    assert client.get_run(run_id).info.status == "FINISHED"


def test_wandb_offline_run_reads_back_the_steps(run_dir: Path) -> None:
    history = wandb_history(run_dir)
    for key, series in expected_weights(run_dir).items():
        logged = {int(row["optimizer_step"]): row[key] for row in history if key in row}
        assert logged == pytest.approx(series)
    epochs = [row for row in history if keys.reward_mean("color_match") in row]
    assert [row["epoch"] for row in epochs] == [0]
    assert f"{keys.SAMPLES}/_type" in epochs[0]  # an image is stored as its fields


def wandb_history(run_dir: Path) -> list[dict[str, object]]:
    """The history rows of the run's offline ``.wandb`` file: LevelDB-log blocks holding
    wandb's ``Record`` protobufs."""
    import json

    from wandb.proto import wandb_internal_pb2

    (path,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    data, block, position, pending = path.read_bytes(), 32768, 7, b""
    rows = []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item  # a name with "/" is split into nested_key
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items}
                )
    return rows


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.loggers=[jsonl,tensorbord]", "did you mean 'tensorboard'"),
        ("run.loggers=[tensorboard,wandb]", "must include jsonl"),
        ("run.wandb_mode=cloud", "run.wandb_mode must be one of"),
    ],
)
def test_config_errors(override: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        load_config(preset="tiny", overrides=[override])
    assert "\n" not in str(error.value)


def test_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chosen backend whose package is absent is one line with the pip command."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(ConfigError, match=r"pip install 'mogradient-diffusion\[mlflow\]'"):
        load_config(preset="tiny", overrides=["run.loggers=[jsonl,mlflow]"])
