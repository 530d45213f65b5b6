"""Policy: LoRA adapters on the tiny SD3 transformer, their switching, saving and schedules."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from tolerances import chain_atol

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families.flux import Flux
from mogradient_diffusion.model.families.sd3 import SD3
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.training.ema import ParameterEMA, old_decay

SPEC = LoraSpec(rank=4, alpha=8)
PROMPTS = ["a red cat", 'a sign saying "hello"']
MAX_TOKENS = 32


@pytest.fixture
def policy(tiny_pipeline_dir: Path) -> Policy:
    return Policy.load(tiny_pipeline_dir, SPEC)


def _inputs(policy: Policy, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(len(PROMPTS), *policy.latent_shape(64), generator=generator)
    sigmas = torch.tensor([0.3, 0.9])
    return latents, sigmas, policy.encode_prompts(PROMPTS, MAX_TOKENS)


def _perturb(policy: Policy, adapter: str, seed: int) -> None:
    """Random LoRA weights (B starts at zero, which would make every adapter the base)."""
    generator = torch.Generator().manual_seed(seed)
    state = policy.lora_state(adapter)
    policy.load_lora_state(
        adapter, {k: 0.1 * torch.randn(v.shape, generator=generator) for k, v in state.items()}
    )


def _base_velocity(path: Path, latents, sigmas, embeds) -> torch.Tensor:
    from diffusers import StableDiffusion3Pipeline

    transformer = StableDiffusion3Pipeline.from_pretrained(path).transformer
    with torch.no_grad():
        return transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds.prompt_embeds,
            pooled_projections=embeds.pooled,
            timestep=sigmas * 1000,
            return_dict=False,
        )[0]


def test_lora_targets_include_dual_attention(policy: Policy) -> None:
    modules = dict(policy.transformer.named_modules())
    block = "transformer_blocks.0"
    attn2 = [f"{block}.attn2.{t}" for t in ("to_q", "to_k", "to_v", "to_out.0")]
    attn = [f"{block}.attn.{t}" for t in SD3.lora_targets]
    for name in attn + attn2:
        assert set(modules[name].lora_A.keys()) == {"default", "old"}, name
    assert any(".attn2." in name for name in policy.lora_state("default"))
    # The spec named no targets: the policy records SD3's, the attention projections only.
    assert policy.lora.target_modules == SD3.lora_targets
    adapted = {name.rsplit(".lora_", 1)[0] for name in policy.lora_state("default")}
    assert all(any(name.endswith("." + t) for t in SD3.lora_targets) for name in adapted)


def test_adapters_start_identical_and_only_default_trains(policy: Policy) -> None:
    default, old = policy.lora_state("default"), policy.lora_state("old")
    assert default.keys() == old.keys()
    assert all(torch.equal(default[k], old[k]) for k in default)
    trainable = {id(p) for p in policy.trainable_parameters()}
    requiring = {id(p) for p in policy.transformer.parameters() if p.requires_grad}
    assert trainable == requiring and len(trainable) == len(default)
    for component in ("vae", "text_encoder", "text_encoder_2", "text_encoder_3"):
        assert not any(p.requires_grad for p in getattr(policy.pipeline, component).parameters())


def test_reference_velocity_is_the_base_transformer(policy: Policy, tiny_pipeline_dir) -> None:
    _perturb(policy, "default", 1)
    _perturb(policy, "old", 2)
    latents, sigmas, embeds = _inputs(policy)
    reference = policy.velocity(latents, sigmas, embeds, "reference")
    base = _base_velocity(tiny_pipeline_dir, latents, sigmas, embeds)
    torch.testing.assert_close(reference, base, rtol=0, atol=1e-6)
    assert not reference.requires_grad
    for adapter in ("default", "old"):
        assert (policy.velocity(latents, sigmas, embeds, adapter) - base).abs().max() > 1e-3


def test_old_forward_keeps_default_trainable_and_grads_reach_default_only(policy) -> None:
    _perturb(policy, "default", 1)
    latents, sigmas, embeds = _inputs(policy)
    v_old = policy.velocity(latents, sigmas, embeds, "old")
    policy.velocity(latents, sigmas, embeds, "reference")
    assert not v_old.requires_grad
    assert all(p.requires_grad for p in policy.trainable_parameters())
    policy.velocity(latents, sigmas, embeds, "default").square().mean().backward()
    grads = dict(zip(policy.lora_state("default"), policy.trainable_parameters(), strict=True))
    zero = {name for name, p in grads.items() if not p.grad.abs().sum() > 0}
    # The last block is context_pre_only: its text-query projection cannot reach the output.
    last = len(policy.transformer.transformer_blocks) - 1
    assert zero == {n for n in grads if n.startswith(f"transformer_blocks.{last}.attn.add_q_proj")}
    trained = {id(p) for p in policy.trainable_parameters()}
    others = [p for p in policy.transformer.parameters() if id(p) not in trained]
    assert all(p.grad is None for p in others)


def test_gradient_checkpointing_gives_the_same_gradients(policy, tiny_pipeline_dir) -> None:
    checkpointed = Policy.load(tiny_pipeline_dir, SPEC, gradient_checkpointing=True)
    _perturb(policy, "default", 1)
    checkpointed.load_lora_state("default", policy.lora_state("default"))
    latents, sigmas, embeds = _inputs(policy)
    for model in (policy, checkpointed):
        model.velocity(latents, sigmas, embeds, "default").square().mean().backward()
    assert checkpointed.transformer.is_gradient_checkpointing
    for plain, ckpt in zip(
        policy.trainable_parameters(), checkpointed.trainable_parameters(), strict=True
    ):
        torch.testing.assert_close(ckpt.grad, plain.grad)


def test_velocity_accepts_a_scalar_sigma_and_checks_batch(policy: Policy) -> None:
    latents, _, embeds = _inputs(policy)
    with torch.no_grad():
        scalar = policy.velocity(latents, 0.5, embeds)
        vector = policy.velocity(latents, torch.full((2,), 0.5), embeds)
    torch.testing.assert_close(scalar, vector)
    with pytest.raises(ValueError, match="batch mismatch"):
        policy.velocity(latents, torch.ones(3), embeds)
    with pytest.raises(ValueError, match="adapter"):
        policy.velocity(latents, 0.5, embeds, "ema")


def test_update_old_matches_formula(policy: Policy) -> None:
    _perturb(policy, "default", 1)
    _perturb(policy, "old", 2)
    default, old = policy.lora_state("default"), policy.lora_state("old")
    policy.update_old(0.3)
    updated = policy.lora_state("old")
    for name in old:
        torch.testing.assert_close(updated[name], 0.3 * old[name] + 0.7 * default[name])
    assert torch.equal(policy.lora_state("default")[name], default[name])
    policy.update_old(0.0)
    assert all(torch.equal(policy.lora_state("old")[k], default[k]) for k in default)
    with pytest.raises(ValueError):
        policy.update_old(1.5)


def test_lora_state_round_trip_and_mismatch(policy: Policy) -> None:
    _perturb(policy, "default", 3)
    state = policy.lora_state("default")
    policy.load_lora_state("old", state)
    assert all(torch.equal(policy.lora_state("old")[k], state[k]) for k in state)
    with pytest.raises(KeyError, match="missing"):
        policy.load_lora_state("default", dict(list(state.items())[1:]))
    with pytest.raises(ValueError):
        policy.lora_state("reference")


def test_save_lora_loads_into_a_fresh_pipeline(policy, tiny_pipeline_dir, tmp_path) -> None:
    from diffusers import StableDiffusion3Pipeline

    _perturb(policy, "default", 4)
    latents, sigmas, embeds = _inputs(policy)
    with torch.no_grad():
        expected = policy.velocity(latents, sigmas, embeds, "default")
    policy.save_lora(tmp_path / "lora")
    fresh = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir)
    fresh.load_lora_weights(tmp_path / "lora")
    with torch.no_grad():
        loaded = fresh.transformer(
            hidden_states=latents,
            encoder_hidden_states=embeds.prompt_embeds,
            pooled_projections=embeds.pooled,
            timestep=sigmas * 1000,
            return_dict=False,
        )[0]
    torch.testing.assert_close(loaded, expected, rtol=0, atol=1e-5)


def test_decode_and_latent_shape(policy: Policy) -> None:
    latents = torch.randn(3, *policy.latent_shape(64))
    assert policy.latent_shape(64) == (4, 8, 8)
    images = policy.decode(latents, batch_size=2)
    assert images.shape == (3, 3, 64, 64)
    assert images.min() >= 0 and images.max() <= 1
    # 2 + 1 rows vs 3: the decoder's convolutions and group norms round by batch size
    # (34 ulps of the [0, 1] range seen for 1 vs 6 rows on AMD EPYC); budget 128.
    whole = policy.decode(latents)
    torch.testing.assert_close(images, whole, rtol=0, atol=chain_atol(torch.float32, 1.0, 128))
    with pytest.raises(ValueError, match="multiple of 16"):
        policy.latent_shape(40)


def test_prompt_embeddings_helpers() -> None:
    embeds = PromptEmbeddings(torch.arange(12.0).view(2, 3, 2), torch.arange(4.0).view(2, 2))
    repeated = embeds.repeat_interleave(3)
    assert len(repeated) == 6
    assert torch.equal(repeated.pooled[:3], embeds.pooled[[0, 0, 0]])
    picked = repeated.index(torch.tensor([5, 0]))
    assert torch.equal(picked.prompt_embeds, embeds.prompt_embeds[[1, 0]])
    assert len(PromptEmbeddings.cat([embeds, picked])) == 4
    with pytest.raises(ValueError, match="B = 2 prompt rows"):
        PromptEmbeddings(torch.zeros(2, 3, 2), torch.zeros(3, 2))


def test_lora_spec_defaults_and_validation() -> None:
    spec = LoraSpec()
    assert (spec.rank, spec.alpha, spec.init) == (32, 64.0, "gaussian")
    assert spec.target_modules is None  # the model family's, once it is known
    with pytest.raises(ValueError, match="for_family"):
        spec.peft_config()
    assert spec.for_family(SD3()).target_modules == SD3.lora_targets
    assert spec.for_family(Flux()).target_modules == Flux.lora_targets
    chosen = LoraSpec(target_modules=["to_q"])
    assert chosen.target_modules == ("to_q",) and chosen.for_family(Flux()) is chosen
    config = spec.for_family(SD3()).peft_config()
    assert config.r == 32 and config.lora_alpha == 64 and config.init_lora_weights == "gaussian"
    assert config.target_modules == set(SD3.lora_targets)
    for bad in (
        {"rank": 0},
        {"alpha": 0},
        {"dropout": 1.0},
        {"init": "pissa"},
        {"target_modules": ()},
    ):
        with pytest.raises(ValueError):
            LoraSpec(**bad)


def test_bad_pipeline_paths_raise_one_clear_error(tiny_pipeline_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Policy.load(tmp_path / "nowhere", SPEC)
    with pytest.raises(FileNotFoundError, match=r"missing model_index\.json"):
        Policy.load(tmp_path, SPEC)
    partial = tmp_path / "partial"
    shutil.copytree(tiny_pipeline_dir, partial)
    shutil.rmtree(partial / "transformer")
    shutil.rmtree(partial / "vae")
    with pytest.raises(FileNotFoundError, match="missing transformer/, vae/"):
        Policy.load(partial, SPEC)
    assert "transformer" in json.loads((partial / "model_index.json").read_text())


def test_old_decay_schedules() -> None:
    assert [old_decay("copy", s) for s in (0, 10, 10_000)] == [0.0, 0.0, 0.0]
    assert old_decay("linear", 0) == 0.0
    assert old_decay("linear", 100) == pytest.approx(0.1)
    assert old_decay("linear", 10_000) == 0.5
    assert old_decay("linear", 10_000, cap=0.95) == 0.95
    assert old_decay("linear", 600, cap=0.95) == pytest.approx(0.6)
    assert old_decay("delayed_linear", 74) == 0.0
    assert old_decay("delayed_linear", 75) == 0.0
    assert old_decay("delayed_linear", 95) == pytest.approx(0.15)
    assert old_decay("delayed_linear", 10_000) == 0.999
    with pytest.raises(ValueError):
        old_decay("cosine", 1)
    with pytest.raises(ValueError):
        old_decay("linear", 1, cap=1.0)


def test_parameter_ema_warmup_swap_and_state() -> None:
    parameter = torch.nn.Parameter(torch.zeros(3))
    ema = ParameterEMA([parameter], decay=0.9)
    values = []
    for step in range(1, 31):
        with torch.no_grad():
            parameter.fill_(float(step))
        ema.update()
        values.append(ema.shadow[0][0].item())
    expected = 0.0
    for n in range(1, 31):
        decay = min(0.9, (1 + n) / (10 + n))
        expected = decay * expected + (1 - decay) * n
    assert ema.decay_at(1) == pytest.approx(2 / 11) and ema.decay_at(100) == 0.9
    assert values[-1] == pytest.approx(expected, rel=1e-6)
    with ema.swap_in():
        assert torch.allclose(parameter, torch.full((3,), expected))
    assert torch.equal(parameter, torch.full((3,), 30.0))
    restored = ParameterEMA([torch.nn.Parameter(torch.zeros(3))], decay=0.5)
    restored.load_state_dict(ema.state_dict())
    assert (restored.decay, restored.num_updates) == (0.9, 30)
    assert torch.equal(restored.shadow[0], ema.shadow[0])


def test_half_precision_base_keeps_float32_lora(tiny_pipeline_dir: Path) -> None:
    policy = Policy.load(tiny_pipeline_dir, SPEC, dtype=torch.bfloat16)
    assert policy.dtype == torch.bfloat16
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    latents, sigmas, embeds = _inputs(policy)
    velocity = policy.velocity(latents.to(torch.bfloat16), sigmas, embeds)
    assert velocity.dtype == torch.bfloat16 and embeds.pooled.dtype == torch.bfloat16
    velocity.float().square().mean().backward()
    assert all(p.grad.dtype == torch.float32 for p in policy.trainable_parameters())
