"""The FLUX.1 family on tiny dev-like (embedded guidance, dynamic shift) and schnell-like
pipelines: detection, sampling and schedules against ``FluxPipeline`` itself, Flow-GRPO's
first ratio, the LoRA round trip, and every objective training through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from tolerances import chain_atol

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.families import FAMILIES, detect_family
from mogradient_diffusion.model.families.base import UnsupportedGuidance
from mogradient_diffusion.model.families.flux import Flux
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.model.tiny_flux import TinyFluxSpec, save_tiny_flux_pipeline
from mogradient_diffusion.rewards.base import to_uint8_images
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.sampling.rollout import RolloutBatch, guided_velocity, rollout
from mogradient_diffusion.sampling.solver import integrate

from .rollouts import rescored_log_prob

PROMPTS = ["a red cat", 'a sign saying "hello"']
MAX_TOKENS = 32
SIZE = 64
SPEC = LoraSpec(rank=4, alpha=8)
VARIANTS = ("dev", "schnell")


@pytest.fixture(scope="module")
def flux_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Saved tiny pipelines: ``dev`` with a guidance embedding, ``schnell`` without."""
    return {
        name: save_tiny_flux_pipeline(
            tmp_path_factory.mktemp(f"tiny_flux_{name}"),
            TinyFluxSpec(guidance_embeds=name == "dev"),
        )
        for name in VARIANTS
    }


def _pipeline(path: Path, **kwargs):
    from diffusers import FluxPipeline

    pipeline = FluxPipeline.from_pretrained(path, **kwargs)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def _noise(policy: Policy, count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, *policy.latent_shape(SIZE), generator=generator)


def _packed(latents: torch.Tensor) -> torch.Tensor:
    from diffusers import FluxPipeline

    return FluxPipeline._pack_latents(latents, *latents.shape)


def _pipeline_latents(pipeline, noise: torch.Tensor, steps: int, **options) -> torch.Tensor:
    """FluxPipeline's final latents, unpacked, from the same initial noise."""
    from diffusers import FluxPipeline

    packed = pipeline(
        prompt=PROMPTS,
        num_images_per_prompt=len(noise) // len(PROMPTS),
        num_inference_steps=steps,
        height=SIZE,
        width=SIZE,
        latents=_packed(noise),
        max_sequence_length=MAX_TOKENS,
        output_type="latent",
        **options,
    ).images
    return FluxPipeline._unpack_latents(packed, SIZE, SIZE, pipeline.vae_scale_factor)


def _rollout(policy: Policy, noise: torch.Tensor, steps: int, **kwargs) -> RolloutBatch:
    return rollout(
        policy,
        PROMPTS,
        len(noise) // len(PROMPTS),
        steps,
        resolution=SIZE,
        max_sequence_length=MAX_TOKENS,
        noise=noise,
        **kwargs,
    )


