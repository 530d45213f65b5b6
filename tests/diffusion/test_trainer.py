"""The training loop on the tiny preset: end to end, exactness, strategies, DDP, resume."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from mogradient.engines import accumulate_gradients
from mogradient.harmonizers import combine
from mogradient_diffusion.cli import main
from mogradient_diffusion.objectives import StepMetrics, TrainPiece
from mogradient_diffusion.objectives.flow_grpo import FlowGRPOSettings
from mogradient_diffusion.objectives.nft_loss import NFTSettings
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import EpochData, Trainer, TrainerCallback
from mogradient_diffusion.training_config import load_config

from .rollouts import first_rollout

FAST = ["run.quiet=true", "train.epochs=2"]


def _run(tmp_path: Path, *overrides: str) -> Path:
    run_dir = tmp_path / "run"
    assert main(["train", "--preset", "tiny", f"run.directory={run_dir}", *FAST, *overrides]) == 0
    return run_dir


def test_marble_tiny_run_writes_metrics_plots_and_a_diffusers_lora(tmp_path: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    run_dir = _run(tmp_path, "train.epochs=3")
    records = read_metrics(run_dir)
    assert [record["step"] for record in records] == [0, 1, 2]
    steps = [step for record in records for step in record["optimizer_steps"]]
    # Solves until one yields a cache (single-objective solves do not), then every 2nd step.
    first = next(i for i, s in enumerate(steps) if s["solved"] and s["fallback"] is None)
    assert all(step["solved"] for step in steps[: first + 1])
    assert [step["solved"] for step in steps[first:]][:2] in ([1, 0], [1])
    assert all(math.isfinite(w) for step in steps for w in step["weights"])
    assert math.isfinite(records[-1]["reward/jpeg_incompressibility/mean"])
    # The preset is multi-objective from its first step: both rewards have signal in every
    # epoch, so no solve falls back to one objective (a 0/1 color check had none at first).
    assert all(record["objectives_without_signal"] == [] for record in records)
    assert not [step for step in steps if step["fallback"] == "single_objective"]
    # The old adapter starts as a copy of the trained one, then lags behind it.
    trained = [step for step in steps if step.get("skipped") != "no reward signal"]
    gaps = [step["objective/velocity_gap_to_old"] for step in trained]
    assert gaps[0] == 0.0 and all(gap > 0 for gap in gaps[1:])
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "checkpoints").is_dir()
    # The resolved config is written and loads back as a config file.
    assert load_config(run_dir / "config.yaml").strategy.name == "marble"

    assert main(["plot", str(run_dir)]) == 0
    assert (run_dir / "plots" / "rewards.png").stat().st_size > 0

    base = StableDiffusion3Pipeline.from_pretrained(run_dir / "tiny_model")
    tuned = StableDiffusion3Pipeline.from_pretrained(run_dir / "tiny_model")
    tuned.load_lora_weights(run_dir / "lora")
    inputs = {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0)),
        "encoder_hidden_states": torch.randn(1, 5, 32),
        "pooled_projections": torch.randn(1, 32),
        "timestep": torch.tensor([500.0]),
    }
    with torch.no_grad():
        delta = tuned.transformer(**inputs).sample - base.transformer(**inputs).sample
    assert delta.abs().max() > 0  # the trained LoRA is loaded and changes the model


def _trainer_and_rollout(tmp_path: Path) -> tuple[Trainer, Any]:
    """A tiny-preset trainer and one rollout of 8 images (2 prompts x 4) to train on."""
    config = load_config(preset="tiny", overrides=[f"run.directory={tmp_path}", "run.quiet=true"])
    trainer = Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
    batch = first_rollout(trainer)
    assert len(batch) == 8
    return trainer, batch


def _whole_batch(batch: Any, advantages: torch.Tensor) -> list[TrainPiece]:
    """One optimizer step of one micro-batch holding every row."""
    return [TrainPiece(batch.rows(torch.arange(len(batch))), advantages)]


def test_full_solve_and_cached_paths_apply_the_same_gradient(tmp_path: Path) -> None:
    """Inside the trainer: K per-objective gradients combined == one combined backward."""
    trainer, batch = _trainer_and_rollout(tmp_path)
    # Advantages with NaN (not applicable) and clamped entries.
    advantages = torch.tensor([[7.0, -1.0], [float("nan"), 0.5], [-6.0, 2.0], [1.0, float("nan")]])
    advantages = advantages.repeat(2, 1)
    torch.manual_seed(0)
    for parameter in trainer.parameters:  # move default away from old: non-trivial branches
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    weights = torch.tensor([0.8, -0.3], dtype=torch.float64)

    def gradient(per_objective: bool) -> torch.Tensor:
        generator = torch.Generator().manual_seed(1)
        step = _whole_batch(batch, advantages)
        for parameter in trainer.parameters:
            parameter.grad = None
        stack = accumulate_gradients(
            trainer.objective.losses(trainer.policy, step, generator, StepMetrics()),
            trainer.parameters,
            None if per_objective else weights,
            2,
        )
        grads = torch.cat(
            [
                (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                for p in trainer.parameters
            ]
        )
        return grads + combine(stack, weights) if per_objective else grads

    full, cached = gradient(True), gradient(False)
    assert full.norm() > 0
    assert (full - cached).norm() <= 1e-5 * full.norm()


@pytest.mark.parametrize(
    "overrides",
    [
        ["strategy.name=weighted_sum"],
        ["strategy.name=single", "strategy.reward=jpeg_incompressibility"],
        [
            "strategy.name=sequential",
            "strategy.stages=[{rewards: [color_match], epochs: 1}, "
            "{rewards: [jpeg_incompressibility], epochs: 1}]",
        ],
        ["strategy.name=reward_dropout", "strategy.dropout_probability=0.5"],
        ["strategy.name=pcgrad"],
        ["strategy.name=upgrad"],
        ["strategy.name=config"],
        ["strategy.name=fairgrad"],
        ["strategy.name=marble", "strategy.period=1", "strategy.normalize=false"],
        ["strategy.name=marble", "strategy.fixed_alpha=true"],
    ],
    ids=[
        "weighted_sum",
        "single",
        "sequential",
        "reward_dropout",
        "pcgrad",
        "upgrad",
        "config",
        "fairgrad",
        "plain_every_step",
        "fixed_alpha",
    ],
)
def test_every_strategy_trains(tmp_path: Path, overrides: list[str]) -> None:
    records = read_metrics(_run(tmp_path, *overrides))
    assert len(records) == 2
    for record in records:
        for step in record["optimizer_steps"]:
            assert all(math.isfinite(w) for w in step["weights"])
            if step.get("skipped") != "no reward signal":
                assert math.isfinite(step["grad_norm"])


def test_marble_solve_steps_conflict_with_no_reward(tmp_path: Path) -> None:
    """Fresh MGDA weights on solve steps (the published pseudocode): min_k cos(d, g_k) >= 0."""
    records = read_metrics(_run(tmp_path, "train.epochs=3", "strategy.period=1"))
    solved = [
        step
        for record in records
        for step in record["optimizer_steps"]
        if step["solved"] and step["fallback"] is None
    ]
    assert solved
    assert all(step["harmonize/cos_min"] >= -1e-6 for step in solved)


def test_a_step_without_reward_signal_leaves_the_weights_alone(tmp_path: Path) -> None:
    """No objective has an applicable sample: no optimizer step, so Adam's momentum from
    the previous step is not replayed."""
    trainer, batch = _trainer_and_rollout(tmp_path)
    generator = torch.Generator().manual_seed(1)
    signal = torch.tensor([[1.0, -1.0], [-1.0, 1.0]]).repeat(4, 1)
    trainer.optimizer_step_on(_whole_batch(batch, signal), generator)
    before = [parameter.detach().clone() for parameter in trainer.parameters]
    silent = torch.full((8, 2), float("nan"))
    record = trainer.optimizer_step_on(_whole_batch(batch, silent), generator)
    assert record["skipped"] == "no reward signal"
    for old, new in zip(before, trainer.parameters, strict=True):
        assert torch.equal(old, new)


def test_rewards_overlapped_with_sampling_give_the_same_run(tmp_path: Path) -> None:
    chunked = ["rollout.batch_size=2", "train.epochs=1"]
    plain = read_metrics(_run(tmp_path / "plain", *chunked))
    overlapped = read_metrics(_run(tmp_path / "overlap", *chunked, "rollout.overlap_rewards=true"))
    for key, value in plain[0].items():
        if key.startswith(("reward/", "advantage/")) and not key.startswith("time/"):
            assert overlapped[0][key] == value, key


def test_conflict_probe_measures_without_changing_the_run(tmp_path: Path) -> None:
    plain = read_metrics(_run(tmp_path / "plain", "strategy.name=weighted_sum"))
    probed = read_metrics(
        _run(tmp_path / "probed", "strategy.name=weighted_sum", "run.conflict_probe=true")
    )
    for before, after in zip(plain, probed, strict=True):
        assert before["reward/color_match/mean"] == after["reward/color_match/mean"]
        for step_before, step_after in zip(
            before["optimizer_steps"], after["optimizer_steps"], strict=True
        ):
            assert step_before["grad_norm"] == step_after["grad_norm"]
            assert -1 <= step_after["harmonize/cos_min"] <= step_after["harmonize/cos_mean"] <= 1
            assert "harmonize/cos_min" not in step_before


def test_conflict_probe_of_a_single_reward_run_is_parallel_to_its_update(tmp_path: Path) -> None:
    # Without the KL term the single-reward update is exactly that reward's gradient.
    overrides = ["strategy.reward=jpeg_incompressibility", "objective.kl_coefficient=0"]
    records = read_metrics(
        _run(tmp_path, "strategy.name=single", *overrides, "run.conflict_probe=true")
    )
    steps = [step for record in records for step in record["optimizer_steps"]]
    assert steps and not any(step["harmonize/stationary"] for step in steps)
    for step in steps:  # reward 1 is jpeg_incompressibility
        assert step["harmonize/cos/1"] == pytest.approx(1.0, abs=1e-5)


def test_sequential_switches_stage(tmp_path: Path) -> None:
    stages = (
        "strategy.stages=[{rewards: [color_match], epochs: 1}, "
        "{rewards: [jpeg_incompressibility], epochs: 1}]"
    )
    records = read_metrics(_run(tmp_path, "strategy.name=sequential", stages))
    assert [record["objectives"] for record in records] == [
        ["color_match"],
        ["jpeg_incompressibility"],
    ]


def test_configuration_errors_are_one_line_before_any_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["train", "--preset", "tiny", f"run.directory={tmp_path}", "train.batch_size=3"])
    assert code == 2
    error = capsys.readouterr().err
    assert "train.batch_size=3" in error and "Traceback" not in error
    assert not (tmp_path / "tiny_model").exists()


# Each recipe family's processes, as its headers say (16 GPUs for SD3.5-M).
RECIPE_GPUS = {"sd35m_": 16, "flux1dev_": 8, "qwen_image_": 4}


def _recipe_world_size(recipe: Path) -> int:
    if "base" in recipe.name:
        return 1
    return next(gpus for prefix, gpus in RECIPE_GPUS.items() if recipe.name.startswith(prefix))


@pytest.mark.parametrize("recipe", sorted(Path("configs").glob("*.yaml")), ids=str)
def test_shipped_recipes_validate(recipe: Path) -> None:
    world_size = _recipe_world_size(recipe)
    config = load_config(recipe, world_size=world_size)
    if not recipe.name.startswith("sd35m_"):
        return  # the other families' values: test_family_recipes_hold_their_headers_values
    assert config.rollout.images_per_prompt == 24
    settings = config.objective.settings
    expected = {  # the references' SD3.5-M values for each objective
        "nft": {"beta": 0.1, "a_max": 5.0},
        "flow_grpo": {"clip_range": 1e-4, "noise_level": 0.7, "advantage_clip": 5.0},
        "sdpo": {"clip_range": 1e-4, "gamma": 0.99, "advantage_clip": 5.0},
    }[config.objective.name]
    assert {key: getattr(settings, key) for key in expected} == expected


# What each family recipe's header cites: Flow-GRPO's FLUX.1-dev recipe, VeRL-Omni's
# DiffusionNFT one for Qwen-Image.
FAMILY_RECIPES: dict[str, dict[str, Any]] = {
    "flux1dev": {
        "model": ("flux", 3.5),
        "rollout": (512, 6, 1.0, "sde", 24, 48, 128),
        "train": (3e-4, 1e-4, 1.0, 0.99, "copy", None),
        "objective": FlowGRPOSettings(kl_coefficient=0.0, noise_level=0.9),
    },
    "qwen_image": {
        "model": ("qwen_image", None),
        "rollout": (512, 10, 1.0, "euler", 16, 24, 256),
        "train": (3e-4, 1e-4, 1.0, 1.0, "delayed_linear", None),
        "objective": NFTSettings(beta=0.1, a_max=5.0, kl_coefficient=1e-4),
    },
}


@pytest.mark.parametrize("strategy", ["marble", "weighted_sum"])
@pytest.mark.parametrize("family", sorted(FAMILY_RECIPES))
def test_family_recipes_hold_their_headers_values(family: str, strategy: str) -> None:
    recipe = Path("configs") / f"{family}_{strategy}.yaml"
    world_size = _recipe_world_size(recipe)
    config = load_config(recipe, world_size=world_size)
    model, lora, rollout, train = config.model, config.lora, config.rollout, config.train
    expected = FAMILY_RECIPES[family]
    assert (model.family, model.guidance) == expected["model"]
    # Rank 64, alpha 128, and the family's own targets (the reference trainers' list).
    assert (lora.rank, lora.alpha, lora.init, lora.target_modules) == (64, 128.0, "gaussian", None)
    assert (
        rollout.resolution,
        rollout.steps,
        rollout.guidance_scale,
        rollout.sampler,
        rollout.images_per_prompt,
        rollout.prompts_per_epoch,
        rollout.max_sequence_length,
    ) == expected["rollout"]
    assert (
        train.learning_rate,
        train.weight_decay,
        train.grad_clip,
        train.timestep_fraction,
        train.old_schedule,
        train.old_cap,
    ) == expected["train"]
    assert config.objective.settings == expected["objective"]
    # Both references take 2 optimizer steps per epoch on their GPUs.
    images = rollout.prompts_per_epoch * rollout.images_per_prompt // world_size
    assert images // (train.batch_size * train.gradient_accumulation) == 2
    if strategy == "marble":
        assert (config.strategy.settings.period, config.strategy.settings.rho) == (10, 0.7)
    else:
        assert config.strategy.settings.weights == [1.0] * len(config.rewards) == [1.0] * 5


def _command(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mogradient_diffusion.cli",
        "train",
        "--preset",
        "tiny",
        f"run.directory={run_dir}",
        "run.quiet=true",
        *extra,
    ]


def _environment() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def test_killed_run_resumes_and_reproduces_the_uninterrupted_one(tmp_path: Path) -> None:
    epochs = ["train.epochs=8", "run.checkpoint_every=1", "run.keep_checkpoints=8"]
    reference_dir, killed_dir = tmp_path / "reference", tmp_path / "killed"
    subprocess.run(
        _command(reference_dir, *epochs),
        env=_environment(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    process = subprocess.Popen(
        _command(killed_dir, *epochs),
        env=_environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    target = killed_dir / "checkpoints" / "step_00000002"
    deadline = time.monotonic() + 240
    while not target.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL
    interrupted = read_metrics(killed_dir)
    assert len(interrupted) < 8, "the run finished before it could be killed"

    subprocess.run(
        _command(killed_dir, *epochs),
        env=_environment(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    resumed, reference = read_metrics(killed_dir), read_metrics(reference_dir)
    assert [r["step"] for r in resumed] == list(range(8))
    for mine, theirs in zip(resumed, reference, strict=True):
        for key in ("reward/jpeg_incompressibility/mean", "reward/color_match/mean"):
            assert mine[key] == theirs[key] or (mine[key] is None and theirs[key] is None)
        assert [s["weights"] for s in mine["optimizer_steps"]] == [
            s["weights"] for s in theirs["optimizer_steps"]
        ]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.checkpoint_every=0", "run.checkpoint_every"),
        ("run.keep_checkpoints=0", "run.keep_checkpoints"),
        ("train.old_cap=1.0", "train.old_cap"),
        ("train.ema_decay=1.5", "train.ema_decay"),
        ("objective.kl_coefficient=-1", "objective.kl_coefficient"),
        ("objective.eps=0.1", "objective 'nft' does not use .*objective.eps"),
        ("objective.name=nosuch", "unknown objective 'nosuch'"),
        ("strategy.dropout_probability=2", "strategy.dropout_probability"),
        ("strategy.weights=[0, 0]", "strategy.weights"),
        ("rewards=[{name: nosuch}]", "unknown reward"),
        ("reward_modules=[no_such_module]", "cannot import 'no_such_module'"),
        ("rewards=[{name: pickscore, options: {model_dir: /w}}]", "has no option.*model_dir"),
        ("prompts.sources=[{name: a, file: a.txt}]", "prompts.directory"),
        ("train.learning_rate=[1,", "not valid YAML"),
        ("train.lr=1", "unknown key"),
    ],
)
def test_invalid_settings_are_rejected_up_front(override: str, message: str) -> None:
    from mogradient_diffusion.training_config import ConfigError

    with pytest.raises(ConfigError, match=message.replace("[", r"\[")):
        load_config(preset="tiny", overrides=[override])


def test_reward_dropout_is_reproducible(tmp_path: Path) -> None:
    options = ["strategy.name=reward_dropout", "strategy.dropout_probability=0.5"]
    first = read_metrics(_run(tmp_path / "a", *options))
    second = read_metrics(_run(tmp_path / "b", *options))
    assert [s["weights"] for r in first for s in r["optimizer_steps"]] == [
        s["weights"] for r in second for s in r["optimizer_steps"]
    ]


@pytest.mark.parametrize("grouped", [False, True])
def test_group_batches_cut_steps_from_whole_groups(tmp_path: Path, grouped: bool) -> None:
    """With train.group_batches each micro-batch of one group's size holds one group."""
    trainer, batch = _trainer_and_rollout(tmp_path)
    trainer.config.train.group_batches = grouped
    trainer.config.train.batch_size = 4  # the tiny preset's images per prompt
    seen: list[list[int]] = []
    rows: list[float] = []

    class Recording(TrainerCallback):
        def replace_step(self, trainer: Trainer, step: list[TrainPiece], generator) -> dict:
            seen.append(step[0].data.group_ids.tolist())
            rows.extend(step[0].advantages[:, 0].tolist())  # distinct values name the rows
            return {"time/backward": 0.0, "time/harmonize": 0.0, "time/optimizer": 0.0}

    trainer.callbacks = (Recording(),)
    advantages = torch.randn(len(batch), 2, generator=torch.Generator().manual_seed(0))
    mixed = []
    for epoch in range(4):  # several shuffles
        trainer.epoch = epoch
        seen.clear()
        rows.clear()
        trainer._train_on(EpochData(batch, advantages))
        assert sorted(rows) == sorted(advantages[:, 0].tolist())  # every row once
        mixed.append(any(len(set(ids)) > 1 for ids in seen))
    assert not any(mixed) if grouped else any(mixed)


