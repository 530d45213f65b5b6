"""The NFT CombinableLoss against the per-reward loss written out directly.

The reference below is the straightforward formula for one reward on its valid samples
(as in the papers' pseudocode, with the official x0-space adaptive weighting as the
alternative form), built from the true noise rather than from x_t, so it shares nothing
with the implementation but the maths.
"""

from __future__ import annotations

import pytest
import torch

from mogradient_diffusion.objectives.nft import NFTSettings
from mogradient_diffusion.objectives.nft_loss import (
    nft_branch_errors,
    nft_branch_velocities,
    nft_loss,
    nft_ratios,
)

FORMS = ("x0_adaptive", "velocity")
SHAPE = (2, 3, 3)


def _tensors(batch: int, dtype: torch.dtype, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).to(dtype)

    x0, noise = randn(batch, *SHAPE), randn(batch, *SHAPE)
    sigmas = (0.05 + 0.9 * torch.rand(batch, generator=generator, dtype=torch.float64)).to(dtype)
    t = sigmas.view(-1, 1, 1, 1)
    v_old = noise - x0 + 0.3 * randn(batch, *SHAPE)
    return {
        "v_theta": (v_old + 0.1 * randn(batch, *SHAPE)).requires_grad_(),
        "v_old": v_old,
        "x_t": (1 - t) * x0 + t * noise,
        "x0": x0,
        "noise": noise,
        "sigmas": sigmas,
        "v_reference": v_old + 0.2 * randn(batch, *SHAPE),
        "advantages": 3.0 * randn(batch, 3),
    }


def _batch(dtype: torch.dtype = torch.float64, seed: int = 0) -> dict:
    """B = 12 samples, K = 3 rewards with NaN entries and clamped advantages."""
    data = _tensors(12, dtype, seed)
    advantages = data["advantages"]
    advantages[[0, 4, 7], 0] = float("nan")
    advantages[::2, 1] = float("nan")
    advantages[[1, 5], 2] = torch.tensor([7.0, -12.0], dtype=dtype)  # clamped: r = 1 and 0
    advantages[3, 0] = 9.0
    return data


def _loss(data: dict, config: NFTSettings, with_reference: bool = False):
    return nft_loss(
        data["v_theta"],
        data["v_old"],
        data["x_t"],
        data["x0"],
        data["sigmas"],
        data["advantages"],
        config,
        v_reference=data["v_reference"] if with_reference else None,
    )


def _reference_loss(data: dict, reward: int, config: NFTSettings) -> torch.Tensor:
    """One reward's NFT loss: mean over its valid samples of r * P + (1 - r) * N."""
    advantage = data["advantages"][:, reward]
    keep = ~torch.isnan(advantage)
    v = data["v_theta"][keep]
    v_old, x0, noise = data["v_old"][keep], data["x0"][keep], data["noise"][keep]
    t = data["sigmas"][keep].view(-1, 1, 1, 1)
    x_t = (1 - t) * x0 + t * noise
    beta, a_max = config.beta, config.a_max
    r = torch.clamp(0.5 + torch.clamp(advantage[keep], -a_max, a_max) / (2 * a_max), 0, 1)
    v_positive = (1 - beta) * v_old + beta * v
    v_negative = (1 + beta) * v_old - beta * v
    losses = []
    for branch in (v_positive, v_negative):
        if config.form == "velocity":
            losses.append(((branch - (noise - x0)) ** 2).flatten(1).mean(1))
        else:
            x0_hat = x_t - t * branch
            weight = (x0_hat - x0).abs().flatten(1).mean(1).clamp_min(1e-5).detach()
            losses.append(((x0_hat - x0) ** 2).flatten(1).mean(1) / weight)
    return (a_max / beta * (r * losses[0] + (1 - r) * losses[1])).mean()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("beta", [1.0, 0.1])
def test_objective_losses_match_per_reward_formula(form: str, beta: float) -> None:
    data, config = _batch(), NFTSettings(beta=beta, form=form)
    losses = _loss(data, config).objective_losses()
    expected = torch.stack([_reference_loss(data, k, config) for k in range(3)])
    torch.testing.assert_close(losses, expected, rtol=1e-6, atol=0)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("with_reference", [False, True])
