"""Qwen-Image on a tiny pipeline: detection, sampling and schedules equal to diffusers'
QwenImagePipeline, Flow-GRPO's ratio, the LoRA file round trip, and training runs of
every objective with representative strategies and both gradient engines."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from tolerances import chain_atol

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.families import FAMILIES, detect_family, family_of_pipeline_class
from mogradient_diffusion.model.families.qwen_image import QwenImage
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.model.tiny_qwen_image import save_tiny_qwen_image_pipeline
from mogradient_diffusion.runs.metrics_log import read_metrics
from mogradient_diffusion.sampling.rollout import guided_velocity, rollout
from mogradient_diffusion.sampling.solver import integrate

from .rollouts import rescored_log_prob

PROMPTS = ["a red cat", "a dog on a big table"]
MAX_TOKENS = 32
RESOLUTION = 64
# The reference trainers' CFG for Qwen-Image (Flow-GRPO, VeRL-Omni: true_cfg_scale 4).
GUIDANCE = 4.0


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_qwen_image_pipeline(tmp_path_factory.mktemp("tiny_qwen_image"))


@pytest.fixture(scope="module")
def pipeline(tiny_dir: Path):
    from diffusers import QwenImagePipeline

    pipeline = QwenImagePipeline.from_pretrained(tiny_dir)
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


@pytest.fixture
def policy(tiny_dir: Path) -> Policy:
    return Policy.load(tiny_dir, LoraSpec(rank=4, alpha=8, target_modules=QwenImage.lora_targets))


def _perturb(policy: Policy, *adapters: str, seed: int = 0) -> None:
    """The same random LoRA weights in ``adapters`` (B starts at zero: the base model)."""
    generator = torch.Generator().manual_seed(seed)
    state = policy.lora_state("default")
    perturbed = {k: 0.3 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    for adapter in adapters:
        policy.load_lora_state(adapter, perturbed)


def _transformer_velocity(transformer, latents, sigmas, embeds) -> torch.Tensor:
    """The transformer called as QwenImagePipeline.__call__ calls it, on packed latents."""
    from diffusers import QwenImagePipeline

    batch, channels, height, width = latents.shape
    packed = QwenImagePipeline._pack_latents(latents, batch, channels, height, width)
    mask = None if embeds.mask.all() else embeds.mask
    with torch.no_grad():
        out = transformer(
            hidden_states=packed,
            timestep=sigmas,
            encoder_hidden_states=embeds.prompt_embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, height // 2, width // 2)]] * batch,
            return_dict=False,
        )[0]
    return QwenImagePipeline._unpack_latents(out, height, width, 1)[:, :, 0]


def test_the_tiny_pipeline_is_detected_and_loads(tiny_dir: Path, pipeline) -> None:
    assert detect_family(tiny_dir) is FAMILIES["qwen_image"]
    assert family_of_pipeline_class("QwenImagePipeline") is FAMILIES["qwen_image"]
    policy = Policy.load(tiny_dir, LoraSpec(rank=2, alpha=2.0))
    assert policy.family is FAMILIES["qwen_image"]
    assert policy.latent_shape(RESOLUTION) == (4, 8, 8)
    with pytest.raises(ValueError, match="multiple of 16"):
        policy.latent_shape(72)
    # The template's system prefix is the 34 tokens the pipeline drops, as with Qwen's own
    # tokenizer: the embeddings start at the prompt, and prompts of other lengths are masked.
    prefix = pipeline.prompt_template_encode.split("{}")[0]
    assert len(pipeline.tokenizer(prefix).input_ids) == pipeline.prompt_template_encode_start_idx
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS)
    assert embeds.pooled is None
    assert embeds.mask.sum(dim=1).tolist() == [8, 11]  # a token a word, 5 closing ones
    with pytest.raises(ValueError, match="qwen_image models have no embedded guidance"):
        Policy.load(tiny_dir, LoraSpec(rank=2, alpha=2.0), guidance=3.5)


def test_the_default_lora_spec_takes_the_qwen_image_targets(tiny_dir: Path) -> None:
    """A spec without targets gets the reference trainers' Qwen-Image list (attention and
    both streams' MLPs): 12 modules a block, less the last block's 3 discarded text outputs."""
    policy = Policy.load(tiny_dir, LoraSpec(rank=2, alpha=2.0))
    assert policy.lora.target_modules == QwenImage.lora_targets
    adapted = {name.rsplit(".lora_", 1)[0] for name in policy.lora_state("default")}
    blocks = len(policy.transformer.transformer_blocks)
    assert blocks == 2 and len(adapted) == 12 * blocks - 3
    assert {"transformer_blocks.0.img_mlp.net.2", "transformer_blocks.0.txt_mlp.net.2"} <= adapted


@pytest.mark.parametrize("guidance", [1.0, GUIDANCE], ids=["no_cfg", "true_cfg"])
def test_sampling_matches_the_diffusers_pipeline(policy: Policy, pipeline, guidance) -> None:
    """The ODE rollout of the base model (adapter "reference") from the same noise gives
    QwenImagePipeline's latents, its sigmas, and with its latents its images."""
    steps, per_prompt = 4, 2
    shape = (len(PROMPTS) * per_prompt, *policy.latent_shape(RESOLUTION))
    noise = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = rollout(
        policy,
        PROMPTS,
        per_prompt,
        steps,
        resolution=RESOLUTION,
        guidance_scale=guidance,
        sampler="euler",
        adapter="reference",
        noise=noise,
        max_sequence_length=MAX_TOKENS,
    )
    # Each prompt repeated rather than num_images_per_prompt: diffusers 0.42.1 repeats the
    # text mask in another row order than the embeddings (huggingface/diffusers#14147).
    repeated = [prompt for prompt in PROMPTS for _ in range(per_prompt)]
    negative = {"negative_prompt": [" "] * len(repeated)} if guidance != 1 else {}
    call = {
        "prompt": repeated,
        "height": RESOLUTION,
        "width": RESOLUTION,
        "num_inference_steps": steps,
        "true_cfg_scale": guidance,
        "latents": pipeline._pack_latents(noise, *shape),
        "max_sequence_length": MAX_TOKENS,
        **negative,
    }
    packed = pipeline(**call, output_type="latent").images
    theirs = pipeline._unpack_latents(packed, RESOLUTION, RESOLUTION, pipeline.vae_scale_factor)
    theirs = theirs[:, :, 0]
    assert torch.equal(ours.sigmas, pipeline.scheduler.sigmas)
    # Rounding only: CFG's two halves go through one batched forward, the negative's text
    # padded and masked, where the pipeline makes two calls; kernels chosen by batch size
    # and masked terms in attention's sums round differently. Budget 16 ulps of |x| per
    # evaluation (as the chunked rollout test), once per step, times CFG's gain on a
    # difference (|1 - w| + |w| = 2w - 1; the norm rescale keeps |v_cond|).
    gain = 2 * guidance - 1
    atol = chain_atol(torch.float32, theirs.abs().max(), ulps=16 * steps * gain)
    torch.testing.assert_close(ours.latents, theirs, rtol=0, atol=atol)
    # Decoding (latents_mean/std, the video VAE's frame axis) as the pipeline decodes.
    images = pipeline(**call, output_type="pt").images
    decoded = policy.decode(theirs)
    torch.testing.assert_close(decoded, images, rtol=0, atol=chain_atol(torch.float32, 1.0, 16))


