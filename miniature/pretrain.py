"""Pretrain the miniature's base model: a small SD3 pipeline fitted to the procedural world.

Two stages on renders of scenes for the training prompts (``world.split_prompts``):
the VAE learns to reconstruct 64 px images from 16 x 16 x 4 latents (MSE plus a small
KL), its latent statistics become the pipeline's scaling and shift factors, then the
SD3 transformer learns rectified flow (x_t = (1 - t) x0 + t noise, target noise - x0,
logit-normal t) conditioned on the frozen random text encoders. Training stops on a
fixed step budget, deliberately early: the base model draws the scenes roughly and
leaves every reward headroom for RL to improve.

``--init DIR`` warm-starts the VAE and transformer from an earlier checkpoint (the text
encoders and tokenizers are always rebuilt, so a tokenizer fix re-learns the text
conditioning on top of the image prior). ``--text-share`` puts that share of sign
renders in every VAE batch: signs are the finest detail of the world, and a VAE trained
on the uniform prompt mix blurs their letters (OCR 0.36 on round-tripped clean renders).

The shipped checkpoint (``mini/base_model``) was made in two runs (its
``pretrain_report.json`` keeps the second's settings; ``history`` the first's): the
first is the earlier shipped model (git f519362, before the tokenizer fix, whose text
conditioning the second run replaces), the second, 29 min on one shared core::

    python -m miniature.pretrain --out base_v1              # 600 + 4000 steps
    python -m miniature.pretrain --out miniature/base_model \
        --init base_v1 --vae-steps 80 --text-share 0.5 --flow-steps 1500
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from miniature.world import (
    MiniPrompt,
    render,
    sample_scene,
    split_prompts,
    vocabulary,
)
from mogradient_diffusion.model.tiny import TinySD3Spec, build_tiny_pipeline

SPEC = TinySD3Spec(
    resolution=64,
    latent_channels=4,
    transformer_layers=4,
    heads=4,
    head_dim=16,
    clip_hidden=16,
    t5_width=32,
    vae_width=32,
    vae_blocks=3,
    clip_max_length=16,  # the world's prompts take <= 10 tokens; 77 would triple the text tokens
    seed=0,
)
MAX_SEQUENCE_LENGTH = 16


def render_batch(prompts: list[MiniPrompt], rng: random.Random) -> torch.Tensor:
    """[B, 3, 64, 64] in [-1, 1]: one fresh random scene per prompt."""
    arrays = [np.asarray(render(sample_scene(p, rng)), dtype=np.float32) for p in prompts]
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2) / 127.5 - 1


def train_vae(
    vae, prompts: list[MiniPrompt], steps: int, batch: int, seed: int, *,
    lr: float = 2e-3, text_share: float = 0.0,
) -> dict:  # fmt: skip
    """Reconstruction training; ``text_share`` of each batch are sign renders."""
    rng = random.Random(seed)
    signs = [p for p in prompts if p.metadata["tag"] == "text"]
    n_signs = round(batch * text_share)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=lr, weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, max(steps, 1))
    vae.train()
    losses = []
    for _ in tqdm(range(steps), desc="vae"):
        chosen = rng.choices(signs, k=n_signs) + rng.choices(prompts, k=batch - n_signs)
        images = render_batch(chosen, rng)
        posterior = vae.encode(images).latent_dist
        reconstruction = vae.decode(posterior.sample()).sample
        mse = F.mse_loss(reconstruction, images)
        loss = mse + 1e-6 * posterior.kl().mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        losses.append(mse.item())
    vae.eval().requires_grad_(False)
    with torch.no_grad():  # latent statistics -> SD3-style scaling and shift
        latents = torch.cat(
            [
                vae.encode(render_batch(rng.choices(prompts, k=64), rng)).latent_dist.mean
                for _ in range(8)
            ]
        )
    shift, scale = latents.mean().item(), 1 / latents.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return {
        "vae_final_mse": float(np.mean(losses[-50:])) if losses else None,
        "vae_sign_ocr": sign_round_trip_ocr(vae, signs),
        "shift": shift,
        "scale": scale,
    }


@torch.no_grad()
def sign_round_trip_ocr(vae, signs: list[MiniPrompt], per_word: int = 4) -> float | None:
    """Mean Tesseract OCR reward of clean sign renders after a VAE round trip (None: no
    Tesseract): the ceiling any policy decoding through this VAE can reach."""
    try:
        from mogradient_diffusion.rewards.ocr import OcrReward

        ocr = OcrReward(workers=2)
    except (ImportError, RuntimeError):
        return None
    chosen = [p for p in signs for _ in range(per_word)]
    images = render_batch(chosen, random.Random(12345))
    decoded = vae.decode(vae.encode(images).latent_dist.mean).sample
    return float(ocr(((decoded + 1) / 2).clamp(0, 1), [p.text for p in chosen]).mean())


def train_transformer(
    pipeline, prompts, steps: int, batch: int, seed: int, lr: float = 1e-3
) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    texts = [p.text for p in prompts]
    with torch.no_grad():
        embeds, _, pooled, _ = pipeline.encode_prompt(
            prompt=texts, prompt_2=None, prompt_3=None, do_classifier_free_guidance=False,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )  # fmt: skip
    vae, transformer = pipeline.vae, pipeline.transformer
    transformer.train().requires_grad_(True)
    optimizer = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, steps)
    losses = []
    for _ in tqdm(range(steps), desc="transformer"):
        rows = [rng.randrange(len(prompts)) for _ in range(batch)]
        with torch.no_grad():
            images = render_batch([prompts[i] for i in rows], rng)
            x0 = vae.encode(images).latent_dist.sample() - vae.config.shift_factor
            x0 = x0 * vae.config.scaling_factor
        t = torch.sigmoid(torch.randn(batch))  # logit-normal, as SD3 trains
        noise = torch.randn_like(x0)
        xt = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
        index = torch.tensor(rows)
        prediction = transformer(
            hidden_states=xt,
            encoder_hidden_states=embeds[index],
            pooled_projections=pooled[index],
            timestep=t * 1000,
            return_dict=False,
        )[0]
        loss = F.mse_loss(prediction, noise - x0)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    transformer.eval().requires_grad_(False)
    return {"flow_final_mse": float(np.mean(losses[-100:]))}


def pretrain(
    out: Path, vae_steps: int, flow_steps: int, batch: int = 32, seed: int = 0,
    init: Path | None = None, text_share: float = 0.0,
) -> Path:  # fmt: skip
    """Build (or warm-start from ``init``), train and ``save_pretrained`` into ``out``."""
    torch.manual_seed(seed)
    started = time.perf_counter()
    train_prompts, _ = split_prompts(seed=0)
    prompts = [p for source in train_prompts.values() for p in source]
    pipeline = build_tiny_pipeline(SPEC, words=vocabulary())
    report = {"spec": asdict(SPEC), "vae_steps": vae_steps, "flow_steps": flow_steps,
              "batch": batch, "seed": seed, "train_prompts": len(prompts),
              "text_share": text_share}  # fmt: skip
    if init is not None:
        from diffusers import AutoencoderKL, SD3Transformer2DModel

        pipeline.vae = AutoencoderKL.from_pretrained(init / "vae")
        pipeline.transformer = SD3Transformer2DModel.from_pretrained(init / "transformer")
        previous = json.loads((init / "pretrain_report.json").read_text())
        report["history"] = [*previous.pop("history", []), previous]
    lr = 2e-3 if init is None else 5e-4  # a warm start fine-tunes
    report |= train_vae(pipeline.vae, prompts, vae_steps, batch, seed, lr=lr, text_share=text_share)
    report |= train_transformer(pipeline, prompts, flow_steps, batch, seed + 1, lr=lr)
    report["seconds"] = round(time.perf_counter() - started, 1)
    report["transformer_parameters"] = sum(p.numel() for p in pipeline.transformer.parameters())
    report["vae_parameters"] = sum(p.numel() for p in pipeline.vae.parameters())
    out.mkdir(parents=True, exist_ok=True)
    pipeline.save_pretrained(out)
    (out / "pretrain_report.json").write_text(json.dumps(report, indent=2))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vae-steps", type=int, default=600)
    parser.add_argument("--flow-steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--init", type=Path, help="warm-start VAE and transformer from here")
    parser.add_argument("--text-share", type=float, default=0.0, help="sign share of VAE batches")
    args = parser.parse_args(argv)
    path = pretrain(
        args.out, args.vae_steps, args.flow_steps, args.batch, args.seed, args.init, args.text_share
    )
    print(f"base model written to {path}")


if __name__ == "__main__":
    main()