def test_combined_gradient_is_weighted_sum_of_per_reward_gradients(
    form: str, with_reference: bool
) -> None:
    data, config = _batch(seed=1), NFTSettings(form=form, kl_coefficient=0.05)
    loss = _loss(data, config, with_reference)
    v_theta = data["v_theta"]
    per_reward = [
        torch.autograd.grad(_reference_loss(data, k, config), v_theta)[0] for k in range(3)
    ]
    kl_gradient = 2 * config.kl_coefficient * (v_theta - data["v_reference"]) / v_theta.numel()
    generator = torch.Generator().manual_seed(2)
    for weights in ([0.7, -1.3, 2.5], [1.0, 0.0, 0.0], (5 * torch.randn(3, generator=generator))):
        weights = torch.as_tensor(weights, dtype=torch.float64)
        (gradient,) = torch.autograd.grad(loss.combined(weights), v_theta, retain_graph=True)
        expected = sum(w * g for w, g in zip(weights, per_reward, strict=True))
        if with_reference:
            expected = expected + kl_gradient.detach()
        torch.testing.assert_close(gradient, expected, rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("form", FORMS)
def test_identical_policies_make_the_branches_coincide(form: str) -> None:
    data = _batch()
    v_old = data["v_old"]
    positive_v, negative_v = nft_branch_velocities(v_old.clone(), v_old, beta=0.1)
    t = data["sigmas"].view(-1, 1, 1, 1)
    torch.testing.assert_close(data["x_t"] - t * positive_v, data["x_t"] - t * negative_v)
    positive, negative = nft_branch_errors(
        v_old.clone(), v_old, data["x_t"], data["x0"], data["sigmas"], NFTSettings(form=form)
    )
    torch.testing.assert_close(positive, negative)


@pytest.mark.parametrize("form", FORMS)
def test_descent_moves_toward_the_target_for_positive_advantage(form: str) -> None:
    data = _tensors(1, torch.float64, seed=3)
    config = NFTSettings(beta=0.1, form=form)
    direction = data["noise"] - data["x0"] - data["v_old"]  # from v_old toward the target
    eps = 1e-4

    def loss_at(v_theta: torch.Tensor, advantage: float) -> torch.Tensor:
        advantages = torch.tensor([[advantage]], dtype=torch.float64)
        return nft_loss(
            v_theta, data["v_old"], data["x_t"], data["x0"], data["sigmas"], advantages, config
        ).combined([1.0])

    for advantage, sign in ((2.0, -1.0), (-2.0, 1.0)):
        v_theta = data["v_old"].clone().requires_grad_()
        (gradient,) = torch.autograd.grad(loss_at(v_theta, advantage), v_theta)
        slope = (gradient * direction).sum()
        with torch.no_grad():
            finite_difference = (
                loss_at(data["v_old"] + eps * direction, advantage)
                - loss_at(data["v_old"] - eps * direction, advantage)
            ) / (2 * eps)
        assert torch.sign(slope) == sign and torch.sign(finite_difference) == sign
        if form == "velocity":  # no detached weight: the slope is the true derivative
            torch.testing.assert_close(slope, finite_difference, rtol=1e-6, atol=0)
    v_theta = data["v_old"].clone().requires_grad_()
    (gradient,) = torch.autograd.grad(loss_at(v_theta, 0.0), v_theta)
    assert gradient.abs().max() < 1e-12  # r = 1/2: the branches cancel at v_theta = v_old


def test_kl_extra_is_the_scaled_velocity_distance_to_the_reference() -> None:
    data, config = _batch(), NFTSettings(kl_coefficient=1e-3)
    assert _loss(data, config).extra is None
    extra = _loss(data, config, with_reference=True).extra
    expected = 1e-3 * ((data["v_theta"] - data["v_reference"]) ** 2).mean()
    torch.testing.assert_close(extra, expected, rtol=1e-12, atol=0)
    reference = data["v_reference"].clone().requires_grad_()
    data["v_reference"] = reference
    _loss(data, config, with_reference=True).combined([1.0, 1.0, 1.0]).backward()
    assert reference.grad is None  # the reference model is a constant


def test_ratios_keep_nan_and_clamp() -> None:
    advantages = torch.tensor([[0.0, float("nan")], [2.5, -2.5], [9.0, -9.0]])
    ratios = nft_ratios(advantages, a_max=5.0)
    assert torch.isnan(ratios[0, 1]) and torch.isnan(ratios).sum() == 1
    torch.testing.assert_close(ratios[0, 0], torch.tensor(0.5))
    torch.testing.assert_close(ratios[1:], torch.tensor([[0.75, 0.25], [1.0, 0.0]]))


def test_reward_without_valid_samples_has_zero_loss_and_gradient() -> None:
    data = _batch()
    data["advantages"][:, 1] = float("nan")
    loss = _loss(data, NFTSettings())
    assert loss.objective_losses()[1] == 0
    (gradient,) = torch.autograd.grad(loss.combined([0.0, 1.0, 0.0]), data["v_theta"])
    assert not gradient.any()


def test_low_precision_inputs_give_float32_terms() -> None:
    data = _batch(dtype=torch.bfloat16)
    data["v_theta"] = data["v_theta"].detach().requires_grad_()
    loss = _loss(data, NFTSettings(), with_reference=True)
    assert loss.terms.dtype == torch.float32 and torch.isfinite(loss.terms).all()
    loss.combined([1.0, 1.0, 1.0]).backward()
    assert data["v_theta"].grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": 0.0}, "beta must be > 0"),
        ({"beta": float("nan")}, "beta must be finite"),
        ({"a_max": -1.0}, "a_max must be > 0"),
        ({"kl_coefficient": -1e-4}, "kl_coefficient must be >= 0"),
        ({"adaptive_weight_floor": 0.0}, "adaptive_weight_floor must be > 0"),
        ({"form": "x0"}, "form must be one of"),
        ({"advantage_std": "batch"}, "advantage_std must be one of"),
    ],
)
def test_config_validation(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NFTSettings(**kwargs)
    with pytest.raises(TypeError, match="beta must be a real number"):
        NFTSettings(beta="0.1")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(v_old=d["v_old"][:, :1]), "v_old must have the shape"),
        (lambda d: d.update(sigmas=d["sigmas"][:, None]), r"sigmas must have shape \(B,\)"),
        (lambda d: d["sigmas"].__setitem__(0, 1.5), r"sigmas must lie in \[0, 1\]"),
        (lambda d: d.update(advantages=d["advantages"][:, 0]), "advantages must have shape"),
        (lambda d: d["advantages"].__setitem__((2, 1), float("inf")), "advantages contain Inf"),
        (lambda d: d.update(v_reference=d["v_reference"][:1]), "v_reference must have the shape"),
    ],
)
def test_input_validation(change, message: str) -> None:
    data = _batch()
    change(data)
    with pytest.raises(ValueError, match=message):
        _loss(data, NFTSettings(), with_reference=True)