def test_guidance_rescales_each_token_to_the_conditional_norm(policy: Policy) -> None:
    """QwenImagePipeline's true CFG on packed tokens: every 2x2 patch of the guided
    velocity has the conditional velocity's norm and the plain CFG direction."""
    generator = torch.Generator().manual_seed(0)
    uncond, cond = torch.randn(2, 3, 4, 8, 8, generator=generator, dtype=torch.float64)
    guided = policy.family.combine_guidance(uncond, cond, GUIDANCE)

    def patches(x: torch.Tensor) -> torch.Tensor:  # [B, C, h, w] -> [B, tokens, 4C]
        return x.unfold(2, 2, 2).unfold(3, 2, 2).permute(0, 2, 3, 1, 4, 5).flatten(3).flatten(1, 2)

    plain = patches(uncond + GUIDANCE * (cond - uncond))
    expected = plain * patches(cond).norm(dim=-1, keepdim=True) / plain.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(patches(guided), expected, rtol=1e-14, atol=0)


def test_sigmas_follow_the_image_size_and_the_terminal_stretch(policy: Policy) -> None:
    # Flow-GRPO's Qwen-Image schedule at 512 px, 10 steps (mu 0.5387, shift_terminal 0.02)
    expected = [1, 0.929, 0.8515, 0.7666, 0.6733, 0.5701, 0.4555, 0.3274, 0.1833, 0.02, 0]
    sigmas = policy.sigmas(10, 512)
    torch.testing.assert_close(sigmas, torch.tensor(expected), rtol=0, atol=5e-5)
    # A static shift s is the exponential time shift with mu = log s.
    config = policy.pipeline.scheduler.config
    slope = (config.max_shift - config.base_shift) / (
        config.max_image_seq_len - config.base_image_seq_len
    )
    mu = config.base_shift + slope * (16 - config.base_image_seq_len)  # 64 px: 16 tokens
    at_64 = policy.sigmas(4, RESOLUTION)
    torch.testing.assert_close(
        policy.sigmas(4, RESOLUTION, shift=math.exp(mu)),
        at_64,
        rtol=0,
        atol=chain_atol(torch.float32, 1.0, 4),
    )
    assert at_64[-2] == pytest.approx(config.shift_terminal) and at_64[-1] == 0
    with pytest.raises(ValueError, match="steps must be >= 1"):
        policy.sigmas(0, RESOLUTION)


