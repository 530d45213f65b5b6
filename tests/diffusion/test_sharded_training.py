"""``model.shard: fsdp2`` under torchrun (two gloo processes) against the unsharded run.

Each family's tiny pipeline trains MARBLE with a solve on every step (the per-row
engine, checked against K backward passes on the first) and gradient checkpointing,
once with the frozen transformer sharded and once replicated; the runs must be the same
run: rewards, weights, gradient norms and the saved LoRA, while each process holds about
half the frozen weights. The replicated runs are also the trainer's DDP test: the two
processes' adapters stay identical.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mogradient_diffusion.model.tiny_flux import TinyFluxSpec, save_tiny_flux_pipeline
from mogradient_diffusion.model.tiny_qwen_image import save_tiny_qwen_image_pipeline
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.metrics_log import read_metrics

TESTS = Path(__file__).resolve().parents[1]
COMMON = [
    "run.quiet=true",
    "model.gradient_checkpointing=true",
    "strategy.period=1",
    "rollout.steps=3",
]
# Rewards smooth in the pixels give every group signal on the untrained tiny models.
SMOOTH = [
    "reward_modules=[diffusion.smooth_rewards]",
    "rewards=[{name: smooth_brightness}, {name: smooth_redness}]",
]


def _family_settings(family: str, directory: Path) -> list[str]:
    if family == "sd3":  # the tiny preset's own pipeline and rewards, two epochs
        return ["train.epochs=2"]
    if family == "flux":
        path = save_tiny_flux_pipeline(directory, TinyFluxSpec(guidance_embeds=True))
    else:
        path = save_tiny_qwen_image_pipeline(directory)
    return [f"model.path={path}", "train.epochs=1", *SMOOTH]


def _train(run_dir: Path, shard: str, settings: list[str]) -> None:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        "-m",
        "mogradient_diffusion.cli",
        "train",
        "--preset",
        "tiny",
        f"run.directory={run_dir}",
        f"model.shard={shard}",
        *COMMON,
        *settings,
    ]
    environment = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONWARNINGS": "ignore",
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    result = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def _leaves(record: object, path: str = "") -> dict[str, object]:
    """Every value of a metrics record by its path, timings and memory left out."""
    if isinstance(record, dict):
        leaves: dict[str, object] = {}
        for key, value in record.items():
            if not key.startswith((keys.TIMING_PREFIX, "memory/")):
                leaves.update(_leaves(value, f"{path}/{key}"))
        return leaves
    if isinstance(record, list):
        leaves = {}
        for index, value in enumerate(record):
            leaves.update(_leaves(value, f"{path}[{index}]"))
        return leaves
    return {path: record}


def _same(mine: object, theirs: object) -> bool:
    if isinstance(mine, float) and isinstance(theirs, float):
        # float32 training: the same kernels on the same values, up to round-off
        return math.isclose(mine, theirs, rel_tol=1e-4, abs_tol=1e-6) or mine == theirs
    return mine == theirs


@pytest.mark.parametrize("family", ["sd3", "flux", "qwen_image"])
def test_sharded_frozen_weights_train_as_the_replicated_run(tmp_path: Path, family: str) -> None:
    settings = _family_settings(family, tmp_path / "pipeline")
    runs = {shard: tmp_path / shard for shard in ("none", "fsdp2")}
    for shard, run_dir in runs.items():
        _train(run_dir, shard, settings)
    replicated, sharded = read_metrics(runs["none"]), read_metrics(runs["fsdp2"])
    assert len(replicated) == len(sharded) >= 1
    for mine, theirs in zip(sharded, replicated, strict=True):
        ours, reference = _leaves(mine), _leaves(theirs)
        assert ours.keys() == reference.keys()
        differing = [k for k in ours if not _same(ours[k], reference[k])]
        assert not differing, [(k, ours[k], reference[k]) for k in differing[:5]]
        assert 0.5 <= mine[keys.FROZEN_WEIGHTS] / theirs[keys.FROZEN_WEIGHTS] < 0.6
        assert mine[keys.PARAMETER_DIVERGENCE] == theirs[keys.PARAMETER_DIVERGENCE] == 0.0
    steps = [step for record in sharded for step in record[keys.OPTIMIZER_STEPS]]
    solved = [step for step in steps if step.get("solved")]
    assert solved and {step["engine"] for step in solved} == {"rows"}
    for name in ("lora", "lora_ema"):
        ours = load_file(runs["fsdp2"] / name / "pytorch_lora_weights.safetensors")
        reference = load_file(runs["none"] / name / "pytorch_lora_weights.safetensors")
        assert ours.keys() == reference.keys()
        for key, value in ours.items():
            assert value.allclose(reference[key], rtol=1e-4, atol=1e-6), key


def test_sharding_without_torchrun_is_a_config_error() -> None:
    from mogradient_diffusion.training_config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"model\.shard=fsdp2 .* torchrun --nproc_per_node"):
        load_config(preset="tiny", overrides=["model.shard=fsdp2"])
    with pytest.raises(ConfigError, match=r"model\.shard must be one of"):
        load_config(preset="tiny", overrides=["model.shard=fsdp1"], world_size=2)