def _randomize(policy: Policy, adapter: str, seed: int) -> None:
    """Random LoRA weights, lora_B included, so that the adapter changes the model."""
    generator = torch.Generator().manual_seed(seed)
    state = policy.lora_state(adapter)
    policy.load_lora_state(
        adapter, {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    )


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_saved_flux_pipeline_is_detected_and_loads(flux_dirs, variant: str) -> None:
    assert detect_family(flux_dirs[variant]) is FAMILIES["flux"]
    policy = Policy.load(flux_dirs[variant], SPEC)
    assert policy.family is FAMILIES["flux"]
    assert policy.latent_shape(SIZE) == (4, 8, 8)  # 16 packed channels / 4, 64 px / 8
    images = policy.decode(_noise(policy, 2))
    assert images.shape == (2, 3, SIZE, SIZE) and 0 <= images.min() <= images.max() <= 1
    with pytest.raises(ValueError, match="multiple of 16"):
        policy.latent_shape(40)  # the VAE tiles 8 px, the 2x2 packing 16


def test_the_default_lora_spec_takes_the_flux_targets(flux_dirs) -> None:
    """A spec without targets gets Flow-GRPO's FLUX list, MLPs included, not SD3's
    attention-only one: 12 modules in the dual block, q/k/v in the single block."""
    policy = Policy.load(flux_dirs["dev"], LoraSpec(rank=4, alpha=8))
    assert policy.lora.target_modules == Flux.lora_targets
    adapted = {name.rsplit(".lora_", 1)[0] for name in policy.lora_state("default")}
    assert len(adapted) == 12 + 3
    assert {
        "transformer_blocks.0.ff.net.2",
        "transformer_blocks.0.ff_context.net.0.proj",
    } <= adapted
    single = {name for name in adapted if name.startswith("single_transformer_blocks.0.")}
    assert single == {f"single_transformer_blocks.0.attn.to_{x}" for x in "qkv"}


def test_embedded_guidance_is_refused_where_the_model_has_none(flux_dirs) -> None:
    with pytest.raises(UnsupportedGuidance, match="no guidance embedding"):
        Policy.load(flux_dirs["schnell"], SPEC, guidance=3.5)
    assert Policy.load(flux_dirs["dev"], SPEC, guidance=5.0).guidance == 5.0


@pytest.mark.parametrize(
    ("variant", "guidance", "cfg"),
    [("dev", None, 1.0), ("dev", 5.0, 1.0), ("schnell", None, 1.0), ("schnell", None, 3.0)],
    ids=["dev-default-guidance", "dev-guidance-5", "schnell", "schnell-true-cfg-3"],
)
def test_euler_rollout_matches_the_flux_pipeline(flux_dirs, variant, guidance, cfg) -> None:
    """The base model (adapter "reference") sampled by our Euler sampler and by
    ``FluxPipeline``: the same schedule exactly, the same latents and images up to
    rounding. dev runs at the pipeline's default guidance 3.5 unless the policy sets one;
    classifier-free guidance is the pipeline's true CFG against the empty prompt."""
    policy = Policy.load(flux_dirs[variant], SPEC, guidance=guidance)
    pipeline = _pipeline(flux_dirs[variant])
    noise = _noise(policy, 4)
    batch = _rollout(policy, noise, 4, adapter="reference", guidance_scale=cfg)
    options = {"guidance_scale": 3.5 if guidance is None else guidance}
    if cfg != 1.0:
        options.update(true_cfg_scale=cfg, negative_prompt=[""] * len(PROMPTS))
    latents = _pipeline_latents(pipeline, noise, 4, **options)
    assert torch.equal(batch.sigmas, pipeline.scheduler.sigmas)
    # The pipeline feeds the transformer (1000 sigma) / 1000, which may round sigma by an
    # ulp, and runs CFG's halves as two forwards where we batch them. Each of the 4 steps
    # may then round differently at each of ~10 layers (2 blocks, embeddings, norms):
    # 4 * 10 ulps of the latents' scale, doubled for the two paths. (Equal bit for bit
    # on the CPUs tried.)
    atol = chain_atol(torch.float32, latents.abs().max(), ulps=2 * 4 * 10)
    torch.testing.assert_close(batch.latents, latents, rtol=0, atol=atol)
    images = pipeline(
        prompt=PROMPTS,
        num_images_per_prompt=2,
        num_inference_steps=4,
        height=SIZE,
        width=SIZE,
        latents=_packed(noise),
        max_sequence_length=MAX_TOKENS,
        output_type="pt",
        **options,
    ).images
    # The decoder's convolutions and group norms over the [0, 1] range: 128 ulps, as for SD3.
    torch.testing.assert_close(
        batch.images, images, rtol=0, atol=atol + chain_atol(torch.float32, 1.0, 128)
    )


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(("steps", "size"), [(1, 64), (4, 64), (28, 128)])
def test_sigmas_are_the_pipelines_own(flux_dirs, variant: str, steps: int, size: int) -> None:
    """The schedule FluxPipeline samples (its scheduler after ``retrieve_timesteps`` with
    the mu of its image tokens), read off the pipeline after a call."""
    policy = Policy.load(flux_dirs[variant], SPEC)
    pipeline = _pipeline(flux_dirs[variant])
    pipeline(
        prompt=PROMPTS[:1],
        num_inference_steps=steps,
        height=size,
        width=size,
        max_sequence_length=MAX_TOKENS,
        output_type="latent",
    )
    sigmas = policy.sigmas(steps, size)
    assert sigmas.shape == (steps + 1,) and sigmas[0] == 1 and sigmas[-1] == 0
    assert torch.equal(sigmas, pipeline.scheduler.sigmas)
    if steps > 1:  # any shift keeps sigma 1; schnell has none, dev's follows the tokens
        linear = torch.linspace(1, 1 / steps, steps)
        assert torch.allclose(sigmas[:-1], linear) == (variant == "schnell")


def test_a_shift_applies_to_schnell_and_is_refused_for_dev(flux_dirs) -> None:
    from diffusers import FlowMatchEulerDiscreteScheduler

    with pytest.raises(ValueError, match="does not apply to this FLUX model"):
        Policy.load(flux_dirs["dev"], SPEC).sigmas(4, SIZE, shift=3.0)
    pipeline = _pipeline(flux_dirs["schnell"])
    pipeline.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
        pipeline.scheduler.config, shift=3.0
    )
    pipeline(
        prompt=PROMPTS[:1],
        num_inference_steps=4,
        height=SIZE,
        width=SIZE,
        max_sequence_length=MAX_TOKENS,
        output_type="latent",
    )
    sigmas = Policy.load(flux_dirs["schnell"], SPEC).sigmas(4, SIZE, shift=3.0)
    assert torch.equal(sigmas, pipeline.scheduler.sigmas)


