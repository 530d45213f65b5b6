"""configs/sd35m_marble_5r.yaml holds the numbers of MARBLE's release recipe
``sd3_multi_reward_pareto_5r_alpha_ema`` (aim-uofa/MARBLE @1bf9543); its LoRA targets skip
SD3.5's second attention as peft's suffix matching does there; the dpm2 sampler is the
release's multistep DPM-Solver++(2M).

Citations without a repository are the release's files (config/nft.py, config/base.py,
train.py); the sampler's is DiffusionNFT's ``flow_grpo/diffusers_patch/solver.py``
(NVlabs/DiffusionNFT @24af555), which MARBLE builds on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mogradient_diffusion.model.families.sd3 import SD3
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.model.schedules import sampler_sigmas
from mogradient_diffusion.sampling.solver import integrate
from mogradient_diffusion.training_config import TrainingConfig, load_config

RECIPE = Path(__file__).resolve().parents[2] / "configs" / "sd35m_marble_5r.yaml"
GPUS = 16  # scripts/train.sh: 2 nodes x 8 (the recipe's docstring, nft.py:21)
# train.py:695-704: the release's target_modules list.
RELEASE_TARGETS = {
    "attn.add_k_proj",
    "attn.add_q_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
    "attn.to_k",
    "attn.to_out.0",
    "attn.to_q",
    "attn.to_v",
}


@pytest.fixture(scope="module")
def recipe() -> TrainingConfig:
    return load_config(RECIPE, world_size=GPUS)


def test_the_recipe_holds_the_release_numbers(recipe: TrainingConfig) -> None:
    rollout, train, lora = recipe.rollout, recipe.train, recipe.lora
    marble = recipe.strategy.settings
    nft = recipe.objective.settings
    assert recipe.model.family in ("auto", "sd3")  # SD3.5-Medium (nft.py:25)
    assert recipe.model.tf32 is True  # allow_tf32 (base.py:25; train.py:722-724)
    assert rollout.resolution == 512  # nft.py:26
    assert rollout.sampler == "dpm2"  # solver "dpm2", deterministic=True (nft.py:32-33)
    assert rollout.steps == 25  # sample.num_steps (nft.py:28)
    assert rollout.guidance_scale == 1.0  # nft.py:30
    assert rollout.max_sequence_length == 128  # train.py:437, 466, 806, 1066
    assert rollout.images_per_prompt == 24  # nft.py:35
    assert rollout.batch_size == 9  # sample.train_batch_size, per GPU (nft.py:36)
    # 48 prompts x 24 images = 16 GPUs x 9 images x 8 batches (nft.py:34-37).
    assert rollout.prompts_per_epoch * rollout.images_per_prompt == GPUS * 9 * 8
    assert train.batch_size == 9  # nft.py:39
    assert train.gradient_accumulation == 8  # nft.py:40: one optimizer step per epoch
    assert train.timestep_fraction == 0.99  # base.py:89; int(25 x 0.99) = 24 (train.py:1028)
    assert int(rollout.steps * train.timestep_fraction) == 24
    assert train.learning_rate == 3e-4  # base.py:68
    assert tuple(train.adam_betas) == (0.9, 0.999)  # base.py:70, 72
    assert train.weight_decay == 1e-4  # base.py:74
    assert train.grad_clip == 1.0  # base.py:81
    assert train.ema_decay == 0.9  # parameter EMA on, decay 0.9 (base.py:94-95)
    # Old adapter: min(0.001 x step, 0.95) (decay_type 1, nft.py:54; train.py:380-383).
    assert (train.old_schedule, train.old_cap) == ("linear", 0.95)
    assert (lora.rank, lora.alpha, lora.init) == (32, 64.0, "gaussian")  # train.py:705-707
    assert lora.dropout == 0.0  # not given: peft's default (train.py:705-707)
    assert set(lora.target_modules) == RELEASE_TARGETS  # train.py:695-704
    assert len(lora.target_modules) == len(RELEASE_TARGETS)
    assert recipe.objective.name == "nft"
    assert nft.beta == 0.1  # config.beta (nft.py:53)
    assert nft.kl_coefficient == 1e-4  # train.beta (nft.py:41)
    assert nft.a_max == 5.0  # adv_clip_max (base.py:86)
    assert nft.form == "x0_adaptive"  # train.py:318-341
    assert nft.adaptive_weight_floor == 1e-5  # .clip(min=0.00001) (train.py:326, 335)
    assert nft.advantage_std == "global"  # sample.global_std (base.py:59)
    assert recipe.strategy.name == "marble"  # pareto.enabled, method "mgda" (nft.py:55-56)
    assert marble.period == 10  # amortize_every_n (nft.py:61)
    assert marble.warmup_steps == 1  # amortize_warmup (nft.py:62)
    assert marble.rho == 0.7  # alpha_ema_decay (nft.py:63)
    assert marble.normalize is True  # normalize_grads (nft.py:57)
    assert marble.solve_scope == "micro_step"  # the cache per micro-step (train.py:1481-1493)
    # The solve micro-step applies the fresh direction, not the EMA (train.py:1729).
    assert not marble.smooth_solve_steps
    assert not marble.fixed_alpha  # equal_alpha is the ablation (nft.py:71-76)
    # reward_fn: five rewards, weight 1.0 each (nft.py:46-52); hpsv2 is HPS v2.1 here.
    rewards = [reward.name for reward in recipe.rewards]
    assert rewards == ["pickscore", "hpsv21", "clipscore", "ocr", "geneval"]
    # prompt_fn "mixed", stratified by source with equal shares (nft.py:44-45).
    assert [s.name for s in recipe.prompts.sources] == ["pickscore", "ocr", "geneval"]
    assert {s.weight for s in recipe.prompts.sources} == {1.0}


def test_release_targets_are_the_baselines_targets_too() -> None:
    """Every SD3.5-M recipe trains the same modules: the NFT baselines inherit the base,
    and DiffusionNFT and Flow-GRPO adapt the same eight ``attn.*`` names."""
    for path in sorted(RECIPE.parent.glob("sd35m_*.yaml")):
        world_size = 1 if "base" in path.name else GPUS
        config = load_config(path, world_size=world_size)
        assert set(config.lora.target_modules) == RELEASE_TARGETS, path.name
        assert config.rollout.max_sequence_length == 128, path.name
        if config.objective.name == "nft":
            assert (config.rollout.sampler, config.rollout.steps) == ("dpm2", 25), path.name


@pytest.mark.parametrize(
    ("name", "adapted"),
    [
        ("transformer_blocks.0.attn.to_q", True),
        ("transformer_blocks.0.attn.to_out.0", True),
        ("transformer_blocks.0.attn.to_add_out", True),
        ("transformer_blocks.0.attn2.to_q", False),
        ("transformer_blocks.0.attn2.to_out.0", False),
        ("transformer_blocks.0.attn.to_out.1", False),  # the dropout after to_out.0
        ("transformer_blocks.0.ff.net.2", False),
    ],
)
def test_peft_matches_the_release_targets_by_dotted_suffix(name: str, adapted: bool) -> None:
    """peft adapts a module whose name equals a target or ends with "." + target."""
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraSpec(target_modules=tuple(sorted(RELEASE_TARGETS))).peft_config()
    assert bool(check_target_module_exists(config, name)) is adapted
    by_rule = any(name == t or name.endswith("." + t) for t in RELEASE_TARGETS)
    assert by_rule is adapted


def test_release_targets_adapt_attn_but_not_attn2_of_the_tiny_model(
    tiny_pipeline_dir: Path, recipe: TrainingConfig
) -> None:
    """The tiny SD3 transformer has a dual-attention block 0 (``attn`` and ``attn2``), as
    SD3.5-Medium's first 13 blocks: the release's names adapt the first attention only,
    where the family's bare names adapt both."""
    spec = LoraSpec(rank=4, alpha=8, target_modules=recipe.lora.target_modules)
    policy = Policy.load(tiny_pipeline_dir, spec)
    modules = dict(policy.transformer.named_modules())
    assert "transformer_blocks.0.attn2.to_q" in modules  # the dual-attention block
    adapted = {name.rsplit(".lora_", 1)[0] for name in policy.lora_state("default")}
    assert not any(".attn2." in name for name in adapted)
    blocks = {name.split(".attn.")[0] for name in modules if ".attn.to_q" in name}
    # Every block's joint-attention projections (the last block has no context outputs).
    for block in blocks:
        for target in ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj"):
            assert f"{block}.attn.{target}" in adapted, (block, target)
    # Exactly the modules the suffix rule names, no more, no fewer.
    expected = {n for n in modules if any(n == t or n.endswith("." + t) for t in RELEASE_TARGETS)}
    assert adapted == expected
    # The family's default (bare names) does reach attn2: the difference the recipe removes.
    bare = Policy.load(tiny_pipeline_dir, LoraSpec(rank=4, alpha=8))
    assert bare.lora.target_modules == SD3.lora_targets
    assert any(".attn2." in name for name in bare.lora_state("default"))


