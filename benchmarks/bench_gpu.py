"""GPU cost of DiffusionNFT training at SD3.5-M, FLUX.1-dev and Qwen-Image shapes: rollout,
training, MFU, MARBLE's overhead.

Why: the reference trainers publish no time or memory per step, and MARBLE's paper
reports (for SD3.5-M) 0.97x of weighted-sum throughput amortized, 0.56x solving every
step, and 1.14x memory. This script measures those quantities on one accelerator, with
the real trainer (``mogradient_diffusion.training.trainer.Trainer``: rollout, rewards,
advantages, the NFT loss, per-reward gradients or one combined backward, MGDA, AdamW,
EMA) on a model of the real shape, so that one command on an H100/H200 gives
publishable figures.

What is real and what stands in (the output says so too):

* transformer: the family's diffusers class built from the released
  ``transformer/config.json`` (``benchmarks.memory_model``: SD3.5-Medium,
  FLUX.1-dev, Qwen-Image), random weights; compute and memory are those of the real
  model, the outputs are not;
* VAE: the family's VAE class at the released shape, random weights;
* text encoders: not run. ``Policy.encode_prompts`` is replaced by precomputed random
  embeddings of the real shapes: SD3 pooled CLIP-L + CLIP-G [B, 2048] and hidden states
  of 77 CLIP + 128 T5-XXL tokens [B, 205, 4096] (the recipe's T5 length); FLUX pooled
  CLIP-L [B, 768] and 128 T5-XXL tokens [B, 128, 4096]; Qwen-Image 256 Qwen2.5-VL tokens
  [B, 256, 3584] with an all-ones mask;
* rewards: K = 5 cheap image statistics (``standin_*``), registered as ordinary rewards;
* optimizer, NFT and batch settings: ``configs/sd35m_marble_5r.yaml`` for every shape
  (FLUX.1-dev's own recipe trains Flow-GRPO; this measures MARBLE's NFT loop on its
  shape); LoRA rank, per-GPU batch, text length and embedded guidance from the family's
  recipe (SD3.5-M r32 and batch 9; FLUX.1-dev r64, batch 3, guidance 3.5; Qwen-Image
  r64 and batch 4, not its recipe's 12, which fits no single GPU on MARBLE's solve steps
  by ``benchmarks/results/memory_estimate.md``), the family's LoRA targets, one prompt
  group per optimizer step unless ``--accumulation`` says otherwise.

Measured: bf16 matmul peak (large ``torch.matmul``, same run); rollout images/s at 10 and
25 sampler steps with achieved TFLOP/s and MFU (FLOPs from ``FlopCounterMode``); training
seconds per optimizer step and per (sample, timestep), MFU and peak memory, with and
without gradient checkpointing, for weighted sum, MARBLE amortized (N = 10) and MARBLE
every step, interleaved epoch by epoch; their speed and memory ratios; and, last, a
one-process ``torchrun`` run whose collectives go through NCCL (gloo on CPU).

One optimizer step per epoch: an amortized row's measured window would hold no solve at
all in fewer than N rounds (round 0, the warm-up, fills the cache). Its cache is emptied
at the first measured round, so the window starts with its solve, and its throughput is
the N-step cycle of its own measured step times, ``(t_solve + (N - 1) t_cached) / N``.

Built for a short GPU lease (``benchmarks/gpu_lease.sh``): the JSON and markdown are
rewritten after every stage and training epoch (a run killed at the lease's limit keeps
what it measured), a failing stage or row is recorded and the others go on, and
``--budget`` stops starting rounds that would not finish in time.

The real shapes (``sd35m``, ``flux1dev``, ``qwen_image``) need a CUDA device. Each has a
tiny model of the same structure (``small``, ``flux1dev_small``, ``qwen_image_small``)
that runs on a CPU in well under a minute, and ``--quick`` cuts that to seconds (batch 2,
2 sampler steps, one round, checkpointing on, no torchrun check): smoke runs of the
whole script, flagged as such, never a result.

Run on a GPU: ``python benchmarks/bench_gpu.py --shape sd35m`` (``make bench-gpu``),
``--shape flux1dev`` or ``--shape qwen_image``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from unittest import mock

import torch
import torch.distributed as dist
from bench_trainer import LABELS as STRATEGY_LABELS
from bench_trainer import PAPER, THREADS, _compact, source_state
from bench_trainer import STRATEGIES as STRATEGY_OVERRIDES
from common import default_dtype, machine_info, markdown_table
from memory_model import (
    FLUX1_DEV_TRANSFORMER,
    FLUX_VAE,
    QWEN_IMAGE_TRANSFORMER,
    QWEN_IMAGE_VAE,
    RECIPES,
    SD3_VAE,
    SD35M_TRANSFORMER,
)
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from mogradient.engines import GradientEngine, accumulate_gradients, flat_gradient, write_gradient
from mogradient_diffusion.model import policy as policy_module
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families import family_named
from mogradient_diffusion.model.tiny_flux import DEV_SCHEDULER
from mogradient_diffusion.model.tiny_qwen_image import SCHEDULER_CONFIG as QWEN_SCHEDULER
from mogradient_diffusion.objectives import StepMetrics, TrainPiece
from mogradient_diffusion.objectives.nft import NFTRollout
from mogradient_diffusion.rewards import Reward, register_reward
from mogradient_diffusion.rewards.base import Metadata
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.sampling.rollout import rollout
from mogradient_diffusion.strategies import Strategy, build_strategy
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer, TrainerCallback
from mogradient_diffusion.training_config import TrainingConfig, load_config

# MARBLE as released (the recipe's own scope): a solve step solves on its first micro-step.
RELEASED = {"marble_released": ["strategy.name=marble", "strategy.solve_scope=micro_step"]}
# The compared rows: each a strategy of bench_trainer's (or the release's) and the engine of
# its per-objective gradients (auto: the per-row engine; batched: K backward passes).
ROWS = {name: (name, "auto") for name in STRATEGY_OVERRIDES | RELEASED} | {
    f"{name}_k_backward": (name, "batched") for name in ("marble_amortized", "marble_every_step")
}
STRATEGIES = {
    name: (STRATEGY_OVERRIDES | RELEASED)[strategy] for name, (strategy, _) in ROWS.items()
}
LABELS = STRATEGY_LABELS | {
    "marble_released": "MARBLE as released (N=10, solve on one micro-step)",
    **{
        f"{name}_k_backward": f"{STRATEGY_LABELS[name]}, K backward passes"
        for name in ("marble_amortized", "marble_every_step")
    },
}

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "configs" / "sd35m_marble_5r.yaml"
GPU_RESULTS = REPO / "benchmarks" / "results" / "gpu"
CPU_RESULTS = REPO / "results" / "gpu_smoke"  # git-ignored: CPU output is never a result
BASELINE = "weighted_sum"
TARGET_MFU = {"training": 0.40, "rollout": 0.50}
ROLLOUT_STEPS = (10, 25)
TRAIN_SAMPLING_STEPS = 10
# Kept back from --budget for the torchrun check at the end, besides a model build and two
# epochs: a process start, imports and the process group's set-up (a guess, not measured).
DDP_STARTUP_S = 30.0
# One prompt source: the built-in set has three, and their fractional shares can make a
# one-prompt epoch draw two prompts, which would change the work per epoch. The text is
# never encoded (see RandomTextEmbeddings).
PROMPT_FILE = "standin_prompts.txt"
STANDIN_PIPELINE = "pipeline"  # model.path: a directory with only model_index.json
STANDIN_PROMPTS = ("a photo of a cat", "a red car on a street", "a bowl of fruit")

# The same structures (dual attention and QK-norm; dual and single blocks; 16 latent
# channels, 4 VAE levels), tiny.
SMALL_TRANSFORMER: dict[str, Any] = {
    **SD35M_TRANSFORMER,
    "sample_size": 8,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "caption_projection_dim": 16,
    "pooled_projection_dim": 32,
    "pos_embed_max_size": 16,
    "dual_attention_layers": [0],
}
SMALL_VAE: dict[str, Any] = {
    **SD3_VAE,
    "block_out_channels": [8, 8, 8, 8],
    "layers_per_block": 1,
    "norm_num_groups": 4,
    "sample_size": 64,
}
SMALL_FLUX_TRANSFORMER: dict[str, Any] = {
    **FLUX1_DEV_TRANSFORMER,
    "num_layers": 1,
    "num_single_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "pooled_projection_dim": 32,
    "axes_dims_rope": [2, 2, 4],
}
SMALL_FLUX_VAE: dict[str, Any] = {
    **SMALL_VAE,
    **{k: FLUX_VAE[k] for k in ("scaling_factor", "shift_factor")},
}
SMALL_QWEN_TRANSFORMER: dict[str, Any] = {
    **QWEN_IMAGE_TRANSFORMER,
    "num_layers": 2,
    "attention_head_dim": 8,
    "num_attention_heads": 2,
    "joint_attention_dim": 32,
    "axes_dims_rope": [2, 2, 4],
}
SMALL_QWEN_VAE: dict[str, Any] = {
    **QWEN_IMAGE_VAE,
    "base_dim": 8,
    "dim_mult": [1, 1, 1, 1],
    "num_res_blocks": 1,
}


@dataclass(frozen=True)
class FamilyParts:
    """How a family's pipeline is put together from a transformer and a VAE, and the text
    encoders whose outputs stand in for them."""

    name: str
    transformer_class: str
    vae_class: str
    scheduler: dict[str, Any]
    absent: tuple[str, ...]  # text encoders and tokenizers, passed as None
    pooled_source: str | None  # what the pooled embeddings are; None: a token mask instead
    token_source: str


PARTS = {
    parts.name: parts
    for parts in (
        FamilyParts(
            "sd3",
            "SD3Transformer2DModel",
            "AutoencoderKL",
            {"shift": 3.0},
            tuple(f"{kind}{n}" for kind in ("text_encoder", "tokenizer") for n in ("", "_2", "_3")),
            "CLIP-L + CLIP-G",
            "CLIP + T5-XXL",
        ),
        FamilyParts(
            "flux",
            "FluxTransformer2DModel",
            "AutoencoderKL",
            DEV_SCHEDULER,
            ("text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2"),
            "CLIP-L",
            "T5-XXL",
        ),
        FamilyParts(
            "qwen_image",
            "QwenImageTransformer2DModel",
            "AutoencoderKLQwenImage",
            QWEN_SCHEDULER,
            ("text_encoder", "tokenizer"),
            None,
            "Qwen2.5-VL",
        ),
    )
}


@dataclass(frozen=True)
class Shape:
    """Model sizes plus the defaults that keep a run of this shape within its time budget."""

    name: str
    family: str
    transformer: dict[str, Any]
    vae: dict[str, Any]
    resolution: int
    batch: int  # samples per GPU (--batch), the family recipe's
    clip_tokens: int  # SD3: CLIP-L/G hidden states ahead of the T5 tokens; else 0
    text_tokens: int  # T5 or Qwen2.5-VL tokens (rollout.max_sequence_length)
    rounds: int
    repeats: int
    matmul_size: int
    real: bool  # the released sizes: needs an accelerator
    lora_rank: int | None = None  # None: configs/sd35m_marble_5r.yaml's (r32)
    guidance: float | None = None  # model.guidance: FLUX.1-dev's embedded guidance

    @property
    def text_width(self) -> int:
        return self.transformer["joint_attention_dim"]

    @property
    def pooled_width(self) -> int | None:
        return self.transformer.get("pooled_projection_dim")

    @property
    def results_name(self) -> str:
        """Result file stem: SD3 keeps ``gpu_<device>``; the other families say which."""
        return "gpu" if self.family == "sd3" else f"gpu_{self.name.removesuffix('_small')}"

    def describe(self) -> dict[str, Any]:
        channels = self.transformer["in_channels"] // (1 if self.family == "sd3" else 4)
        return {
            "name": self.name,
            "family": self.family,
            "transformer_config": self.transformer,
            "vae_config": self.vae,
            "resolution": self.resolution,
            "latent": [channels, self.resolution // 8, self.resolution // 8],
            "text_tokens": {"clip": self.clip_tokens, "sequence": self.text_tokens},
            "text_width": self.text_width,
            "pooled_width": self.pooled_width,
        }


def _real(name: str, transformer: dict, vae: dict, batch: int | None = None, **sizes: Any) -> Shape:
    """A released-size shape with its family recipe's text length, LoRA rank and (unless
    ``batch`` says otherwise) per-GPU batch."""
    recipe = RECIPES[name]
    clip = 77 if recipe.family == "sd3" else 0
    return Shape(
        name,
        recipe.family,
        transformer,
        vae,
        recipe.resolution,
        batch or recipe.batch,
        clip,
        recipe.text_tokens - clip,
        real=True,
        lora_rank=None if recipe.family == "sd3" else recipe.lora_rank,
        **sizes,
    )


SHAPES = {
    "sd35m": _real("sd35m", SD35M_TRANSFORMER, SD3_VAE, rounds=10, repeats=3, matmul_size=8192),
    "flux1dev": _real(
        "flux1dev",
        FLUX1_DEV_TRANSFORMER,
        FLUX_VAE,
        rounds=3,
        repeats=3,
        matmul_size=8192,
        guidance=3.5,
    ),
    # Batch 4, not the recipe's 12 (VeRL-Omni's micro-batch under FSDP on 4 GPUs): by the
    # memory estimate (benchmarks/results/memory_estimate.md) a MARBLE solve step at 12
    # fits no single GPU, at 4 an H200 with checkpointing.
    "qwen_image": _real(
        "qwen_image",
        QWEN_IMAGE_TRANSFORMER,
        QWEN_IMAGE_VAE,
        batch=4,
        rounds=3,
        repeats=3,
        matmul_size=8192,
    ),
    "small": Shape("small", "sd3", SMALL_TRANSFORMER, SMALL_VAE, 64, 9, 4, 8, 2, 2, 256, False),
    "flux1dev_small": Shape(
        "flux1dev_small",
        "flux",
        SMALL_FLUX_TRANSFORMER,
        SMALL_FLUX_VAE,
        64,
        9,
        0,
        8,
        2,
        2,
        256,
        False,
        lora_rank=RECIPES["flux1dev"].lora_rank,
        guidance=3.5,
    ),
    "qwen_image_small": Shape(
        "qwen_image_small",
        "qwen_image",
        SMALL_QWEN_TRANSFORMER,
        SMALL_QWEN_VAE,
        64,
        9,
        0,
        8,
        2,
        2,
        256,
        False,
        lora_rank=RECIPES["qwen_image"].lora_rank,
    ),
}


# Each released-size shape's CPU smoke run.
SMALL_OF = {"sd35m": "small", "flux1dev": "flux1dev_small", "qwen_image": "qwen_image_small"}


def lora_source(shape: Shape) -> str:
    """Where the shape's LoRA rank comes from: its family's recipe, or the NFT recipe's."""
    if shape.lora_rank is None:
        return str(RECIPE.relative_to(REPO))
    real = next(name for name, small in SMALL_OF.items() if shape.name in (name, small))
    return RECIPES[real].source