@pytest.mark.parametrize(("variant", "cfg"), [("dev", 1.0), ("schnell", 3.0)])
def test_flow_grpo_ratio_is_exactly_one_before_an_update(flux_dirs, variant, cfg) -> None:
    """Rescoring each recorded SDE step with the trained adapter (grad on, CFG's uncond
    branch detached) gives the rollout's log p_old bit for bit; after an update it moves."""
    policy = Policy.load(flux_dirs[variant], SPEC)
    _randomize(policy, "default", 1)
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS).repeat_interleave(2)
    negative = None if cfg == 1.0 else policy.encode_prompts([""], MAX_TOKENS).repeat_interleave(4)
    sigmas = policy.sigmas(6, SIZE)
    sampler = guided_velocity(policy, embeds, negative, cfg, "default")
    result = integrate(
        sampler,
        _noise(policy, 4),
        sigmas,
        "sde",
        0.9,
        torch.Generator().manual_seed(1),
        recorded_steps=range(5),
    )
    velocity = guided_velocity(policy, embeds, negative, cfg, "default", detach_uncond=True)

    def ratio(step: int) -> torch.Tensor:
        log_prob = rescored_log_prob(result, velocity, sigmas, step, 0.9)
        return torch.exp(log_prob - result.log_probs[:, step]).detach()

    for step in range(5):
        assert torch.equal(ratio(step), torch.ones(4)), f"step {step}"
    _randomize(policy, "default", 2)
    assert (ratio(0) - 1).abs().max() > 1e-4


def test_save_lora_loads_into_a_fresh_flux_pipeline(flux_dirs, tmp_path: Path) -> None:
    """Flow-GRPO's FLUX targets (attention and feed-forwards of the dual blocks, q/k/v of
    the single ones) saved by the policy and loaded by ``load_lora_weights``: the fresh
    pipeline samples what the policy's ``default`` adapter samples."""
    policy = Policy.load(
        flux_dirs["dev"], LoraSpec(rank=4, alpha=8, target_modules=Flux.lora_targets)
    )
    _randomize(policy, "default", 3)
    noise = _noise(policy, 4)
    ours = _rollout(policy, noise, 2, adapter="default").latents
    policy.save_lora(tmp_path / "lora")
    with safe_open(tmp_path / "lora" / "pytorch_lora_weights.safetensors", "pt") as weights:
        modules = {key.rsplit(".lora_", 1)[0] for key in weights.keys()}  # noqa: SIM118
    assert len(modules) == 12 + 3  # one dual block, one single block
    assert "transformer.single_transformer_blocks.0.attn.to_q" in modules
    fresh = _pipeline(flux_dirs["dev"])
    base = _pipeline_latents(fresh, noise, 2)
    fresh.load_lora_weights(tmp_path / "lora")
    loaded = _pipeline_latents(fresh, noise, 2)
    # Two steps through ~10 layers, two paths (see the rollout test).
    atol = chain_atol(torch.float32, loaded.abs().max(), ulps=2 * 2 * 10)
    torch.testing.assert_close(ours, loaded, rtol=0, atol=atol)
    assert (ours - base).abs().max() > 1e3 * atol  # the LoRA is no no-op


