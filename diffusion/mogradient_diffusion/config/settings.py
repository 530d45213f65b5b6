"""The sections of a run's configuration, as plain typed dataclasses.

The parts of the trainer read the sections they need from here (sampling its
``RolloutConfig``, objectives the rollout and train sections they check), while
``mogradient_diffusion.training_config`` assembles them into one ``TrainingConfig`` with
the objective's and the strategy's own settings, loads and validates it: the loader sits
above the parts, and none of them imports it. This room imports nothing else of the
package, so any part may read it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration problem, reported before any heavy work starts."""


@dataclass
class ModelConfig:
    path: str | None = None  # a saved diffusers pipeline; None = build the tiny SD3 one
    # auto = from the pipeline's class (model_index.json); or sd3 (SD3, SD3.5), flux
    # (FLUX.1 dev, schnell), qwen_image
    family: str = "auto"
    # Embedded (distilled) guidance of models that have one (FLUX.1-dev); None = none or
    # the family's default. Classifier-free guidance is rollout.guidance_scale.
    guidance: float | None = None
    dtype: str = "float32"  # float32 | bfloat16 | float16
    # true: float32 matmuls and convolutions on CUDA may round through TF32 (torch's
    # float32 matmul precision "high", cudnn.allow_tf32), as the MARBLE release sets;
    # false leaves torch's settings as they are.
    tf32: bool = False
    device: str = "auto"  # auto = cuda when available
    gradient_checkpointing: bool = False
    # none | fsdp2: under torchrun, shard the frozen transformer weights over the processes
    # (FSDP2); the LoRA adapters stay whole on every process, so per-reward gradients stay
    # exact and are averaged as without sharding.
    shard: str = "none"


@dataclass
class PromptSourceConfig:
    name: str
    file: str
    weight: float = 1.0


@dataclass
class PromptsConfig:
    directory: str | None = None  # None = the built-in miniature prompt list
    sources: list[PromptSourceConfig] = field(default_factory=list)


@dataclass
class RolloutConfig:
    resolution: int = 512
    steps: int = 10
    guidance_scale: float = 1.0
    sampler: str = "euler"  # euler | dpm2 | sde
    images_per_prompt: int = 24
    prompts_per_epoch: int = 48
    batch_size: int = 9  # images sampled at once per process
    max_sequence_length: int = 256
    # Score each sampled batch in a background thread while the next one samples.
    overlap_rewards: bool = False
    # Seconds each reward may take to score one batch (the epoch's images, or one sampled
    # batch with overlap_rewards) before the run stops naming it; null: no limit (each
    # reward then scores on the calling thread).
    reward_timeout: float | None = 1800.0


@dataclass
class TrainConfig:
    epochs: int = 100
    batch_size: int = 9  # samples per process per micro-batch
    gradient_accumulation: int = 1
    timestep_fraction: float = 0.99
    # Micro-batches hold whole prompt groups (groups in shuffled order) instead of rows
    # shuffled across groups; with the NFT objective's shared_noise, a group's rows then
    # share an optimizer step and their noise draws.
    group_batches: bool = False
    learning_rate: float = 3e-4
    adam_betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    ema_decay: float = 0.9
    # copy | linear | delayed_linear; MARBLE: linear capped at 0.95 (DiffusionNFT: 0.5).
    # old_cap: null keeps the schedule's own cap (linear 0.5, delayed_linear 0.999).
    old_schedule: str = "linear"
    old_cap: float | None = 0.95
    # Consecutive optimizer steps with non-finite gradients that are skipped before the
    # run stops (nothing non-finite is ever applied or checkpointed).
    max_nonfinite_steps: int = 3
    # Per-objective gradients on solve steps and in the conflict probe: auto = one
    # backward pass per row value of the losses where the model allows it (checked once
    # against K backward passes), batched = K backward passes (for comparison).
    gradient_engine: str = "auto"


# A reward's label ends up in metric names (``reward/<label>/mean``), split on "/".
LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclass
class RewardConfig:
    """One entry of ``rewards:``: the registered reward ``name``, its constructor
    ``options``, and the ``label`` the run knows it by (its metrics, advantages, strategy
    settings and checkpoints); the label defaults to the name, so that one reward listed
    twice (two ``remote`` servers) can be told apart."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    label: str | None = None

    def __post_init__(self) -> None:
        if self.label == self.name:  # the default written out: saved the same as left out
            self.label = None
        if self.label is not None and not (
            isinstance(self.label, str) and LABEL.fullmatch(self.label)
        ):
            raise ValueError(
                f"label must be letters, digits, '_', '-' or '.' (it names the reward's "
                f"metrics, reward/<label>/mean), got {self.label!r}"
            )

    @property
    def run_name(self) -> str:
        """The name the run uses for this reward: its label, else its registered name."""
        return self.label or self.name

    def to_dict(self) -> dict[str, Any]:
        """As saved in config.yaml and checkpoints: no label when it is the name, so runs
        saved before labels existed compare equal on resume."""
        label = {} if self.label is None else {"label": self.label}
        return {"name": self.name, **label, "options": dict(self.options)}


@dataclass
class RunConfig:
    directory: str = "runs/default"
    seed: int = 0
    checkpoint_every: int = 10
    keep_checkpoints: int = 2
    quiet: bool = False
    # Per-reward gradients on every optimizer step (any strategy, cached steps too), to log
    # cos(update, g_k) for the conflict statistics; costs K extra gradients per step.
    conflict_probe: bool = False
    # Where the records go: jsonl (metrics.jsonl, always kept: resume and plots read it),
    # tensorboard, wandb, mlflow (the last two need their extras), or a registered logger.
    loggers: list[str] = field(default_factory=lambda: ["jsonl", "tensorboard"])
    wandb_project: str = "mogradient-diffusion"
    wandb_mode: str = "offline"  # offline (<run>/wandb, `wandb sync` later) | online
    mlflow_tracking_uri: str | None = None  # None = a file store in <run>/mlruns
    mlflow_experiment: str = "mogradient-diffusion"