# ----------------------------------------------------------------- stand-in rewards
@register_reward
class StandinBrightness(Reward):
    """Mean pixel value. Stand-ins are cheap image statistics on the images' own device:
    they exercise the reward path of the loop without the cost of a reward model."""

    name = "standin_brightness"
    value_range = (0.0, 1.0)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None):
        return images.float().mean(dim=(1, 2, 3))


@register_reward
class StandinSaturation(Reward):
    """Mean channel spread (max - min)."""

    name = "standin_saturation"
    value_range = (0.0, 1.0)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None):
        images = images.float()
        return (images.amax(dim=1) - images.amin(dim=1)).mean(dim=(1, 2))


@register_reward
class StandinContrast(Reward):
    """Standard deviation of the pixel values."""

    name = "standin_contrast"
    value_range = (0.0, 1.0)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None):
        return images.float().flatten(1).std(dim=1)


@register_reward
class StandinRedness(Reward):
    """Red minus the mean of green and blue."""

    name = "standin_redness"
    value_range = (-1.0, 1.0)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None):
        images = images.float()
        return (images[:, 0] - images[:, 1:].mean(dim=1)).mean(dim=(1, 2))


@register_reward
class StandinEdges(Reward):
    """Mean absolute difference of neighbouring pixels."""

    name = "standin_edges"
    value_range = (0.0, 1.0)

    def score(self, images: torch.Tensor, prompts: list[str], metadata: Metadata | None):
        images = images.float()
        dx = (images[..., 1:] - images[..., :-1]).abs().mean(dim=(1, 2, 3))
        dy = (images[..., 1:, :] - images[..., :-1, :]).abs().mean(dim=(1, 2, 3))
        return (dx + dy) / 2


STANDIN_REWARDS = tuple(
    cls.name
    for cls in (
        StandinBrightness,
        StandinSaturation,
        StandinContrast,
        StandinRedness,
        StandinEdges,
    )
)


# ----------------------------------------------------------------- model and trainer
class RandomTextEmbeddings:
    """Replaces ``Policy.encode_prompts``: text-encoder outputs of the real shapes, random.

    The benchmark times the transformer and the VAE; running the text encoders would add
    a constant per prompt that the recipes pay once per group of 16 to 24 images.
    """

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.shape = shape
        self.device = device
        self.dtype = dtype
        self.generator = torch.Generator(device).manual_seed(0)

    def __call__(self, prompts: list[str], max_sequence_length: int = 256) -> PromptEmbeddings:
        rows, tokens = len(prompts), self.shape.clip_tokens + max_sequence_length
        hidden = (rows, tokens, self.shape.text_width)
        embeds = torch.randn(hidden, generator=self.generator, device=self.device)
        if self.shape.pooled_width is None:  # Qwen-Image: a token mask, no pooled rows
            mask = torch.ones(rows, tokens, dtype=torch.long, device=self.device)
            return PromptEmbeddings(embeds.to(self.dtype), mask=mask)
        pooled = (rows, self.shape.pooled_width)
        return PromptEmbeddings(
            embeds.to(self.dtype),
            torch.randn(pooled, generator=self.generator, device=self.device).to(self.dtype),
        )

    def describe(self) -> str:
        parts = PARTS[self.shape.family]
        tokens = self.shape.clip_tokens + self.shape.text_tokens
        text = (
            "precomputed random embeddings of the real shapes, no text encoder run: "
            f"hidden states [B, {tokens} {parts.token_source} tokens, {self.shape.text_width}]"
        )
        if parts.pooled_source is None:
            return f"{text} with an all-ones token mask."
        return f"{text}, pooled [B, {self.shape.pooled_width}] ({parts.pooled_source})."