def test_flow_grpo_ratio_is_one_on_the_first_step(policy: Policy) -> None:
    """Rescoring each recorded SDE step with the trained adapter (grad on, CFG's uncond
    branch detached) gives the rollout's log p_old exactly: r == 1 before any update."""
    _perturb(policy, "default", "old")
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS).repeat_interleave(2)
    negative = policy.encode_prompts([" "], MAX_TOKENS).repeat_interleave(4)
    noise = torch.randn(4, *policy.latent_shape(RESOLUTION), generator=torch.Generator())
    sigmas = policy.sigmas(6, RESOLUTION)
    eta = 1.2  # Flow-GRPO's Qwen-Image noise level
    result = integrate(
        guided_velocity(policy, embeds, negative, GUIDANCE, "old"),
        noise,
        sigmas,
        "sde",
        eta,
        torch.Generator().manual_seed(1),
        recorded_steps=range(5),
    )
    velocity = guided_velocity(policy, embeds, negative, GUIDANCE, "default", detach_uncond=True)
    for step in range(5):
        log_prob = rescored_log_prob(result, velocity, sigmas, step, eta)
        ratio = torch.exp(log_prob - result.log_probs[:, step]).detach()
        assert torch.equal(ratio, torch.ones(4)), f"step {step}: r = {ratio.tolist()}"


def test_every_lora_parameter_reaches_the_velocity(policy: Policy) -> None:
    """The last block's text-stream outputs are discarded: no adapter sits there (the
    trainer refuses parameters no objective reaches); every other target has one."""
    _perturb(policy, "default")
    latents = torch.randn(2, *policy.latent_shape(RESOLUTION), generator=torch.Generator())
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS)
    policy.velocity(latents, torch.tensor([0.3, 0.9]), embeds).square().sum().backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())
    names = {name.rsplit(".lora_", 1)[0] for name in policy.lora_state()}
    for target in QwenImage.lora_targets:
        assert any(n.startswith("transformer_blocks.0.") and n.endswith(target) for n in names)
    last = len(policy.transformer.transformer_blocks) - 1
    assert f"transformer_blocks.{last}.attn.to_add_out" not in names
    assert f"transformer_blocks.{last}.attn.add_q_proj" in names
    assert not any(n.startswith(f"transformer_blocks.{last}.txt_mlp") for n in names)


# diffusers injects the adapter where the file has weights, so the exclusions recorded in
# its config find nothing left to exclude, and peft says so.
@pytest.mark.filterwarnings("ignore:You have passed exclude_modules")
def test_saved_lora_loads_into_diffusers_and_gives_the_same_model(
    policy: Policy, tiny_dir: Path, tmp_path: Path
) -> None:
    from diffusers import QwenImagePipeline

    _perturb(policy, "default")
    policy.save_lora(tmp_path / "lora")
    loaded = QwenImagePipeline.from_pretrained(tiny_dir)
    loaded.load_lora_weights(tmp_path / "lora")
    latents = torch.randn(2, *policy.latent_shape(RESOLUTION), generator=torch.Generator())
    sigmas = torch.tensor([0.3, 0.9])
    embeds = policy.encode_prompts(PROMPTS, MAX_TOKENS)
    with torch.no_grad():
        ours = policy.velocity(latents, sigmas, embeds)
        base = policy.velocity(latents, sigmas, embeds, adapter="reference")
    theirs = _transformer_velocity(loaded.transformer, latents, sigmas, embeds)
    # The same weights and operations: equal up to peft's and diffusers' identical sums.
    torch.testing.assert_close(ours, theirs, rtol=0, atol=chain_atol(torch.float32, 1.0, 4))
    assert (ours - base).abs().max() > 0.1  # the LoRA is there and changes the model


# Rewards smooth in the pixels, both with signal in every group (tests/diffusion/smooth_rewards).
SMOOTH = [
    "reward_modules=[diffusion.smooth_rewards]",
    "rewards=[{name: smooth_brightness}, {name: smooth_redness}]",
]
STEP_OBJECTIVE = [
    "rollout.sampler=sde",
    "train.old_schedule=copy",
    f"rollout.guidance_scale={GUIDANCE}",
]
OBJECTIVES = {
    "nft": [],  # VeRL-Omni's Qwen-Image DiffusionNFT recipe samples without CFG
    "flow_grpo": ["objective.name=flow_grpo", *STEP_OBJECTIVE],
    "sdpo": ["objective.name=sdpo", *STEP_OBJECTIVE],
}
STRATEGIES = {
    "marble": ["strategy.name=marble", "strategy.period=1"],
    "weighted_sum": ["strategy.name=weighted_sum", "strategy.period=null"],
}