# ------------------------------------------------------------------- the dpm2 sampler
def _velocity(x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """A velocity field nonlinear in x and sigma (any field: both solvers see the same)."""
    s = sigma.to(x.dtype)[:, None]
    return torch.sin(3 * x) * (1 - s) + x * (1 + s**2) - 0.5


def _dpm_solver_pp_2m(x: torch.Tensor, sigmas: torch.Tensor, first_order: set[int]) -> torch.Tensor:
    """DPM-Solver++(2M) in data prediction, written from its definition, in float64:
    alpha = 1 - sigma, lambda = log(alpha / sigma), h = lambda_t - lambda_s, D0 = this
    step's x0, D1 = (h / h_prev) (D0 - previous x0) (0 on the ``first_order`` steps),
    x_t = (sigma_t / sigma_s) x - alpha_t (exp(-h) - 1) (D0 + D1 / 2)."""
    levels = sigmas.double()
    lam = torch.log((1 - levels) / levels)  # -inf at sigma 1, +inf at sigma 0
    x = x.double()
    previous = None
    for i in range(len(levels) - 1):
        s, t = levels[i], levels[i + 1]
        x0 = x - s * _velocity(x, s.expand(len(x)))
        h = lam[i + 1] - lam[i]
        d = x0
        if i not in first_order:
            d = x0 + 0.5 * (h / (lam[i] - lam[i - 1])) * (x0 - previous)
        x = (t / s) * x - (1 - t) * (torch.exp(-h) - 1) * d
        previous = x0
    return x


def _schedule(case: str) -> torch.Tensor:
    if case == "ends above 0":  # a schedule whose last level is not 0
        return sampler_sigmas(8)[:-1]
    return sampler_sigmas(int(case))


@pytest.mark.parametrize("case", ["25", "10", "3", "ends above 0"])
def test_dpm2_is_the_release_solver(case: str) -> None:
    """First order at step 0 and at the last step only (solver.py ``dpm_step``: its
    ``lower_order_second`` for fewer than 15 steps picks order 2 over 3, so it does not
    make the second-to-last step first order)."""
    sigmas = _schedule(case)
    steps = len(sigmas) - 1
    x1 = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    ours = integrate(_velocity, x1, sigmas, "dpm2").final
    release = _dpm_solver_pp_2m(x1, sigmas, first_order={0, steps - 1})
    assert torch.allclose(ours.double(), release, rtol=1e-5, atol=1e-5)
    # A first-order second-to-last step would be another solver (at 3 steps that step
    # follows sigma = 1, where the correction is 0 anyway).
    if steps >= 4:
        other = _dpm_solver_pp_2m(x1, sigmas, first_order={0, steps - 2, steps - 1})
        assert (other - release).abs().max() > 100 * (ours.double() - release).abs().max()
