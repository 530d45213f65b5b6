"""Flow-GRPO and SDPO as objectives of the training loop: the whole step's loss against
the references computed from scratch, config refusals, recipes, every strategy on the
tiny preset, and an SDPO run resumed from a checkpoint."""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.objectives import StepMetrics, TrainPiece
from mogradient_diffusion.objectives.flow_grpo import FlowGRPOObjective, FlowGRPOSettings
from mogradient_diffusion.objectives.sdpo import PairRollout, SDPOObjective, SDPOSettings
from mogradient_diffusion.objectives.step_rollout import StepRollout
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.sampling.rollout import guided_velocity, paired_noise
from mogradient_diffusion.sampling.solver import integrate
from mogradient_diffusion.training_config import ConfigError, load_config

SIGMAS = torch.tensor([1.0, 0.8, 0.55, 0.3, 0.0])  # float32, as the sampler schedules
ETA = 0.7


class LinearPolicy:
    """v = a_adapter * x + c_row * t: a trainable scale for ``default``, fixed ones else."""

    device = torch.device("cpu")

    def __init__(
        self, trained: float, old: float, reference: float, dtype: torch.dtype = torch.float64
    ) -> None:
        self.dtype = dtype
        self.scale = {
            "default": torch.nn.Parameter(torch.tensor(trained, dtype=dtype)),
            "old": torch.tensor(old, dtype=dtype),
            "reference": torch.tensor(reference, dtype=dtype),
        }

    def velocity(self, x, sigma, embeds, adapter="default"):
        context = nullcontext() if adapter == "default" else torch.no_grad()
        with context:
            shift = embeds.pooled[:, :1, None, None].to(x) * sigma.reshape(-1, 1, 1, 1).to(x)
            return self.scale[adapter] * x + shift


def _embeds(rows: int) -> PromptEmbeddings:
    offsets = torch.linspace(-1, 1, rows, dtype=torch.float64)
    return PromptEmbeddings(torch.zeros(rows, 1, 1, dtype=torch.float64), offsets[:, None])


def _step_rollout(policy: LinearPolicy, noise: torch.Tensor, recorded: list[int]) -> StepRollout:
    """A rollout sampled in float32 (the sampler's state), stored in the policy's dtype."""
    rows = len(noise)
    embeds = _embeds(rows)
    velocity = guided_velocity(policy, embeds, None, 1.0, "old")
    generator = torch.Generator().manual_seed(7)
    result = integrate(velocity, noise, SIGMAS, "sde", ETA, generator, recorded_steps=recorded)
    return StepRollout(
        prompts=[f"p{i // 2}" for i in range(rows)],
        group_ids=torch.arange(rows) // 2,
        images=torch.zeros(rows, 3, 2, 2),
        embeds=embeds,
        negative=None,
        latents=result.latents.to(policy.dtype),
        next_latents=result.next_latents.to(policy.dtype),
        log_probs=result.log_probs.to(policy.dtype),
        steps=result.steps,
        sigmas=SIGMAS,
        guidance_scale=1.0,
    )


def _log_prob(scale, x, x_next, t: float, t_next: float, offsets):
    """log N(x_next; mean, std^2) averaged over entries, mean and std from the issue's SDE."""
    sigma_t = ETA * math.sqrt(t / (1 - (float(SIGMAS[1]) if t == 1 else t)))
    dt = t_next - t
    v = scale * x + offsets[:, None, None, None] * t
    mean = x * (1 + sigma_t**2 * dt / (2 * t)) + v * (1 + sigma_t**2 * (1 - t) / (2 * t)) * dt
    density = torch.distributions.Normal(mean, sigma_t * math.sqrt(-dt))
    return density.log_prob(x_next).flatten(1).mean(dim=1), mean, sigma_t


def _pieces(rows: int, cut: int) -> list[torch.Tensor]:
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(cut))
    return [order[:cut], order[cut:]]


def _step_total(losses, weights):
    """sum over pieces of scale * (combined(w) incl. extra), and the per-objective losses."""
    combined, per_objective = 0.0, 0.0
    for scale, loss in losses:
        combined = combined + scale * loss.combined(weights)
        per_objective = per_objective + scale * loss.objective_losses().detach()
    return combined, per_objective