def build_pipeline(shape: Shape, device: torch.device, dtype: torch.dtype):
    """The family's pipeline of ``shape`` with random weights, built on ``device``."""
    import diffusers

    parts = PARTS[shape.family]
    torch.manual_seed(0)
    with torch.device(device), default_dtype(dtype):  # initialising on the GPU takes seconds
        transformer = getattr(diffusers, parts.transformer_class)(**shape.transformer).to(dtype)
        vae = getattr(diffusers, parts.vae_class)(**shape.vae).to(dtype)
    return family_named(shape.family).pipeline_class()(
        transformer=transformer,
        vae=vae,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**parts.scheduler),
        **dict.fromkeys(parts.absent),
    )


def recipe_config(
    args: argparse.Namespace, shape: Shape, run_dir: Path, strategy: str, world_size: int = 1
) -> TrainingConfig:
    """The MARBLE recipe's config with this benchmark's model, rewards and batch sizes."""
    rewards = "rewards=[" + ", ".join(f"{{name: {name}}}" for name in STANDIN_REWARDS) + "]"
    model = [f"model.path={run_dir / STANDIN_PIPELINE}", f"model.family={shape.family}"]
    if shape.guidance is not None:
        model.append(f"model.guidance={shape.guidance}")
    if shape.lora_rank is not None:  # another family: its rank, and its own targets
        model += [
            f"lora.rank={shape.lora_rank}",
            f"lora.alpha={2 * shape.lora_rank}",
            "lora.target_modules=null",
        ]
    overrides = [
        *model,
        f"model.dtype={args.dtype}",
        "model.gradient_checkpointing=false",  # toggled per measurement
        f"prompts.directory={run_dir}",
        f"prompts.sources=[{{name: standin, file: {PROMPT_FILE}}}]",
        rewards,
        f"rollout.resolution={shape.resolution}",
        f"rollout.steps={args.train_sampling_steps}",
        f"rollout.images_per_prompt={args.batch}",
        f"rollout.prompts_per_epoch={args.accumulation * world_size}",
        f"rollout.batch_size={args.batch}",
        f"rollout.max_sequence_length={shape.text_tokens}",
        f"train.batch_size={args.batch}",
        f"train.gradient_accumulation={args.accumulation}",
        "train.epochs=1000000",
        f"run.directory={run_dir}",
        "run.quiet=true",
        *STRATEGIES[strategy],
    ]
    return load_config(RECIPE, overrides, world_size=world_size)


def build_trainer(
    args: argparse.Namespace, shape: Shape, world: World, run_dir: Path
) -> tuple[Trainer, dict[str, Strategy]]:
    """The real Trainer on the in-memory model, and one fresh Strategy per compared name.

    The trainer reads the model's family from ``model_index.json`` before loading, so
    ``model.path`` is a directory holding only that file; the pipeline itself is built
    in memory and handed to ``Policy.load`` in place of loading one.
    """
    dtype = getattr(torch, args.dtype)
    (run_dir / PROMPT_FILE).write_text("\n".join(STANDIN_PROMPTS) + "\n")
    family = family_named(shape.family)
    index = run_dir / STANDIN_PIPELINE / "model_index.json"
    index.parent.mkdir(exist_ok=True)
    index.write_text(json.dumps({"_class_name": family.pipeline_class_name}))
    pipeline = build_pipeline(shape, world.device, dtype)
    loaded = (pipeline, family)
    with mock.patch.object(policy_module, "load_pipeline", lambda path, dtype, family: loaded):
        trainer = Trainer(recipe_config(args, shape, run_dir, BASELINE, world.size), world)
    trainer.policy.encode_prompts = RandomTextEmbeddings(shape, world.device, dtype)
    return trainer, make_strategies(args, shape, run_dir, trainer, world.size)


def make_strategies(
    args: argparse.Namespace, shape: Shape, run_dir: Path, trainer: Trainer, world_size: int
) -> dict[str, Strategy]:
    """Fresh strategies (empty MARBLE caches), built by the trainer's own factory."""
    return {
        name: make_strategy(args, shape, run_dir, trainer, name, world_size) for name in STRATEGIES
    }


def make_strategy(
    args: argparse.Namespace,
    shape: Shape,
    run_dir: Path,
    trainer: Trainer,
    name: str,
    world_size: int = 1,
) -> Strategy:
    """One row's fresh strategy (an empty MARBLE cache)."""
    config = recipe_config(args, shape, run_dir, name, world_size)
    return build_strategy(config.strategy.name, config.strategy.settings, trainer.reward_names)


# ------------------------------------------------------------------------ timing
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, function: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) with the device drained on both sides: GPU work is asynchronous."""
    synchronize(device)
    started = time.perf_counter()
    result = function()
    synchronize(device)
    return result, time.perf_counter() - started


def peak_rss_gib() -> float:
    """This process's lifetime RSS high-water mark (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


# -------------------------------------------------- failures, time budget, results
Result = TypeVar("Result")


def describe_error(error: BaseException) -> str:
    """``Type: first line of the message``: enough to tell an OOM from a bug in a table."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


def attempt(function: Callable[[], Result]) -> tuple[Result | None, str | None]:
    """``(result, None)``, or ``(None, description)`` when ``function`` raised.

    One stage's or row's failure (an OOM at the released sizes, or any other error) is
    recorded where it happened and the run goes on: a lease must not lose the other rows.
    The GPU cache is emptied after the exception (and the tensors its traceback held) is
    gone, so that the next row starts from the memory an OOM left behind.
    """
    try:
        return function(), None
    except Exception as error:
        failure = describe_error(error)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    return None, failure


@dataclass
class Budget:
    """The run's wall-clock allowance (--budget): work that would overrun it is not started,
    and the first thing left out is recorded as the reason the run stopped early."""

    seconds: float = math.inf
    started: float = field(default_factory=time.perf_counter)
    stopped: str | None = None

    def remaining(self) -> float:
        return self.seconds - (time.perf_counter() - self.started)

    def allows(self, what: str, estimate_s: float = 0.0, reserve_s: float = 0.0) -> bool:
        """Whether ``what`` (about ``estimate_s``) fits, keeping ``reserve_s`` for later."""
        left = self.remaining()
        if estimate_s + reserve_s < left:
            return True
        if self.stopped is None:
            self.stopped = (
                f"{what} not started: about {estimate_s:.0f} s needed and {reserve_s:.0f} s "
                f"kept for the torchrun check, {max(0.0, left):.0f} s left of the "
                f"{self.seconds:.0f} s budget"
            )
        return False


def ddp_reserve(args: argparse.Namespace, build_s: float, longest_epoch_s: float) -> float:
    """Seconds kept back for the torchrun check at the end: a process start, a model build
    and two epochs, at most its timeout; nothing when it is skipped."""
    if args.skip_ddp:
        return 0.0
    return min(float(args.ddp_timeout), DDP_STARTUP_S + build_s + 2 * longest_epoch_s)


def write_atomically(path: Path, text: str) -> None:
    """Replace ``path`` in one rename: a run killed mid-write leaves the previous version."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)


class Report:
    """The payload, rewritten as JSON and markdown after every stage and training epoch, so
    that a run killed at a lease's limit still returns what it measured."""

    def __init__(self, stem: Path, payload: dict[str, Any], budget: Budget) -> None:
        stem.parent.mkdir(parents=True, exist_ok=True)
        self.json_path, self.md_path = stem.with_suffix(".json"), stem.with_suffix(".md")
        self.payload = payload
        self.budget = budget

    def stage(self, text: str) -> None:
        """Log the stage with the run's clock, and record it as where the run got to."""
        print(f"[{time.perf_counter() - self.budget.started:6.1f} s] {text}", flush=True)
        self.payload["stage"] = text
        self.write()

    def run_stage(self, name: str, function: Callable[[], Result]) -> Result | None:
        """One stage whose failure is recorded under ``failures`` instead of ending the run."""
        self.stage(name)
        result, failure = attempt(function)
        if failure is not None:
            self.payload["failures"][name] = failure
            print(f"  {name} FAILED: {failure}", flush=True)
        self.write()
        return result

    def measure(self, key: str, name: str, function: Callable[[], Any]) -> None:
        """Stage ``name`` into ``payload[key]``, unless the budget has no time left."""
        if self.budget.allows(name):
            self.payload[key] = self.run_stage(name, function)

    def write(self) -> None:
        self.payload["stopped_early"] = self.budget.stopped
        self.payload["total_seconds"] = time.perf_counter() - self.budget.started
        payload = with_summaries(self.payload)
        write_atomically(
            self.json_path, json.dumps(_compact(payload), indent=2, default=str) + "\n"
        )
        write_atomically(self.md_path, render_markdown(payload).rstrip() + "\n")