@pytest.mark.slow
def test_gradient_engines_train_the_same_run(tmp_path: Path) -> None:
    """Fixed seed, MARBLE with the conflict probe, one epoch (a solve step, then a cached
    step after one update): the per-row engine and K backward passes give the same
    weights and cosines up to float32 round-off, and each logs its engine; the probe's
    time is its own. The rewards are smooth in the pixels and both have signal at once
    (JPEG sizes and colour thresholds flip on round-off, so later epochs of the preset's
    rewards may differ by more than round-off)."""
    records = {}
    for engine in ("auto", "batched"):
        run = tmp_path / engine
        overrides = [
            f"run.directory={run}",
            "run.quiet=true",
            "train.epochs=1",
            "strategy.period=2",
            "run.conflict_probe=true",
            f"train.gradient_engine={engine}",
            "reward_modules=[diffusion.smooth_rewards]",
            "rewards=[{name: smooth_brightness}, {name: smooth_redness}]",
        ]
        assert main(["train", "--preset", "tiny", *overrides]) == 0
        records[engine] = read_metrics(run)
    steps = {e: [s for r in records[e] for s in r["optimizer_steps"]] for e in records}
    assert {s.get("engine") for s in steps["auto"] if s["solved"]} == {"rows"}
    assert {s.get("engine") for s in steps["batched"] if s["solved"]} == {"batched"}
    assert all(min(s["weights"]) > 0.1 for s in steps["auto"])  # both gradients count
    for ours, theirs in zip(steps["auto"], steps["batched"], strict=True):
        assert ours["solved"] == theirs["solved"]
        torch.testing.assert_close(ours["weights"], theirs["weights"], rtol=1e-4, atol=1e-6)
        for key in ("harmonize/cos_min", "harmonize/cos_mean"):
            if theirs.get(key) is None:  # not measured, or no usable objective
                assert ours.get(key) is None
            else:
                assert ours[key] == pytest.approx(theirs[key], rel=1e-4, abs=1e-6)
    probed = [s for s in steps["auto"] if not s["solved"] and "harmonize/cos_min" in s]
    assert probed and all(s["time/probe"] > 0 for s in probed)
    for ours, theirs in zip(records["auto"], records["batched"], strict=True):
        for key in ours:
            if key.startswith("reward/") and key.endswith("/mean"):  # NaN is logged as null
                assert ours[key] == (
                    None if theirs[key] is None else pytest.approx(theirs[key], rel=1e-4)
                )