@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_every_objective_trains(tiny_dir: Path, tmp_path: Path, objective, strategy) -> None:
    """One epoch on the tiny Qwen-Image. MARBLE solves each step with the per-row gradient
    engine (train.gradient_engine=auto), whose first solve is checked against K backward
    passes: it stays in use, so it applies to Qwen-Image's transformer as to SD3's."""
    run = tmp_path / "run"
    overrides = [
        f"run.directory={run}",
        "run.quiet=true",
        "train.epochs=1",
        f"model.path={tiny_dir}",
        *SMOOTH,
        *OBJECTIVES[objective],
        *STRATEGIES[strategy],
    ]
    assert main(["train", "--preset", "tiny", *overrides]) == 0
    (record,) = read_metrics(run)
    steps = record["optimizer_steps"]
    assert steps and all(math.isfinite(s["grad_norm"]) for s in steps)
    assert all(math.isfinite(w) for s in steps for w in s["weights"])
    if strategy == "marble":
        solved = [s for s in steps if s["solved"]]
        assert solved and {s["engine"] for s in solved} == {"rows"}
        assert any(s["fallback"] is None and min(s["weights"]) > 0 for s in solved)
    if objective != "nft":
        assert steps[0]["objective/first_step_max_abs_ratio_minus_one"] == 0.0
    assert (run / "lora" / "pytorch_lora_weights.safetensors").is_file()


def test_both_gradient_engines_train_the_same_run(tiny_dir: Path, tmp_path: Path) -> None:
    """MARBLE with CFG on Flow-GRPO: the per-row engine and K backward passes solve for the
    same weights and apply the same update, up to float32 round-off."""
    steps = {}
    for engine in ("auto", "batched"):
        run = tmp_path / engine
        overrides = [
            f"run.directory={run}",
            "run.quiet=true",
            "train.epochs=1",
            f"model.path={tiny_dir}",
            f"train.gradient_engine={engine}",
            *SMOOTH,
            *OBJECTIVES["flow_grpo"],
            *STRATEGIES["marble"],
        ]
        assert main(["train", "--preset", "tiny", *overrides]) == 0
        steps[engine] = [s for r in read_metrics(run) for s in r["optimizer_steps"]]
    assert {s["engine"] for s in steps["auto"]} == {"rows"}
    assert {s["engine"] for s in steps["batched"]} == {"batched"}
    for ours, theirs in zip(steps["auto"], steps["batched"], strict=True):
        torch.testing.assert_close(ours["weights"], theirs["weights"], rtol=1e-4, atol=1e-6)
        assert ours["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-4)


@pytest.mark.parametrize("cfg", [1.0, GUIDANCE], ids=["no_cfg", "true_cfg"])
def test_eval_samples_as_the_rollout(tiny_dir: Path, tmp_path: Path, cfg: float) -> None:
    """``eval`` samples with QwenImagePipeline itself, guided as the family guides rollouts
    (true CFG against its negative prompt, rescaled): its images are ours."""
    import json

    import numpy as np
    from PIL import Image

    from mogradient_diffusion.rewards.base import to_uint8_images

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    settings = ["--steps", "3", "--resolution", str(RESOLUTION)]
    settings += ["--max-sequence-length", str(MAX_TOKENS), "--guidance-scale", str(cfg)]
    metrics = ["--metrics", "jpeg_incompressibility", "--quiet", "--device", "cpu"]
    out = tmp_path / "eval"
    arguments = ["eval", "--out", str(out), "--model", str(tiny_dir), "--prompts", str(prompts)]
    assert main([*arguments, *metrics, *settings]) == 0
    assert json.loads((out / "summary.json").read_text())["settings"]["guidance_scale"] == cfg
    policy = Policy.load(tiny_dir, LoraSpec(rank=4, alpha=8))
    # eval seeds image i with seed + i (seed 0); the pipeline draws each image's noise alone.
    shape = policy.latent_shape(RESOLUTION)
    seeded = [torch.Generator().manual_seed(i) for i in range(len(PROMPTS))]
    noise = torch.cat([torch.randn(1, *shape, generator=g) for g in seeded])
    batch = rollout(
        policy,
        PROMPTS,
        1,
        3,
        resolution=RESOLUTION,
        guidance_scale=cfg,
        adapter="reference",
        noise=noise,
        max_sequence_length=MAX_TOKENS,
    )
    for index, ours in enumerate(to_uint8_images(batch.images).astype(int)):
        theirs = np.asarray(Image.open(out / f"images/{index:05d}.png"), dtype=int)
        assert np.abs(ours - theirs).max() <= 1  # values a rounding apart may round apart
