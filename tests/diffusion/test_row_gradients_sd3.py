"""The per-row engine on the tiny SD3 transformer with peft LoRA, through each objective's
own loss stream (NFT, Flow-GRPO with CFG, SDPO pairs with CFG), in float64: the stack
equals K backward passes to round-off, with masks, two micro-batches and the KL term.

diffusers' RMSNorm (SD3's qk_norm) computes its variance in float32 whatever the input
dtype, so gradients through it round at float32 level, differently for the two engines'
cotangents. For float64 round-off the test swaps in the same norm kept in float64; the
model as shipped is compared at float32 round-off."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from diffusers.models.normalization import RMSNorm

from mogradient.engines import RowGradients, accumulate_gradients, flat_gradient
from mogradient_diffusion.objectives import StepMetrics, TrainPiece
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.trainer import Trainer
from mogradient_diffusion.training_config import load_config

from .rollouts import first_rollout

K = 5
OBJECTIVES = {
    "nft": ["objective.kl_coefficient=0.01"],
    # diffusers recomputes each block's forward in every backward pass: captured once
    "nft_checkpointed": ["objective.kl_coefficient=0.01", "model.gradient_checkpointing=true"],
    "flow_grpo": [
        "objective.name=flow_grpo",
        "rollout.sampler=sde",
        "rollout.guidance_scale=2.0",
        "objective.kl_coefficient=0.04",
    ],
    "sdpo": ["objective.name=sdpo", "rollout.sampler=sde", "rollout.guidance_scale=2.0"],
}


class Float64RMSNorm(torch.nn.Module):
    """diffusers' RMSNorm formula, x * rsqrt(mean(x^2) + eps) * weight, in the input dtype."""

    def __init__(self, norm: RMSNorm) -> None:
        super().__init__()
        self.eps, self.weight = norm.eps, norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + self.eps)
        return x if self.weight is None else x * self.weight


def _keep_norms_in_float64(module: torch.nn.Module) -> int:
    swapped = 0
    for name, child in list(module.named_modules()):
        if isinstance(child, RMSNorm):
            parent, _, attribute = name.rpartition(".")
            setattr(module.get_submodule(parent), attribute, Float64RMSNorm(child))
            swapped += 1
    return swapped


def _trainer_in_float64(
    tmp_path: Path, overrides: list[str], exact_norms: bool = True
) -> tuple[Trainer, object]:
    config = load_config(
        preset="tiny",
        overrides=[
            f"run.directory={tmp_path}",
            "run.quiet=true",
            "train.old_schedule=copy",
            *overrides,
        ],
    )
    trainer = Trainer(config, World(rank=0, size=1, device=torch.device("cpu")))
    trainer.policy.transformer.double()
    if exact_norms:
        assert _keep_norms_in_float64(trainer.policy.transformer) > 0
    torch.manual_seed(0)
    for parameter in trainer.parameters:  # default away from old: both NFT branches differ
        parameter.data.add_(0.05 * torch.randn_like(parameter))
    return trainer, _in_float64(first_rollout(trainer))


def _in_float64(value):
    """A rollout's float tensors in float64 (the sampler keeps latents in float32, and
    the losses compute in the latents' dtype)."""
    if isinstance(value, torch.Tensor):
        return value.double() if value.is_floating_point() else value
    if dataclasses.is_dataclass(value):
        fields = {f.name: _in_float64(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **fields)
    return value


def _advantages(batch, template_shape: tuple[int, ...]) -> torch.Tensor:
    """Random advantages of the objective's shape with K columns, some NaN, some clamped."""
    generator = torch.Generator().manual_seed(3)
    values = 3 * torch.randn(*template_shape[:-1], K, generator=generator)
    values[..., 1] = float("nan")  # a reward that applies nowhere
    values[0, ..., 2] = float("nan")  # and one that skips a row
    return values


def _both_engines(trainer: Trainer, batch, objective: str):
    """(K-backward stack, its .grad, per-row stack, its .grad) of one two-piece step."""
    rows = torch.arange(len(batch))
    shape = (len(batch), K)
    if objective == "sdpo":
        shape = (len(batch), len(batch.own.steps), K)
    advantages = _advantages(batch, shape)
    pieces = [rows[: len(rows) // 2], rows[len(rows) // 2 :]]  # gradient accumulation
    step = [TrainPiece(batch.rows(r), advantages[r]) for r in pieces]

    def stream():
        return trainer.objective.losses(
            trainer.policy, step, torch.Generator().manual_seed(1), StepMetrics()
        )

    results = []
    engine = RowGradients(trainer.policy.transformer, trainer.parameters)
    assert engine.supported
    for compute in (
        lambda: accumulate_gradients(stream(), trainer.parameters),
        lambda: engine.accumulate(stream()),
    ):
        for parameter in trainer.parameters:
            parameter.grad = None
        results += [compute(), flat_gradient(trainer.parameters).clone()]
    return results


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    scale = float(reference.abs().max())
    assert scale > 0 and reference.dtype == torch.float64
    return float((value - reference).abs().max()) / scale


@pytest.mark.slow
@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_stack_equals_k_backward_passes_on_tiny_sd3(tmp_path: Path, objective: str) -> None:
    trainer, batch = _trainer_in_float64(tmp_path, OBJECTIVES[objective])
    reference, reference_grad, stack, grad = _both_engines(trainer, batch, objective)
    assert _relative_error(stack, reference) <= 1e-12
    if objective != "sdpo":  # the KL term, outside the harmonization, went to .grad
        assert _relative_error(grad, reference_grad) <= 1e-12


@pytest.mark.slow
def test_with_the_shipped_float32_norms_within_float32_rounding(tmp_path: Path) -> None:
    trainer, batch = _trainer_in_float64(tmp_path, OBJECTIVES["flow_grpo"], exact_norms=False)
    reference, _, stack, _ = _both_engines(trainer, batch, "flow_grpo")
    assert _relative_error(stack, reference) <= 64 * torch.finfo(torch.float32).eps
