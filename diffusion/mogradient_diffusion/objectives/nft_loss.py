"""DiffusionNFT's loss as a CombinableLoss: shared branch errors, per-reward coefficients.

Sample i's loss for reward k is r_ki * P_i + (1 - r_ki) * N_i. The branch errors P, N come
from the trained and the old velocity only, so every reward shares them; the reward enters
through the constant ratio r_ki. Returning P, N as terms and the masked ratios as
coefficients lets MARBLE take K per-reward gradients, or one combined backward, from a
single forward pass, exactly (see ``mogradient.combinable``).

Conventions follow SD3 flow matching: x_t = (1 - t) x0 + t * noise, velocity target
noise - x0, so the implied clean sample is x0_hat = x_t - t * v.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from mogradient.combinable import CombinableLoss, RowValues, masked_mean_coefficients
from mogradient_diffusion.advantages import STD_MODES
from mogradient_diffusion.objectives.base import check_real

NFTForm = Literal["x0_adaptive", "velocity"]
FORMS: tuple[str, ...] = get_args(NFTForm)


@dataclass(frozen=True)
class NFTSettings:
    """DiffusionNFT's hyper-parameters (the ``objective:`` options of ``name: nft``).

    beta: strength of the implicit branches; the references use 1.0 for a single reward
        and 0.1 for OCR and multi-reward training (the default here, MARBLE's setting).
    a_max: advantage clip, and r = clip(1/2 + A / (2 a_max), 0, 1).
    form: "x0_adaptive" (the official code: x0-space squared error over a detached
        per-sample mean-abs error) or "velocity" (the paper's velocity MSE).
    kl_coefficient: weight of the squared velocity distance to the reference model; not
        harmonized. Named apart from ``beta``, which the official config reuses for it.
    adaptive_weight_floor: lower clip of the adaptive weight, so a perfect prediction
        does not divide by zero (official value 1e-5).
    advantage_std: "global" (the batch std, DiffusionNFT's default) or "group" (GRPO's).
    shared_noise: rows of one prompt group in an optimizer step share their noise levels
        and noise (common random numbers; the references draw them per row). Each row's
        draws keep their distribution, so the expected gradient is unchanged, while the
        parts of the rows' terms that the draw sets, alike across a group, cancel in the
        zero-sum group advantages. Pays off when steps hold whole groups
        (``train.group_batches``).
    """

    beta: float = 0.1
    a_max: float = 5.0
    form: NFTForm = "x0_adaptive"
    kl_coefficient: float = 1e-4
    adaptive_weight_floor: float = 1e-5
    advantage_std: str = "global"
    shared_noise: bool = False

    def __post_init__(self) -> None:
        check_real("beta", self.beta, low=0, open_low=True)
        check_real("a_max", self.a_max, low=0, open_low=True)
        check_real("kl_coefficient", self.kl_coefficient, low=0)
        check_real("adaptive_weight_floor", self.adaptive_weight_floor, low=0, open_low=True)
        if self.form not in FORMS:
            raise ValueError(f"form must be one of {list(FORMS)}, got {self.form!r}")
        if self.advantage_std not in STD_MODES:
            raise ValueError(
                f"advantage_std must be one of {list(STD_MODES)}, got {self.advantage_std!r}"
            )

    @property
    def scale(self) -> float:
        """The official a_max / beta: the gradient size then does not shrink with beta."""
        return self.a_max / self.beta


def nft_branch_velocities(
    v_theta: torch.Tensor, v_old: torch.Tensor, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Implicit positive and negative velocities; the old policy is a constant."""
    v_old = v_old.detach()
    return (1 - beta) * v_old + beta * v_theta, (1 + beta) * v_old - beta * v_theta


def _sample_mean(values: torch.Tensor) -> torch.Tensor:
    return values.flatten(1).mean(dim=1)


def _adaptive_squared_error(error: torch.Tensor, floor: float) -> torch.Tensor:
    """Per-sample MSE over the detached mean-abs error (in float64, as the official code)."""
    weight = _sample_mean(error.detach().double().abs()).clamp_min(floor)
    return _sample_mean(error.square()) / weight.to(error.dtype)


def _check_inputs(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    form: str,
) -> None:
    if v_theta.ndim < 2:
        raise ValueError(f"v_theta must have shape (B, ...), got {tuple(v_theta.shape)}")
    for name, tensor in (("v_old", v_old), ("x_t", x_t), ("x0", x0)):
        if tensor.shape != v_theta.shape:
            raise ValueError(
                f"{name} must have the shape of v_theta {tuple(v_theta.shape)}, "
                f"got {tuple(tensor.shape)}"
            )
    if sigmas.shape != v_theta.shape[:1]:
        raise ValueError(
            f"sigmas must have shape (B,) = {tuple(v_theta.shape[:1])}, got {tuple(sigmas.shape)}"
        )
    low_ok = sigmas > 0 if form == "velocity" else sigmas >= 0
    if not bool((low_ok & (sigmas <= 1)).all()):
        interval = "(0, 1] (the velocity form divides by t)" if form == "velocity" else "[0, 1]"
        raise ValueError(f"sigmas must lie in {interval}, got {sigmas.tolist()}")


def nft_branch_errors(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    config: NFTSettings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample positive and negative branch errors (B each), times ``config.scale``.

    Differentiable in ``v_theta`` only. Computed in at least float32, since squared-error
    means in half precision lose the small differences the loss is made of. The velocity
    form recovers the target noise - x0 as (x_t - x0) / t.
    """
    _check_inputs(v_theta, v_old, x_t, x0, sigmas, config.form)
    dtype = torch.promote_types(v_theta.dtype, torch.float32)
    x_t, x0 = x_t.detach().to(dtype), x0.detach().to(dtype)
    t = sigmas.detach().to(dtype).reshape(-1, *([1] * (x0.ndim - 1)))
    branches = nft_branch_velocities(v_theta.to(dtype), v_old.to(dtype), config.beta)
    if config.form == "x0_adaptive":
        errors = [
            _adaptive_squared_error(x_t - t * v - x0, config.adaptive_weight_floor)
            for v in branches
        ]
    else:
        target = (x_t - x0) / t
        errors = [_sample_mean((v - target).square()) for v in branches]
    return errors[0] * config.scale, errors[1] * config.scale


def nft_ratios(advantages: torch.Tensor, a_max: float) -> torch.Tensor:
    """r = clip(1/2 + A / (2 a_max), 0, 1); NaN (reward not applicable) stays NaN."""
    check_real("a_max", a_max, low=0, open_low=True)
    return (0.5 + advantages / (2 * a_max)).clamp(0.0, 1.0)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigmas: torch.Tensor,
    advantages: torch.Tensor,
    config: NFTSettings,
    v_reference: torch.Tensor | None = None,
    valid_counts: torch.Tensor | None = None,
) -> CombinableLoss:
    """The K per-reward NFT losses of one batch, as one CombinableLoss.

    ``advantages`` is (B, K) with NaN where reward k does not apply to sample i. Objective
    k's loss is the mean over its valid samples of r_ki P_i + (1 - r_ki) N_i; an objective
    without valid samples has loss and gradient zero. When the batch is one micro-batch
    of an optimizer step, ``valid_counts`` (K,) holds each reward's valid samples in the
    whole step, so the micro-batches' losses add up to the step's mean (as the reference
    averages over its batch). With ``v_reference`` the KL penalty
    kl_coefficient * mean((v_theta - v_reference)^2) goes in ``extra``.
    """
    positive, negative = nft_branch_errors(v_theta, v_old, x_t, x0, sigmas, config)
    if advantages.ndim != 2 or advantages.shape[0] != positive.shape[0]:
        raise ValueError(
            f"advantages must have shape (B={positive.shape[0]}, K), got {tuple(advantages.shape)}"
        )
    if bool(torch.isinf(advantages).any()):
        raise ValueError("advantages contain Inf; mark a reward that does not apply with NaN")
    advantages = advantages.detach().to(device=positive.device, dtype=positive.dtype)
    ratios = nft_ratios(advantages, config.a_max).T
    coefficients = masked_mean_coefficients(
        torch.stack((ratios, 1 - ratios), dim=1), ~torch.isnan(ratios), valid_counts
    )
    extra = None
    if v_reference is not None:
        if v_reference.shape != v_theta.shape:
            raise ValueError(
                f"v_reference must have the shape of v_theta {tuple(v_theta.shape)}, "
                f"got {tuple(v_reference.shape)}"
            )
        difference = v_theta.to(positive.dtype) - v_reference.detach().to(positive.dtype)
        extra = config.kl_coefficient * difference.square().mean()
    terms = torch.stack((positive, negative))
    # Each branch error is one sample's, computed from its own forward row.
    return CombinableLoss(terms, coefficients, extra, rows=RowValues(terms), outputs=v_theta)