def test_flow_grpo_step_loss_and_gradient_equal_the_reference_from_scratch() -> None:
    policy = LinearPolicy(trained=0.30, old=0.25, reference=0.2)
    noise = torch.randn(8, 2, 3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    batch = _step_rollout(policy, noise, [0, 1, 2])
    offsets = batch.embeds.pooled[:, 0]
    theta = policy.scale["default"]

    def reference(settings: FlowGRPOSettings, advantages: torch.Tensor):
        ratios, kls = [], []
        for column, index in enumerate(batch.steps.tolist()):
            t, t_next = float(SIGMAS[index]), float(SIGMAS[index + 1])
            x, x_next = batch.latents[:, column], batch.next_latents[:, column]
            log_prob, mean, sigma_t = _log_prob(theta, x, x_next, t, t_next, offsets)
            _, mean_ref, _ = _log_prob(policy.scale["reference"], x, x_next, t, t_next, offsets)
            ratios.append(torch.exp(log_prob - batch.log_probs[:, column]))
            kls.append(((mean - mean_ref) ** 2).flatten(1).mean(1) / (2 * sigma_t**2))
        r = torch.stack(ratios, dim=1)  # [B, S]
        eps = settings.clip_range
        losses = []
        for k in range(advantages.shape[1]):
            a = advantages[:, k, None].clamp(-5, 5).expand_as(r)
            valid = ~torch.isnan(a)
            a = torch.where(valid, a, 0.0)  # a NaN factor would leak NaN into the gradient
            per_entry = torch.maximum(-a * r, -a * r.clamp(1 - eps, 1 + eps))
            losses.append(per_entry[valid].mean())
        return torch.stack(losses), settings.kl_coefficient * torch.stack(kls).mean(), r.detach()

    advantages = torch.randn(8, 3, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    advantages[:2, 1] = torch.nan
    advantages[3, 2] = -7.0
    _, _, r = reference(FlowGRPOSettings(), advantages)
    clip = float((r - 1).abs().flatten().quantile(2 / 3))  # a third of the entries clip
    settings = FlowGRPOSettings(clip_range=clip, kl_coefficient=0.3)
    losses, kl, r = reference(settings, advantages)
    assert 0.2 < float(((r - 1).abs() > clip).double().mean()) < 0.45
    weights = torch.tensor([0.7, -1.3, 2.1], dtype=torch.float64)
    per_reward = [torch.autograd.grad(losses[k], theta, retain_graph=True)[0] for k in range(3)]
    expected_grad = sum(w * g for w, g in zip(weights, per_reward, strict=True))
    expected_grad = expected_grad + torch.autograd.grad(kl, theta)[0]

    objective = FlowGRPOObjective(settings)
    for cut in (8, 3):
        rows = _pieces(8, cut) if cut < 8 else [torch.arange(8)]
        step = [TrainPiece(batch.rows(r), advantages[r]) for r in rows]
        combined, per_objective = _step_total(
            objective.losses(policy, step, torch.Generator(), StepMetrics()), weights
        )
        (grad,) = torch.autograd.grad(combined, theta)
        torch.testing.assert_close(per_objective, losses.detach(), rtol=1e-12, atol=1e-12)
        expected = (weights * losses).sum() + kl
        torch.testing.assert_close(combined.detach(), expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


def test_flow_grpo_logs_ratio_one_on_the_first_step_after_a_rollout() -> None:
    policy = LinearPolicy(trained=0.25, old=0.25, reference=0.2, dtype=torch.float32)
    noise = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(0))
    batch = _step_rollout(policy, noise, [0, 1])
    objective = FlowGRPOObjective(FlowGRPOSettings())
    objective._fresh_rollout = True  # as after rollout()
    step = [TrainPiece(batch, torch.ones(4, 1))]
    metrics = StepMetrics()
    for _ in objective.losses(policy, step, torch.Generator(), metrics):
        pass
    summary = metrics.summary()
    assert summary["first_step_max_abs_ratio_minus_one"] == 0.0
    assert summary["ratio_mean"] == 1.0 and summary["clip_fraction_above"] == 0.0
    later = StepMetrics()
    for _ in objective.losses(policy, step, torch.Generator(), later):
        pass
    assert "first_step_max_abs_ratio_minus_one" not in later.summary()


def test_sdpo_step_loss_and_gradient_equal_the_reference_from_scratch() -> None:
    policy = LinearPolicy(trained=0.27, old=0.25, reference=0.2)
    start = torch.randn(4, 2, 3, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    own = _step_rollout(policy, paired_noise(start), [0, 1, 2])
    rows = torch.arange(8)
    batch = PairRollout(
        own=own,
        partner=own.rows(rows ^ 1),
        first_rewards=torch.zeros(8, 2),
        anchor_rewards=torch.zeros(8, 2),
        similarities=torch.zeros(8, 3, 4),
        anchors=torch.ones(8, dtype=torch.long),
        prompt_keys=torch.zeros(8, dtype=torch.long),
    )
    offsets = own.embeds.pooled[:, 0]
    theta = policy.scale["default"]
    differences = torch.randn(8, 3, 2, generator=torch.Generator().manual_seed(3)).double()
    differences[rows ^ 1] = -differences  # dA of (b, a) is minus that of (a, b)
    differences[:2, :, 1] = torch.nan

    def log_ratios() -> torch.Tensor:
        columns = []
        for column, index in enumerate(own.steps.tolist()):
            t, t_next = float(SIGMAS[index]), float(SIGMAS[index + 1])
            x, x_next = own.latents[:, column], own.next_latents[:, column]
            log_prob, _, _ = _log_prob(theta, x, x_next, t, t_next, offsets)
            columns.append(log_prob - own.log_probs[:, column])
        return torch.stack(columns, dim=1)  # rho [B, S]

    rho = log_ratios()
    clip = float(rho.detach().abs().flatten().quantile(2 / 3))
    settings = SDPOSettings(clip_range=clip, step_decay=0.9, log_ratio_scale=0.5)
    weight = 0.9 ** own.steps.double() / 0.5
    u = weight * (rho - rho[rows ^ 1])
    u_clip = weight * (rho.clamp(-clip, clip) - rho[rows ^ 1].clamp(-clip, clip))
    losses = []
    for k in range(2):
        delta = differences[:, :, k]
        valid = ~torch.isnan(delta)
        delta = torch.where(valid, delta, 0.0)
        per_entry = torch.maximum((u - delta) ** 2, (u_clip - delta) ** 2)
        losses.append(per_entry[valid].mean())
    losses = torch.stack(losses)
    weights = torch.tensor([-0.8, 1.9], dtype=torch.float64)
    per_reward = [torch.autograd.grad(losses[k], theta, retain_graph=True)[0] for k in range(2)]
    expected_grad = sum(w * g for w, g in zip(weights, per_reward, strict=True))

    objective = SDPOObjective(settings)
    for cut in (8, 5):
        pieces = _pieces(8, cut) if cut < 8 else [rows]
        step = [TrainPiece(batch.rows(r), differences[r]) for r in pieces]
        combined, per_objective = _step_total(
            objective.losses(policy, step, torch.Generator(), StepMetrics()), weights
        )
        (grad,) = torch.autograd.grad(combined, theta)
        torch.testing.assert_close(per_objective, losses.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-6)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)


STEP_OBJECTIVE = ["rollout.sampler=sde", "train.old_schedule=copy"]


@pytest.mark.parametrize(
    ("objective", "overrides", "message"),
    [
        ("flow_grpo", ["train.old_schedule=copy"], "rollout.sampler: sde"),
        ("flow_grpo", ["rollout.sampler=sde"], "train.old_schedule: copy"),
        ("flow_grpo", [*STEP_OBJECTIVE, "objective.window_size=3"], "objective.window_range"),
        ("flow_grpo", [*STEP_OBJECTIVE, "objective.beta=0.1"], "does not use"),
        (
            "sdpo",
            [*STEP_OBJECTIVE, "rollout.images_per_prompt=3", "rollout.prompts_per_epoch=4"],
            "must be even",
        ),
        ("sdpo", [*STEP_OBJECTIVE, "rollout.steps=2"], "rollout.steps"),
        ("sdpo", [*STEP_OBJECTIVE, "objective.min_count=64"], "min_count"),
    ],
)
def test_configs_the_objectives_cannot_honour_are_refused(objective, overrides, message) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(preset="tiny", overrides=[f"objective.name={objective}", *overrides])


RECIPES = sorted(Path("configs").glob("sd35m_flowgrpo_*.yaml")) + sorted(
    Path("configs").glob("sd35m_sdpo_*.yaml")
)


@pytest.mark.parametrize("recipe", RECIPES, ids=str)
def test_recipes_validate_with_the_references_settings(recipe: Path) -> None:
    config = load_config(recipe, world_size=16)
    rollout, train = config.rollout, config.train
    assert (rollout.steps, rollout.guidance_scale, rollout.images_per_prompt) == (10, 4.5, 24)
    assert rollout.sampler == "sde" and train.old_schedule == "copy"
    settings = config.objective.settings
    if config.objective.name == "flow_grpo":
        assert settings == FlowGRPOSettings(kl_coefficient=0.04)
        assert train.learning_rate == 3e-4
    else:
        assert settings == SDPOSettings()
        assert train.learning_rate == 1e-4
    assert len(RECIPES) == 4


TINY = ["run.quiet=true", "train.epochs=1", *STEP_OBJECTIVE]
STRATEGIES = {
    "marble": ["strategy.name=marble", "strategy.period=1"],
    "weighted_sum": ["strategy.name=weighted_sum", "strategy.period=null"],
    "single": [
        "strategy.name=single",
        "strategy.period=null",
        "strategy.reward=jpeg_incompressibility",
    ],
    "sequential": [
        "strategy.name=sequential",
        "strategy.period=null",
        "strategy.stages=[{rewards: [jpeg_incompressibility], epochs: 1}, "
        "{rewards: [color_match], epochs: 1}]",
    ],
    "reward_dropout": ["strategy.name=reward_dropout", "strategy.period=null"],
    "pcgrad": ["strategy.name=pcgrad"],
    "upgrad": ["strategy.name=upgrad"],
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("objective", ["flow_grpo", "sdpo"])
def test_every_strategy_trains_with_the_objective(tmp_path: Path, objective, strategy) -> None:
    overrides = [f"objective.name={objective}", *STRATEGIES[strategy]]
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", f"run.directory={run}", *TINY, *overrides]) == 0
    (record,) = read_metrics(run)
    steps = record["optimizer_steps"]
    assert steps and all(math.isfinite(w) for s in steps for w in s["weights"])
    assert all(math.isfinite(s["grad_norm"]) for s in steps if "grad_norm" in s)
    trained = [s for s in steps if "objective/ratio_mean" in s]
    assert trained, "no step computed a loss"
    assert trained[0]["objective/first_step_max_abs_ratio_minus_one"] == 0.0
    # Groups whose images all scored alike (no signal); null for an objective no image had.
    ratios = [record[f"advantage/{name}/zero_std_group_ratio"] for name in record["objectives"]]
    assert any(r is not None for r in ratios)
    assert all(0.0 <= r <= 1.0 for r in ratios if r is not None)


def test_sdpo_run_resumes_with_its_tracker(tmp_path: Path) -> None:
    """Two epochs, then a second process resuming to four, equals four in one go; a resume
    that drops the tracker's state does not (the tracker's statistics are used at once)."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "one.txt").write_text("a red cat\n")  # recurs every epoch
    common = [
        "--preset",
        "tiny",
        "run.quiet=true",
        "run.checkpoint_every=1",
        "objective.name=sdpo",
        "objective.buffer_size=16",
        "objective.min_count=2",
        f"prompts.directory={tmp_path / 'prompts'}",
        "prompts.sources=[{name: one, file: one.txt}]",
        *STEP_OBJECTIVE,
    ]

    def train(directory: Path, epochs: int) -> list[dict]:
        args = ["train", *common, f"run.directory={directory}", f"train.epochs={epochs}"]
        assert main(args) == 0
        return read_metrics(directory)

    def trace(records: list[dict]) -> list:
        key = "advantage/jpeg_incompressibility/advantage_abs_mean"
        return [(r[key], [s["weights"] for s in r["optimizer_steps"]]) for r in records]

    straight = trace(train(tmp_path / "straight", 4))
    train(tmp_path / "resumed", 2)
    assert trace(train(tmp_path / "resumed", 4)) == straight

    train(tmp_path / "forgetful", 2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(SDPOObjective, "load_state_dict", lambda self, state: None)
        forgetful = trace(train(tmp_path / "forgetful", 4))
    assert forgetful[:2] == straight[:2] and forgetful[2:] != straight[2:]


def test_flow_grpo_fast_trains_on_a_window(tmp_path: Path) -> None:
    window = ["objective.window_size=2", "objective.window_range=[1, 4]"]
    overrides = ["objective.name=flow_grpo", "strategy.period=1", *window]
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", f"run.directory={run}", *TINY, *overrides]) == 0
    (record,) = read_metrics(run)
    first = record["optimizer_steps"][0]
    assert first["objective/first_step_max_abs_ratio_minus_one"] == 0.0
    assert math.isfinite(first["grad_norm"])