@pytest.mark.slow
def test_an_engine_that_disagrees_is_replaced_by_k_backward_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """A model the per-row engine gets wrong (here: its check made to fail) trains on with
    K backward passes from that very step, with a warning, never with the wrong stack."""
    from mogradient.engines import RowGradientError, _checked

    def disagree(*args, **kwargs):
        raise RowGradientError("planted disagreement")

    monkeypatch.setattr(_checked, "check_close", disagree)
    run = tmp_path / "run"
    overrides = [f"run.directory={run}", "run.quiet=true", "train.epochs=1", "strategy.period=1"]
    assert main(["train", "--preset", "tiny", *overrides]) == 0
    assert "planted disagreement" in capsys.readouterr().err
    steps = [s for r in read_metrics(run) for s in r["optimizer_steps"] if s["solved"]]
    assert steps and all(step["engine"] == "batched" for step in steps)


@pytest.mark.slow
def test_an_engine_that_refuses_the_model_is_replaced_by_k_backward_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """The per-row engine refusing a model mid-pass (it would get its rows wrong) does not
    stop the run: the step is replayed with K backward passes, with a warning."""
    from mogradient.engines import RowGradientError, RowGradients

    def refuse(*args, **kwargs):
        raise RowGradientError("planted refusal")

    monkeypatch.setattr(RowGradients, "accumulate", refuse)
    run = tmp_path / "run"
    overrides = [f"run.directory={run}", "run.quiet=true", "train.epochs=1", "strategy.period=1"]
    assert main(["train", "--preset", "tiny", *overrides]) == 0
    assert "refused this model (planted refusal)" in capsys.readouterr().err
    steps = [s for r in read_metrics(run) for s in r["optimizer_steps"] if s["solved"]]
    assert steps and all(step["engine"] == "batched" for step in steps)


def test_model_tf32_sets_torch_float32_matmul_precision(tmp_path) -> None:
    """model.tf32 is the release's allow_tf32: float32 matmul precision "high" (TF32 on
    CUDA), which the per-row engine's tolerance then follows; false leaves it alone."""
    previous = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    torch.set_float32_matmul_precision("highest")
    try:
        for tf32, expected in ((False, "highest"), (True, "high")):
            config = load_config(
                preset="tiny",
                overrides=[f"run.directory={tmp_path / str(tf32)}", f"model.tf32={tf32}"],
            )
            Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
            assert torch.get_float32_matmul_precision() == expected
        assert torch.backends.cudnn.allow_tf32
    finally:
        torch.set_float32_matmul_precision(previous[0])
        torch.backends.cudnn.allow_tf32 = previous[1]