def count_flops(function: Callable[[], Any]) -> dict[str, Any]:
    """FLOPs of one call by ``FlopCounterMode``, and whether attention kernels were counted.

    The counter knows the CUDA SDPA kernels (flash, memory-efficient, cuDNN) but not the
    CPU one, so a CPU count leaves attention out.
    """
    with FlopCounterMode(display=False) as counter:
        function()
    by_op = counter.get_flop_counts().get("Global", {})
    attention = sum(count for op, count in by_op.items() if "attention" in str(op))
    return {"flops": int(counter.get_total_flops()), "attention_flops": int(attention)}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int) -> dict[str, Any]:
    """Best achieved TFLOP/s of a square matmul: the denominator of every MFU here."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    iterations = 20 if device.type == "cuda" else 3
    for _ in range(3):
        torch.matmul(a, b)
    best = math.inf
    for _ in range(5):
        _, seconds = timed(device, lambda: [torch.matmul(a, b) for _ in range(iterations)])
        best = min(best, seconds / iterations)
    return {
        "size": size,
        "dtype": str(dtype).removeprefix("torch."),
        "seconds_per_matmul": best,
        "tflops": 2 * size**3 / best / 1e12,
    }


# ----------------------------------------------------------------------- rollout
def measure_rollout(
    trainer: Trainer, args: argparse.Namespace, shape: Shape, peak_tflops: float | None
) -> dict[str, Any]:
    """Images/s of ``rollout`` (sampler + VAE decode) at each step count, and its MFU (None
    without a measured peak)."""
    policy = trainer.policy
    device = trainer.world.device
    embeds = policy.encode_prompts(["x"] * args.batch, shape.text_tokens)
    latents = torch.randn(args.batch, *policy.latent_shape(shape.resolution), device=device)
    with torch.no_grad():
        forward = count_flops(lambda: policy.velocity(latents.to(policy.dtype), 0.5, embeds, "old"))
        decode = count_flops(lambda: policy.decode(latents))
    timed(device, lambda: policy.decode(latents))  # warm-up
    decode_times = [timed(device, lambda: policy.decode(latents))[1] for _ in range(args.repeats)]
    results: dict[str, Any] = {
        "batch": args.batch,
        "forward_flops_per_image": forward["flops"] / args.batch,
        "forward_attention_flops_per_image": forward["attention_flops"] / args.batch,
        "decode_flops_per_image": decode["flops"] / args.batch,
        "vae_decode": {
            "seconds_per_batch": statistics.median(decode_times),
            "images_per_s": args.batch / statistics.median(decode_times),
        },
        "steps": {},
    }
    for steps in args.rollout_steps:

        def sample(steps: int = steps) -> Any:
            return rollout(
                policy,
                ["stand-in prompt"],
                images_per_prompt=args.batch,
                steps=steps,
                resolution=shape.resolution,
                generator=torch.Generator().manual_seed(steps),
                adapter="old",
                batch_size=args.batch,
                max_sequence_length=shape.text_tokens,
            )

        sample()  # warm-up: kernel selection, allocator
        seconds = statistics.median(timed(device, sample)[1] for _ in range(args.repeats))
        tflops = (steps * forward["flops"] + decode["flops"]) / seconds / 1e12  # one batch
        results["steps"][str(steps)] = {
            "seconds_per_batch": seconds,
            "images_per_s": args.batch / seconds,
            "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None,
            "decode_share": results["vae_decode"]["seconds_per_batch"] / seconds,
        }
        print(f"  rollout {steps} steps: {args.batch / seconds:.3g} images/s", flush=True)
    return results


# ---------------------------------------------------------------------- training
def training_pass_flops(trainer: Trainer, args: argparse.Namespace, shape: Shape) -> dict:
    """FLOPs of one sample x one timestep of the NFT loss, both backward kinds.

    ``combined``: old, reference and trained forwards plus one backward of the weighted
    loss (weighted sum, cached MARBLE steps); ``per_objective``: the same forwards plus
    the K-row batched backward of a MARBLE full-solve step. Counted without gradient
    checkpointing, so the recomputed forward is not counted as useful work, and on one
    sample (samples do not interact), which keeps that within memory at the released
    sizes.
    """
    policy = trainer.policy
    device = trainer.world.device
    count = len(trainer.reward_names)
    batch = NFTRollout(  # one trained timestep per sample: FLOPs of one noise level
        prompts=["x"],
        group_ids=torch.zeros(1, dtype=torch.long),
        images=torch.zeros(1, 3, 1, 1),
        latents=torch.randn(1, *policy.latent_shape(shape.resolution), device=device),
        embeds=policy.encode_prompts(["x"], shape.text_tokens),
        sigmas=policy.sigmas(args.train_sampling_steps, shape.resolution),
        timesteps=1,
    )
    piece = TrainPiece(batch, torch.randn(1, count).clamp(-2, 2))
    combined_piece = dataclasses.replace(piece, advantages=piece.advantages[:, :1])

    def backward(piece: TrainPiece, weights: torch.Tensor | None, k: int) -> None:
        generator = torch.Generator().manual_seed(0)
        stream = trainer.objective.losses(policy, [piece], generator, StepMetrics())
        accumulate_gradients(stream, trainer.parameters, weights, k)

    combined = count_flops(lambda: backward(combined_piece, torch.ones(1, dtype=torch.float64), 1))
    per_objective, fallbacks = vmap_fallbacks(
        lambda: count_flops(lambda: backward(piece, None, count))
    )
    trainer.optimizer.zero_grad(set_to_none=True)
    return {
        "combined_per_sample_timestep": combined["flops"],
        "per_objective_per_sample_timestep": per_objective["flops"],
        "attention_flops_counted": combined["attention_flops"] > 0,
        "k_backward_vmap_fallbacks": fallbacks,
    }


def vmap_fallbacks(function: Callable[[], Any]) -> tuple[Any, list[str]]:
    """``function()``'s result and the ops its vmapped (K-backward) passes ran one row at
    a time, for want of a batching rule: each such op is a loop over the K objectives
    inside the batched backward (on the CPU: the attention, GELU and layer-norm backwards)."""
    torch._C._debug_only_display_vmap_fallback_warnings(True)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = function()
    finally:
        torch._C._debug_only_display_vmap_fallback_warnings(False)
    found = (re.search(r"batching rule for ([\w:.]+?)\. ", str(w.message)) for w in caught)
    return result, sorted({match.group(1) for match in found if match})


def set_checkpointing(trainer: Trainer, enabled: bool) -> None:
    transformer = trainer.policy.transformer
    if enabled:
        transformer.enable_gradient_checkpointing()
    else:
        transformer.disable_gradient_checkpointing()


@dataclass
class StepTimer(TrainerCallback):
    """Synchronized seconds of every optimizer step of ``trainer`` (a callback it calls)."""

    trainer: Trainer
    steps: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.trainer.callbacks = (*self.trainer.callbacks, self)
        self._started = 0.0

    def on_step_start(self, trainer: Trainer, step: list[TrainPiece]) -> None:
        synchronize(trainer.world.device)
        self._started = time.perf_counter()

    def on_step_end(self, trainer: Trainer, step: list[TrainPiece], record: dict[str, Any]) -> None:
        synchronize(trainer.world.device)
        self.steps.append(
            {
                "seconds": time.perf_counter() - self._started,
                "solved": int(record[keys.SOLVED]),
                "fallback": record[keys.FALLBACK],
                "engine": record.get("engine"),  # solve steps: rows or batched
                "sample_timesteps": sum(len(p) * p.data.timesteps for p in step),
            }
        )


def run_epoch(
    trainer: Trainer, timer: StepTimer, strategy: Strategy, gradients: GradientEngine | None = None
) -> dict[str, Any]:
    """One real ``train_epoch`` under ``strategy`` (and ``gradients``' engine): epoch,
    rollout and per-step times, memory."""
    device = trainer.world.device
    trainer.strategy = strategy
    trainer.harmonized.weigh = strategy.weights
    if gradients is not None:
        trainer.harmonized.engine = gradients
    timer.steps = []
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    resident = torch.cuda.memory_allocated(device) / 2**30 if device.type == "cuda" else None
    record, seconds = timed(device, trainer.train_epoch)
    trainer.epoch += 1
    return {
        "epoch_s": seconds,
        "rollout_s": record[keys.ROLLOUT_TIME],
        "reward_s": record[keys.REWARD_TIME],
        "train_s": sum(step["seconds"] for step in timer.steps),
        "steps": timer.steps,
        # Training-phase peak: the trainer resets the peak right before its optimizer steps.
        "peak_memory_gib": record.get(keys.PEAK_MEMORY, peak_rss_gib()),
        "resident_gib": resident,
        "objectives_without_signal": record[keys.OBJECTIVES_WITHOUT_SIGNAL],
    }


@dataclass
class ModeRows:
    """One checkpointing mode's rows: strategies, gradient engines, epochs and failures."""

    checkpointing: bool
    strategies: dict[str, Strategy]
    engines: dict[str, GradientEngine]
    epochs: list[dict[str, Any]] = field(default_factory=list)
    failed: set[str] = field(default_factory=set)

    @property
    def name(self) -> str:
        return f"checkpointing_{'on' if self.checkpointing else 'off'}"


def mode_rows(
    trainer: Trainer, args: argparse.Namespace, shape: Shape, run_dir: Path
) -> list[ModeRows]:
    """Each measured checkpointing mode with fresh strategies and both gradient engines."""
    modes = {"both": (False, True), "on": (True,), "off": (False,)}[args.checkpointing]
    return [
        ModeRows(
            checkpointing,
            make_strategies(args, shape, run_dir, trainer, 1),
            {
                engine: GradientEngine(
                    trainer.policy.transformer,
                    trainer.parameters,
                    engine,
                    compute_dtype=getattr(torch, args.dtype),
                )
                for engine in ("auto", "batched")
            },
        )
        for checkpointing in modes
    ]


def rotated(items: list, shift: int) -> list:
    return items[shift % len(items) :] + items[: shift % len(items)]


def measure_training(
    trainer: Trainer,
    args: argparse.Namespace,
    shape: Shape,
    run_dir: Path,
    report: Report,
    build_s: float,
) -> None:
    """Every row under every checkpointing mode, interleaved per epoch in rotated order,
    round after round until ``args.rounds`` or the budget; each epoch (or a row's failure)
    goes into the report as it ends.

    Round 0 is the warm-up. At round 1 the amortized rows get a fresh cache, so that
    their measured window starts with a solve step (see ``summarize_row``).
    """
    timer = StepTimer(trainer)
    names = list(STRATEGIES)
    modes = mode_rows(trainer, args, shape, run_dir)
    for mode in modes:
        report.payload["training"][mode.name] = {"epochs": mode.epochs}
    round_s = 0.0  # the last round's seconds: the estimate of the next one
    total = len(modes) * (1 + args.rounds) * len(names)
    with tqdm(total=total, desc="training epochs", file=sys.stdout) as bar:
        for round_index in range(1 + args.rounds):
            epochs = (e for mode in modes for e in mode.epochs if "epoch_s" in e)
            reserve = ddp_reserve(args, build_s, max((e["epoch_s"] for e in epochs), default=0))
            if not report.budget.allows(f"training round {round_index}", round_s, reserve):
                break
            if round_index == 1:
                for mode in modes:
                    empty_amortized_caches(mode, args, shape, run_dir, trainer)
            started = time.perf_counter()
            for mode in rotated(modes, round_index):
                set_checkpointing(trainer, mode.checkpointing)
                for name in rotated(names, round_index):
                    bar.set_postfix_str(f"{mode.name} {name}")
                    bar.update(1)
                    if name not in mode.failed:
                        mode.epochs.append(
                            measure_row_epoch(trainer, timer, mode, name, round_index)
                        )
                        report.write()
            round_s = time.perf_counter() - started
    set_checkpointing(trainer, False)


def empty_amortized_caches(
    mode: ModeRows, args: argparse.Namespace, shape: Shape, run_dir: Path, trainer: Trainer
) -> None:
    """Fresh strategies for the rows that solve every N > 1 steps: with one optimizer step
    per epoch, their measured window then starts with a solve instead of holding none."""
    for name, strategy in mode.strategies.items():
        if strategy.amortizer.period > 1:
            mode.strategies[name] = make_strategy(args, shape, run_dir, trainer, name)


def measure_row_epoch(
    trainer: Trainer, timer: StepTimer, mode: ModeRows, name: str, round_index: int
) -> dict[str, Any]:
    """One epoch of row ``name``; a failure (any exception) is that row's and ends it."""
    strategy = mode.strategies[name]
    gradients = mode.engines[ROWS[name][1]]
    epoch, failure = attempt(lambda: run_epoch(trainer, timer, strategy, gradients))
    row = {"strategy": name, "round": round_index, "period": strategy.amortizer.period}
    if failure is None:
        return {**row, **epoch}
    mode.failed.add(name)
    trainer.optimizer.zero_grad(set_to_none=True)
    print(f"  {mode.name} {name} FAILED: {failure}", flush=True)
    return {**row, "error": failure}


def summarize_training(
    epochs: list[dict[str, Any]], flops: dict[str, Any] | None, peak_tflops: float | None
) -> dict[str, dict[str, Any]]:
    """Per row over the measured rounds: seconds, MFU, memory, solved steps."""
    summary: dict[str, dict[str, Any]] = {}
    for name in STRATEGIES:
        mine = [e for e in epochs if e["strategy"] == name]
        errors = [e["error"] for e in mine if "error" in e]
        measured = [e for e in mine if "error" not in e and e["round"] > 0]
        if errors or not any(e["steps"] for e in measured):
            summary[name] = {"error": errors[0] if errors else "no measured optimizer step"}
        else:
            summary[name] = summarize_row(measured, flops, peak_tflops)
    return summary


def amortized_cycle(period: int, solved: list[float], cached: list[float]) -> float | None:
    """Mean seconds per optimizer step over one N-step cycle, ``(t_solve + (N-1) t_cached) / N``
    from measured step times; None for an every-step row or when either kind is missing."""
    if period <= 1 or not solved or not cached:
        return None
    return (statistics.mean(solved) + (period - 1) * statistics.mean(cached)) / period


def summarize_row(
    measured: list[dict[str, Any]], flops: dict[str, Any] | None, peak_tflops: float | None
) -> dict[str, Any]:
    """One row's measured epochs. An amortized row (N > 1) reports the N-step cycle of its
    own solve and cached steps: its window of a few rounds holds far more than 1/N solves
    (the first measured step is one), so the window's mean would overstate its step time."""
    steps = [step for e in measured for step in e["steps"]]
    solved = [step["seconds"] for step in steps if step["solved"]]
    cached = [step["seconds"] for step in steps if not step["solved"]]
    period = measured[0]["period"]
    window_step_s = sum(solved + cached) / len(steps)
    window_epoch_s = statistics.mean(e["epoch_s"] for e in measured)
    cycle_s = amortized_cycle(period, solved, cached)
    step_s = window_step_s if cycle_s is None else cycle_s
    outside_steps_s = statistics.mean(e["epoch_s"] - e["train_s"] for e in measured)
    steps_per_epoch = len(steps) / len(measured)
    epoch_s = window_epoch_s if cycle_s is None else outside_steps_s + steps_per_epoch * cycle_s
    sample_timesteps = sum(step["sample_timesteps"] for step in steps) / len(steps)
    useful = flops["combined_per_sample_timestep"] if flops else None
    tflops = useful * sample_timesteps / step_s / 1e12 if useful else None
    return {
        "epochs": len(measured),
        "optimizer_steps": len(steps),
        "solved_steps": len(solved),
        "solve_period": period,
        "throughput_basis": throughput_basis(period, cycle_s),
        "engines": sorted({step["engine"] for step in steps if step["engine"]}),
        "fallbacks": sum(1 for step in steps if step["fallback"]),
        "sample_timesteps_per_step": sample_timesteps,
        "s_per_optimizer_step": step_s,
        "s_per_sample_timestep": step_s / sample_timesteps,
        "window_s_per_optimizer_step": window_step_s,
        "mean_solved_step_s": statistics.mean(solved) if solved else None,
        "mean_cached_step_s": statistics.mean(cached) if cached else None,
        "median_solved_step_s": statistics.median(solved) if solved else None,
        "median_cached_step_s": statistics.median(cached) if cached else None,
        "epoch_s": epoch_s,
        "window_epoch_s": window_epoch_s,
        "rollout_s": statistics.mean(e["rollout_s"] for e in measured),
        "reward_s": statistics.mean(e["reward_s"] for e in measured),
        "training_tflops_useful": tflops,
        "training_mfu": tflops / peak_tflops if tflops and peak_tflops else None,
        "peak_memory_gib": max(e["peak_memory_gib"] for e in measured),
        "resident_gib": measured[0]["resident_gib"],
        "silent_objectives": sum(len(e["objectives_without_signal"]) for e in measured),
    }


NO_CYCLE = "no cycle: no cached step"


def throughput_basis(period: int, cycle_s: float | None) -> str:
    """What a row's step time is: the window's mean, or the N-step cycle of an amortized row
    (none without both a solve and a cached step measured)."""
    if period <= 1:
        return "window mean"
    if cycle_s is None:
        return NO_CYCLE
    return f"{period}-step cycle"


def training_ratios(summary: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Speed (baseline time / row time, > 1 faster) and memory against the weighted sum; an
    amortized row without its cycle has no speed ratio."""
    base = summary[BASELINE]
    ratios: dict[str, dict[str, float | None]] = {}
    for name, item in summary.items():
        if name == BASELINE or "error" in item or "error" in base:
            continue
        has_speed = item["throughput_basis"] != NO_CYCLE
        step_ratio = base["s_per_optimizer_step"] / item["s_per_optimizer_step"]
        epoch_ratio = base["epoch_s"] / item["epoch_s"]
        ratios[name] = {
            "train_throughput": step_ratio if has_speed else None,
            "epoch_throughput": epoch_ratio if has_speed else None,
            "peak_memory": item["peak_memory_gib"] / base["peak_memory_gib"],
        }
    return ratios


# --------------------------------------------------------------------------- DDP
@dataclass
class ProcessGroupWorld(World):
    """A one-rank World whose collectives still go through the process group.

    ``World`` skips every collective at size 1 (free and correct for a plain run); here
    the trainer's all-reduces, broadcasts and all-gathers must reach NCCL (gloo on CPU)
    to show that the distributed path works on this device. ``calls`` counts them.
    """

    calls: Counter = field(default_factory=Counter)

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls["all_reduce"] += 1
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor.div_(dist.get_world_size())

    def average_gradients(self, parameters: list[torch.Tensor]) -> None:
        write_gradient(parameters, self.average(flat_gradient(parameters)))

    def broadcast(self, tensor: torch.Tensor, source: int = 0) -> torch.Tensor:
        self.calls["broadcast"] += 1
        moved = tensor.to(self.device).clone()
        dist.broadcast(moved, src=source)
        return moved.to(tensor.device)

    def all_gather_rows(self, tensor: torch.Tensor) -> torch.Tensor:
        self.calls["all_gather"] += 1
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)


def ddp_child(args: argparse.Namespace) -> int:
    """Inside ``torchrun``: a weighted-sum and a MARBLE full-solve epoch over the group."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    started = time.perf_counter()
    world = ProcessGroupWorld(rank=dist.get_rank(), size=dist.get_world_size(), device=device)
    shape = SHAPES[args.shape]
    with tempfile.TemporaryDirectory(prefix="bench_gpu_ddp_") as tmp:
        trainer, strategies = build_trainer(args, shape, world, Path(tmp))
        set_checkpointing(trainer, True)  # as the recipes train; the collectives are checked
        timer = StepTimer(trainer)
        epochs = {
            name: run_epoch(trainer, timer, strategies[name])
            for name in (BASELINE, "marble_every_step")
        }
    finite = all(torch.isfinite(p).all() for p in trainer.parameters)
    report = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "collectives": dict(world.calls),
        "parameters_finite": bool(finite),
        "epochs": {
            name: {
                "epoch_s": e["epoch_s"],
                "solved_steps": sum(s["solved"] for s in e["steps"]),
                "steps": len(e["steps"]),
            }
            for name, e in epochs.items()
        },
        "seconds": time.perf_counter() - started,
    }
    dist.destroy_process_group()
    Path(args.ddp_child).write_text(json.dumps(report))
    return 0


def run_ddp_check(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``torchrun --nproc_per_node 1`` of this script's DDP child; its report or the error."""
    with tempfile.TemporaryDirectory(prefix="bench_gpu_ddp_") as tmp:
        report_path = Path(tmp) / "ddp.json"
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            str(Path(__file__).resolve()),
            "--ddp-child",
            str(report_path),
            *child_arguments(args, device),
        ]
        try:
            result = subprocess.run(
                command, capture_output=True, text=True, timeout=args.ddp_timeout
            )
        except subprocess.TimeoutExpired as error:
            output = _text(error.stdout) + _text(error.stderr)
            tail = f"timed out after {args.ddp_timeout} s (--ddp-timeout)\n{output[-2000:]}"
            return {"ok": False, "exit_code": None, "output_tail": tail}
        if result.returncode != 0 or not report_path.exists():
            tail = (result.stdout + result.stderr)[-2000:]
            return {"ok": False, "exit_code": result.returncode, "output_tail": tail}
        return {"ok": True, **json.loads(report_path.read_text())}


def _text(output: str | bytes | None) -> str:
    """A timed-out child's captured output: bytes even under ``text=True``, or None."""
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""


def child_arguments(args: argparse.Namespace, device: torch.device) -> list[str]:
    return [
        f"--shape={args.shape}",
        f"--device={device.type}",
        f"--dtype={args.dtype}",
        f"--batch={args.batch}",
        f"--accumulation={args.accumulation}",
        f"--train-sampling-steps={args.train_sampling_steps}",
        f"--threads={args.threads}",
    ]


# ------------------------------------------------------------------- environment
def device_info(device: torch.device) -> dict[str, Any]:
    """Name, driver and memory of the measured device; CPU runs say that they are CPU runs."""
    if device.type != "cuda":
        return {"type": "cpu", "name": machine_info()["cpu_model"], "slug": "cpu"}
    properties = torch.cuda.get_device_properties(device)
    info = {
        "type": "cuda",
        "name": properties.name,
        "slug": re.sub(r"[^a-z0-9]+", "-", properties.name.lower()).strip("-"),
        "memory_gib": properties.total_memory / 2**30,
        "compute_capability": f"{properties.major}.{properties.minor}",
        "cuda_runtime": torch.version.cuda,
        "driver": None,
    }
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        result = subprocess.run(query, capture_output=True, text=True)
        if result.returncode == 0:
            info["driver"] = result.stdout.strip().splitlines()[device.index or 0]
    return info


def versions() -> dict[str, str]:
    import diffusers
    import peft
    import transformers

    return {
        "torch": torch.__version__,
        "diffusers": diffusers.__version__,
        "peft": peft.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }


# ----------------------------------------------------------------------- targets
def targets(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue target with its measured value and where it stands."""
    rows = []
    for mode, block in payload["training"].items():
        ratios = block["ratios"]
        for name, key, paper in (
            ("marble_amortized", "throughput_target", "throughput_paper"),
            ("marble_every_step", "throughput_target", "throughput_paper"),
        ):
            basis = block["summary"][name].get("throughput_basis", "not measured")
            rows.append(
                {
                    "quantity": f"{LABELS[name]}: whole-training throughput vs weighted sum "
                    f"({mode.replace('_', ' ')}; {basis})",
                    "target": f">= {PAPER[name][key]:.2f}x",
                    "paper": f"{PAPER[name][paper]:.2f}x",
                    "value": ratios.get(name, {}).get("epoch_throughput"),
                    "at_least": PAPER[name][key],
                }
            )
            rows.append(
                {
                    "quantity": f"{LABELS[name]}: peak memory vs weighted sum "
                    f"({mode.replace('_', ' ')})",
                    "target": f"<= {PAPER['memory']['target']:.2f}x",
                    "paper": f"{PAPER['memory']['paper']:.2f}x",
                    "value": ratios.get(name, {}).get("peak_memory"),
                    "at_most": PAPER["memory"]["target"],
                }
            )
        for name in STRATEGIES:
            rows.append(
                {
                    "quantity": f"training MFU, {LABELS[name]} ({mode.replace('_', ' ')})",
                    "target": f">= {100 * TARGET_MFU['training']:.0f}%",
                    "paper": "-",
                    "value": block["summary"][name].get("training_mfu"),
                    "at_least": TARGET_MFU["training"],
                }
            )
    for steps, item in (payload["rollout"] or {}).get("steps", {}).items():
        rows.append(
            {
                "quantity": f"rollout MFU, {steps} sampler steps",
                "target": f">= {100 * TARGET_MFU['rollout']:.0f}%",
                "paper": "-",
                "value": item["mfu"],
                "at_least": TARGET_MFU["rollout"],
            }
        )
    for row in rows:
        value = row["value"]
        if payload["smoke_run"]:
            row["status"] = f"not assessed: {payload['smoke_label']}"
        elif value is None:
            row["status"] = "not measured"
        elif value >= row.get("at_least", -math.inf) and value <= row.get("at_most", math.inf):
            row["status"] = "met"
        else:
            row["status"] = "not met"
    return rows


# ---------------------------------------------------------------------- markdown
def _num(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}g}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}x"


def render_markdown(payload: dict[str, Any]) -> str:
    """The report, from whatever the payload holds so far (a stopped run's too)."""
    sections = (
        _header_lines(payload),
        _setup_lines(payload),
        _rollout_lines(payload),
        _training_lines(payload),
        _target_lines(payload),
        _ddp_lines(payload),
    )
    return "\n".join(line for section in sections for line in section)


def _header_lines(payload: dict[str, Any]) -> list[str]:
    device, shape = payload["device"], payload["shape"]
    lines = [f"# GPU benchmark: {shape['name']} shape on {device['name']}", ""]
    if payload["smoke_run"]:
        label = payload["smoke_label"]
        lines += [
            f"> **{label[0].upper()}{label[1:]}, not a result.** This ran to check that the "
            "script works end to end; the figures below say nothing about GPU throughput, "
            "MFU or memory at the benchmark's settings. The targets are not assessed.",
            "",
        ]
    if not payload["finished"]:
        lines += [
            f"> **Unfinished run.** Last written during the stage `{payload['stage']}`: the "
            "process was still running, or was killed or crashed there. Below is what it had "
            "measured by then.",
            "",
        ]
    if payload["stopped_early"]:
        lines += [
            f"> **Stopped early by the time budget** ({payload['budget_s']:.0f} s): "
            f"{payload['stopped_early']}. The figures come from the rounds that ran.",
            "",
        ]
    if payload["failures"]:
        failed = "; ".join(f"{stage}: {error}" for stage, error in payload["failures"].items())
        lines += [f"> **Failed stages** (the run went on without them): {failed}", ""]
    driver = device.get("driver") or "n/a"
    lines += [
        f"Device: {device['name']} ({device['type']}; driver {driver}); "
        + ", ".join(f"{k} {v}" for k, v in payload["versions"].items())
        + f"; git {payload['source']['git_head']}; {payload['date']}; "
        f"{payload['total_seconds']:.0f} s in all.",
        "",
    ]
    return lines


def _setup_lines(payload: dict[str, Any]) -> list[str]:
    shape, setup = payload["shape"], payload["setup"]
    if setup is None:
        return ["## Setup", "", "The model was not built (see the failed stages).", ""]
    lines = [
        "## Setup",
        "",
        f"- Model: `{setup['transformer_class']}` {shape['name']} shape, random weights "
        f"({setup['transformer_parameters'] / 1e9:.3g} B parameters), `{setup['vae_class']}` "
        f"({setup['vae_parameters'] / 1e6:.3g} M), {setup['dtype']}, {shape['resolution']} px "
        f"(latent {'x'.join(map(str, shape['latent']))}).",
        f"- Text conditioning: {setup['text_embeddings']}",
        f"- Rewards: {setup['rewards']}",
        f"- LoRA r={setup['lora']['rank']} alpha={setup['lora']['alpha']} on "
        f"{', '.join(setup['lora']['targets'])} ({setup['trainable_parameters'] / 1e6:.3g} M "
        f"trainable parameters), rank from {setup['lora']['source']}; optimizer and NFT "
        "settings from `configs/sd35m_marble_5r.yaml`.",
        f"- Batch {setup['batch']} per GPU, gradient accumulation {setup['accumulation']}; "
        f"training epochs sample with {setup['train_sampling_steps']} steps and train on "
        f"{setup.get('timesteps_per_sample') or '-'} timesteps per sample, one optimizer step "
        f"per epoch; up to {setup['rounds']} measured rounds after one warm-up round, rows "
        "and checkpointing modes interleaved per epoch in rotated order.",
        "",
    ]
    peak, flops = payload["peak_matmul"], payload["flops"]
    if peak is None:
        lines.append("Peak: not measured, so no MFU below.")
    else:
        lines.append(
            f"Peak: {peak['tflops']:.4g} TFLOP/s measured by a {peak['size']}^2 "
            f"{peak['dtype']} matmul; every MFU below is against it."
        )
    if flops is None:
        lines[-1] += " FLOPs: not counted, so no MFU below."
    else:
        lines[-1] += (
            " FLOPs: `FlopCounterMode` on one forward / one training pass"
            + (
                ""
                if flops["attention_flops_counted"]
                else " (attention kernels not counted on this device)"
            )
            + "."
        )
        fallbacks = flops.get("k_backward_vmap_fallbacks")
        if fallbacks is not None:
            lines += [
                "",
                "K backward passes (the batched engine) are one vmapped backward; ops without "
                "a batching rule run once per objective inside it: "
                + (", ".join(f"`{op}`" for op in fallbacks) or "none")
                + ".",
            ]
    return [*lines, ""]


def _rollout_lines(payload: dict[str, Any]) -> list[str]:
    if payload["rollout"] is None:
        return ["## Rollout", "", "Not measured.", ""]
    rows = [
        [
            steps,
            _num(item["images_per_s"]),
            _num(item["seconds_per_batch"]),
            _num(item["tflops"]),
            _pct(item["mfu"]),
            _pct(item["decode_share"]),
        ]
        for steps, item in payload["rollout"]["steps"].items()
    ]
    header = ["sampler steps", "images/s", "s per batch", "TFLOP/s", "MFU", "VAE decode share"]
    return ["## Rollout", "", markdown_table(header, rows), ""]


def _training_row(name: str, item: dict[str, Any], ratios: dict[str, Any]) -> list[str]:
    if "error" in item:
        return [LABELS[name], item["error"], *["-"] * 8]
    same = {"train_throughput": 1.0, "epoch_throughput": 1.0, "peak_memory": 1.0}
    ratio = same if name == BASELINE else ratios.get(name, {})
    return [
        LABELS[name],
        _num(item["s_per_optimizer_step"]),
        _num(item["s_per_sample_timestep"]),
        _pct(item["training_mfu"]),
        f"{_num(item['epoch_s'])} ({_num(item['rollout_s'])} + {_num(item['reward_s'])})",
        _num(ratio.get("train_throughput")),
        _num(ratio.get("epoch_throughput")),
        f"{item['peak_memory_gib']:.2f} ({_ratio(ratio.get('peak_memory'))})",
        f"{item['solved_steps']}/{item['optimizer_steps']}",
        item["throughput_basis"],
    ]


def _engine_lines(summary: dict[str, Any]) -> list[str]:
    """A warning for each per-row row whose solve steps ran with K backward passes (the
    trainer falls back where the engine refuses a model): its figures are not the per-row
    engine's."""
    lines = []
    for name, item in summary.items():
        used = item.get("engines") or []
        if ROWS[name][1] == "auto" and used and used != ["rows"]:
            lines.append(
                f"**{LABELS[name]}: the per-row engine was refused and the trainer fell back; "
                f"its solve steps ran with the {', '.join(used)} engine (batched: K backward "
                "passes), so these figures are not the per-row engine's** (the reason is in "
                "the run's log)."
            )
    return [*lines, ""] if lines else []


def _training_lines(payload: dict[str, Any]) -> list[str]:
    lines = ["## Training", ""]
    if not payload["training"]:
        lines += ["Not measured.", ""]
    header = [
        "strategy",
        "s / optimizer step",
        "s / (sample, timestep)",
        "training MFU",
        "epoch s (rollout + rewards in it)",
        "x train throughput",
        "x whole-training throughput",
        "peak memory GiB (x)",
        "solved / measured steps",
        "time per step from",
    ]
    for mode, block in payload["training"].items():
        rows = [
            _training_row(name, item, block["ratios"]) for name, item in block["summary"].items()
        ]
        lines += [f"### {mode.replace('_', ' ')}", "", markdown_table(header, rows), ""]
        lines += _engine_lines(block["summary"])
    memory = "`torch.cuda.max_memory_allocated` over the optimizer steps (the trainer resets it"
    if payload["smoke_run"]:
        memory = "process peak RSS (`ru_maxrss`, lifetime high-water: not per strategy"
    lines += [
        f"Memory: {memory}). Training MFU counts useful FLOPs (old, reference and trained "
        "forwards plus one backward per (sample, timestep)) for every strategy, so it "
        "falls with any extra work: the per-reward backward, the solve, recomputation. "
        "Whole-training throughput: one epoch = rollout, rewards, advantages, the optimizer "
        "steps and the old-adapter update.",
        "",
        "Time per step: the mean over the measured window, except for the amortized rows "
        "(MARBLE solves every N = 10 steps). With one optimizer step per epoch their window "
        "of a few rounds cannot hold 1 solve in 10 steps, so their cache is emptied at the "
        "first measured round (the window starts with a solve) and their step time is the "
        "N-step cycle of their own measured steps, (mean solve step + 9 x mean cached step) "
        "/ 10; epoch time and MFU follow from it. The window's own mean is in the JSON "
        "(`window_s_per_optimizer_step`). With no cached step measured (one measured round) an "
        "amortized row has no cycle and no throughput ratio; its other figures are then "
        "those of its solve steps.",
        "",
    ]
    return lines


def _target_lines(payload: dict[str, Any]) -> list[str]:
    rows = [
        [
            row["quantity"],
            row["target"],
            row["paper"],
            _pct(row["value"]) if "MFU" in row["quantity"] else _ratio(row["value"]),
            row["status"],
        ]
        for row in payload["targets"]
    ]
    header = ["quantity", "target", "paper", "this run", "status"]
    table = markdown_table(header, rows) if rows else "Nothing measured to compare."
    return ["## Targets", "", table, ""]


def _ddp_lines(payload: dict[str, Any]) -> list[str]:
    lines = ["## Distributed path", ""]
    ddp = payload["ddp"]
    if ddp is None:
        return [*lines, "Not reached: it runs last."]
    if "skipped" in ddp:
        return [*lines, f"Not run: {ddp['skipped']}."]
    if not ddp["ok"]:
        return [*lines, f"FAILED (exit {ddp['exit_code']}):\n\n```\n{ddp['output_tail']}\n```"]
    calls = ", ".join(f"{count} {op}" for op, count in sorted(ddp["collectives"].items()))
    return [
        *lines,
        f"`torchrun --nproc_per_node 1`: backend {ddp['backend']}, world size "
        f"{ddp['world_size']}; a weighted-sum and a MARBLE full-solve epoch ran with "
        f"{calls} through the process group; parameters finite: "
        f"{ddp['parameters_finite']}.",
    ]


# ------------------------------------------------------------------------ results
def with_summaries(payload: dict[str, Any]) -> dict[str, Any]:
    """The payload plus what is computed from its raw epochs: per-row summaries, ratios
    against the weighted sum, the timesteps per sample and the targets."""
    peak = (payload["peak_matmul"] or {}).get("tflops")
    training = {}
    for mode, block in payload["training"].items():
        summary = summarize_training(block["epochs"], payload["flops"], peak)
        training[mode] = {
            "summary": summary,
            "ratios": training_ratios(summary),
            "epochs": block["epochs"],
        }
    derived = {**payload, "training": training}
    steps = [s for b in training.values() for e in b["epochs"] for s in e.get("steps", [])]
    if payload["setup"] is not None and steps:
        samples = payload["setup"]["batch"] * payload["setup"]["accumulation"]
        timesteps = steps[0]["sample_timesteps"] // samples
        derived["setup"] = {**payload["setup"], "timesteps_per_sample": timesteps}
    derived["targets"] = targets(derived)
    return derived


def failures(payload: dict[str, Any]) -> list[str]:
    """Every failed stage and row of the run, one line each."""
    rows = [
        f"{mode} {epoch['strategy']}: {epoch['error']}"
        for mode, block in payload["training"].items()
        for epoch in block["epochs"]
        if "error" in epoch
    ]
    return [f"{stage}: {error}" for stage, error in payload["failures"].items()] + rows


def new_payload(
    args: argparse.Namespace, argv: list[str] | None, device: torch.device, shape: Shape
) -> dict[str, Any]:
    """The run's record before anything is measured; stages fill it in."""
    return {
        "benchmark": "gpu",
        "smoke_run": device.type != "cuda" or args.quick,
        "smoke_label": "CPU smoke run" if device.type != "cuda" else "quick smoke run",
        "finished": False,
        "stage": "starting",
        "stopped_early": None,
        "budget_s": args.budget,
        "failures": {},
        "device": device_info(device),
        "versions": versions(),
        "machine": machine_info(),
        "source": source_state(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "arguments": sys.argv[1:] if argv is None else argv,
        "shape": shape.describe(),
        "setup": None,
        "peak_matmul": None,
        "flops": None,
        "rollout": None,
        "training": {},
        "ddp": {"skipped": "--skip-ddp"} if args.skip_ddp else None,
        "total_seconds": 0.0,
    }


def describe_setup(trainer: Trainer, args: argparse.Namespace, shape: Shape) -> dict[str, Any]:
    """What was built and how it is trained: model sizes, LoRA, batch, stand-ins."""
    transformer = trainer.policy.transformer
    return {
        "dtype": args.dtype,
        "batch": args.batch,
        "accumulation": args.accumulation,
        "train_sampling_steps": args.train_sampling_steps,
        "timesteps_per_sample": None,  # read off the first measured step
        "rounds": args.rounds,
        "repeats": args.repeats,
        "lora": {
            "rank": trainer.config.lora.rank,
            "alpha": trainer.config.lora.alpha,
            "targets": list(trainer.policy.lora.target_modules),
            "source": lora_source(shape),
        },
        "trainable_parameters": sum(p.numel() for p in trainer.parameters),
        "transformer_parameters": sum(
            p.numel() for n, p in transformer.named_parameters() if "lora_" not in n
        ),
        "vae_parameters": sum(p.numel() for p in trainer.policy.pipeline.vae.parameters()),
        "transformer_class": type(transformer).__name__,
        "vae_class": type(trainer.policy.pipeline.vae).__name__,
        "text_embeddings": trainer.policy.encode_prompts.describe(),
        "rewards": (
            f"K = {len(STANDIN_REWARDS)} cheap stand-in image statistics "
            f"({', '.join(STANDIN_REWARDS)}), not reward models: they time the loop, "
            "not the scoring of PickScore, OCR or GenEval."
        ),
    }


# -------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="sd35m")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), help="default: bf16 on GPU")
    parser.add_argument(
        "--batch", type=int, help="images per GPU per micro-batch (default: the shape's recipe)"
    )
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    parser.add_argument(
        "--train-sampling-steps",
        type=int,
        help="sampler steps of the training epochs' rollouts (timesteps: int(0.99 x steps)); "
        f"default {TRAIN_SAMPLING_STEPS}",
    )
    parser.add_argument("--rounds", type=int, help="measured rounds (default: per shape)")
    parser.add_argument("--repeats", type=int, help="timed rollout repeats (default: per shape)")
    parser.add_argument("--checkpointing", choices=("both", "on", "off"), default="both")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run in seconds: batch 2, 2 sampler steps, one round, checkpointing "
        "on, no torchrun check (never a result)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds for the whole run: no stage or training round is started that would "
        "overrun it (time is kept for the torchrun check); the results say what was left out",
    )
    parser.add_argument("--strict", action="store_true", help="exit 1 when any stage or row failed")
    parser.add_argument(
        "--threads", type=int, default=THREADS, help="CPU runs: torch threads (shared-VM default)"
    )
    parser.add_argument("--skip-ddp", action="store_true")
    parser.add_argument("--ddp-timeout", type=int, default=600, help="seconds (default 600)")
    parser.add_argument("--out", type=Path, help=f"default {GPU_RESULTS} (CPU: {CPU_RESULTS})")
    parser.add_argument("--ddp-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    shape = SHAPES[args.shape]
    if shape.real and args.device == "cpu":
        parser.error(
            f"--shape {shape.name} has the released model's sizes and needs a CUDA device; "
            f"--shape {SMALL_OF[shape.name]} is its CPU smoke run"
        )
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    if args.quick:
        args.checkpointing, args.skip_ddp = "on", True
    quick = {"batch": 2, "train_sampling_steps": 2, "rounds": 1, "repeats": 1}
    defaults = {
        "batch": shape.batch,
        "train_sampling_steps": TRAIN_SAMPLING_STEPS,
        "rounds": shape.rounds,
        "repeats": shape.repeats,
    }
    for name, value in (quick if args.quick else defaults).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.rollout_steps = (args.train_sampling_steps,) if args.quick else ROLLOUT_STEPS
    return args


def measure_in_process(
    args: argparse.Namespace, shape: Shape, device: torch.device, run_dir: Path, report: Report
) -> None:
    """Every stage that runs on this process's trainer, in order, each within the budget.
    The trainer is gone when this returns, so the torchrun check after it has the GPU."""
    started = time.perf_counter()
    print(f"building the {shape.name} model on {device} ({args.dtype})", flush=True)
    world = World(rank=0, size=1, device=device)
    built = report.run_stage("model build", lambda: build_trainer(args, shape, world, run_dir))
    if built is None:
        return
    trainer, _ = built
    build_s = time.perf_counter() - started
    report.payload["setup"] = describe_setup(trainer, args, shape)
    reserve = ddp_reserve(args, build_s, 0.0)
    dtype = getattr(torch, args.dtype)
    report.measure(
        "peak_matmul", "matmul peak", lambda: measure_matmul_peak(device, dtype, shape.matmul_size)
    )
    report.measure("flops", "training FLOPs", lambda: training_pass_flops(trainer, args, shape))
    peak = (report.payload["peak_matmul"] or {}).get("tflops")
    report.measure("rollout", "rollout", lambda: measure_rollout(trainer, args, shape, peak))
    if report.budget.allows("training", reserve_s=reserve):
        report.run_stage(
            "training", lambda: measure_training(trainer, args, shape, run_dir, report, build_s)
        )


def run_ddp_stage(args: argparse.Namespace, device: torch.device, report: Report) -> None:
    """The torchrun check, last: it needs no result of the others, and a hang or a failure
    there cannot cost them."""
    if args.skip_ddp:
        return
    if not report.budget.allows("the torchrun check"):
        report.payload["ddp"] = {"skipped": "no time left in the budget"}
        return
    stage = "torchrun check"
    result = report.run_stage(stage, lambda: run_ddp_check(args, device))
    failure = report.payload["failures"].get(stage)
    report.payload["ddp"] = result or {"ok": False, "exit_code": None, "output_tail": failure}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.ddp_child:
        return ddp_child(args)
    budget = Budget(math.inf if args.budget is None else args.budget)
    device = torch.device(args.device)
    shape = SHAPES[args.shape]
    out = args.out or (GPU_RESULTS if device.type == "cuda" else CPU_RESULTS)
    payload = new_payload(args, argv, device, shape)
    report = Report(out / f"{shape.results_name}_{payload['device']['slug']}", payload, budget)
    with tempfile.TemporaryDirectory(prefix="bench_gpu_") as tmp:
        measure_in_process(args, shape, device, Path(tmp), report)
    gc.collect()  # the trainer and its callbacks hold each other
    if device.type == "cuda":
        torch.cuda.empty_cache()
    run_ddp_stage(args, device, report)
    payload["finished"] = True
    report.stage(f"done: wrote {report.json_path} and {report.md_path}")
    if budget.stopped:
        print(f"stopped early: {budget.stopped}", flush=True)
    failed = failures(payload)
    for line in failed:
        print(f"FAILED {line}", flush=True)
    if payload["setup"] is None or (args.strict and failed):
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