TRAIN = [
    "run.quiet=true",
    "train.epochs=1",
    "rollout.steps=3",  # SDPO anchors its rewards at an interior step
    "rollout.prompts_per_epoch=1",
    # Smooth in the pixels, so both objectives have signal in the one group.
    "reward_modules=[diffusion.smooth_rewards]",
    "rewards=[{name: smooth_brightness}, {name: smooth_redness}]",
]
STEP_OBJECTIVE = ["rollout.sampler=sde", "train.old_schedule=copy"]
OBJECTIVES = {"nft": [], "flow_grpo": STEP_OBJECTIVE, "sdpo": STEP_OBJECTIVE}
STRATEGIES = {
    "marble": ["strategy.name=marble", "strategy.period=1"],
    "weighted_sum": ["strategy.name=weighted_sum", "strategy.period=null"],
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_trains_on_flux(flux_dirs, tmp_path, objective, strategy) -> None:
    """One epoch of one prompt group on tiny FLUX.1-dev through the CLI; MARBLE's
    per-objective gradients come from the per-row engine (``train.gradient_engine: auto``),
    checked once against K backward passes."""
    run = tmp_path / "run"
    overrides = [
        f"model.path={flux_dirs['dev']}",
        f"run.directory={run}",
        f"objective.name={objective}",
        *TRAIN,
        *OBJECTIVES[objective],
        *STRATEGIES[strategy],
    ]
    assert main(["train", "--preset", "tiny", *overrides]) == 0
    (record,) = read_metrics(run)
    steps = record["optimizer_steps"]
    assert steps and all(math.isfinite(w) for s in steps for w in s["weights"])
    trained = [s for s in steps if s.get("skipped") != "no reward signal"]
    assert trained and all(math.isfinite(s["grad_norm"]) for s in trained)
    if objective == "flow_grpo":
        assert trained[0]["objective/first_step_max_abs_ratio_minus_one"] == 0.0
    if strategy == "marble":
        solved = [s for s in steps if s["solved"]]
        assert solved and all(s["fallback"] is None for s in solved)  # two objectives
        assert {s["engine"] for s in solved} == {"rows"}  # and it agreed with K backwards
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_schnell_trains_with_classifier_free_guidance(flux_dirs, tmp_path) -> None:
    run = tmp_path / "run"
    overrides = [
        f"model.path={flux_dirs['schnell']}",
        f"run.directory={run}",
        "objective.name=flow_grpo",
        "rollout.guidance_scale=3.0",
        *TRAIN,
        *STEP_OBJECTIVE,
        *STRATEGIES["marble"],
    ]
    assert main(["train", "--preset", "tiny", *overrides]) == 0
    (record,) = read_metrics(run)
    trained = [s for s in record["optimizer_steps"] if s.get("skipped") != "no reward signal"]
    assert trained and trained[0]["objective/first_step_max_abs_ratio_minus_one"] == 0.0


def _eval(out: Path, *args: str) -> dict:
    """``eval`` with one offline metric; its summary."""
    metrics = ["--metrics", "jpeg_incompressibility", "--quiet", "--device", "cpu"]
    assert main(["eval", "--out", str(out), *metrics, *args]) == 0
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize(
    ("variant", "guidance", "cfg"), [("dev", 5.0, 1.0), ("dev", None, 2.0), ("schnell", None, 3.0)]
)
def test_eval_samples_as_the_rollout(flux_dirs, tmp_path, variant, guidance, cfg) -> None:
    """``eval`` samples with FluxPipeline itself, guided as the family guides rollouts
    (embedded guidance, and true CFG against the empty prompt): its images are ours."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    settings = ["--steps", "3", "--resolution", str(SIZE), "--max-sequence-length", "32"]
    settings += ["--guidance-scale", str(cfg)]
    settings += [] if guidance is None else ["--guidance", str(guidance)]
    model = flux_dirs[variant]
    summary = _eval(tmp_path / "eval", "--model", str(model), "--prompts", str(prompts), *settings)
    assert summary["settings"]["guidance"] == guidance
    policy = Policy.load(model, SPEC, guidance=guidance)
    # eval seeds image i with seed + i; the pipeline draws each image's noise unpacked.
    seeded = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    noise = torch.cat([torch.randn(1, *policy.latent_shape(SIZE), generator=g) for g in seeded])
    batch = _rollout(policy, noise, 3, adapter="reference", guidance_scale=cfg)
    for index, ours in enumerate(to_uint8_images(batch.images).astype(int)):
        theirs = np.asarray(Image.open(tmp_path / f"eval/images/{index:05d}.png"), dtype=int)
        assert np.abs(ours - theirs).max() <= 1  # values a rounding apart may round apart


def test_eval_of_a_run_takes_its_embedded_guidance(flux_dirs, tmp_path) -> None:
    run = tmp_path / "run"
    overrides = [f"model.path={flux_dirs['dev']}", f"run.directory={run}", "model.guidance=5.0"]
    assert main(["train", "--preset", "tiny", *overrides, *TRAIN]) == 0
    summary = _eval(tmp_path / "eval", "--lora", str(run / "lora"), "--prompts", "general",
                    "--max-prompts", "1")  # fmt: skip
    assert summary["settings"]["guidance"] == 5.0