def test_velocity_form_rejects_t_zero() -> None:
    data = _batch()
    data["sigmas"][3] = 0.0
    _loss(data, NFTSettings(form="x0_adaptive"))  # the x0 form is defined at t = 0
    with pytest.raises(ValueError, match=r"sigmas must lie in \(0, 1\]"):
        _loss(data, NFTSettings(form="velocity"))


def _piece_losses(data: dict, rows: slice, config: NFTSettings, counts=None) -> torch.Tensor:
    piece = {key: value[rows] for key, value in data.items()}
    loss = nft_loss(
        piece["v_theta"],
        piece["v_old"],
        piece["x_t"],
        piece["x0"],
        piece["sigmas"],
        piece["advantages"],
        config,
        valid_counts=counts,
    )
    return loss.objective_losses()


@pytest.mark.parametrize("cuts", [[4, 12], [1, 5, 12], [2, 3, 7, 9, 12]])
def test_micro_batches_with_whole_batch_counts_sum_to_the_batch_loss(cuts: list[int]) -> None:
    """Gradient accumulation is exact: pieces normalized by the whole batch's valid counts
    add up to the whole batch's per-reward means, however the batch is cut (some pieces
    hold a single applicable sample of a reward: it must not get that reward's weight)."""
    config = NFTSettings()
    data = _batch()
    whole = _loss(data, config).objective_losses()
    counts = (~torch.isnan(data["advantages"])).sum(dim=0)
    pieces = sum(
        _piece_losses(data, slice(start, end), config, counts)
        for start, end in zip([0, *cuts[:-1]], cuts, strict=True)
    )
    torch.testing.assert_close(pieces, whole, rtol=1e-12, atol=0)
    # Per-piece means (the old behaviour) weigh a lone sample like a whole piece.
    alone = _piece_losses(data, slice(0, 1), config, counts)
    own = _piece_losses(data, slice(0, 1), config)
    valid = ~torch.isnan(data["advantages"][0])
    torch.testing.assert_close(alone[valid], own[valid] / counts[valid])
