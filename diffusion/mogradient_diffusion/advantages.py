"""Per-reward, per-prompt-group advantages; the weighted-sum and GDPO scalar objectives.

DiffusionNFT normalizes each reward within the group of images sharing a prompt:
subtract the group mean, divide by the standard deviation of the whole batch (its
default; per group is the GRPO variant), clip to [-a_max, a_max]. With K rewards this
is done per column, so MARBLE gets one advantage per reward. NaN marks a reward that
does not apply to a sample (OCR on a prompt without quoted text); NaN entries are left
out of every statistic and stay NaN in the advantages. Standard deviations are
population ones (ddof=0, as the references' ``np.std``). Under DDP, gather the rewards
of all ranks first: the global std is a batch-wide statistic.

[`gdpo_advantages`][mogradient_diffusion.advantages.gdpo_advantages] is GDPO's one combined
advantage (per-reward group normalization, weighted sum, batch renormalization), with the official
TRL code's conventions.

Tensor maths only: the objectives and the strategies both build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

STD_MODES = ("global", "group")


def group_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    std: str = "global",
    clip: float | None = 5.0,
    eps: float = 1e-6,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Advantages [B, K] (float32, NaN where the reward is NaN) and per-reward stats.

    ``group_ids[b]`` names the prompt group of sample b (any integers). Advantage
    ``(r - mean_group) / (std + eps)``, then clipped to ``[-clip, clip]`` (``None``: no
    clip; default a_max = 5). Stats, each a float32 tensor [K], NaN for a reward with
    no value in the batch: ``reward_mean``, ``reward_std``, ``present_fraction`` (never
    NaN), ``zero_std_group_ratio`` (share of the groups holding the reward whose values
    all agree within ``eps``: they carry no signal), ``clip_fraction``, ``adv_mean``,
    ``adv_std`` (population), ``adv_abs_mean``, ``adv_min``, ``adv_max`` (after clipping).
    """
    _check_batch(rewards, group_ids)
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it guards zero-std divisions), got {eps}")
    r, present, group, groups = _grouped(rewards, group_ids)

    group_mean, group_std, group_count = _group_moments(r, present, group, groups)
    centered = r - group_mean[group]
    global_std = _nan_std(r, present)
    scale = global_std.expand_as(r) if std == "global" else group_std[group]
    advantages = centered / (scale + eps)
    clipped = torch.zeros_like(present)
    if clip is not None:
        clipped = advantages.abs() > clip
        advantages = advantages.clamp(-clip, clip)

    holds = group_count > 0
    zero_std = ((group_std <= eps) & holds).sum(0) / holds.sum(0)
    stats = {
        "reward_mean": _nan_mean(r, present),
        "reward_std": global_std,
        "present_fraction": present.double().mean(0),
        "zero_std_group_ratio": zero_std,
        "clip_fraction": _nan_mean(clipped.double(), present),
        "adv_mean": _nan_mean(advantages, present),
        "adv_std": _nan_std(advantages, present),
        "adv_abs_mean": _nan_mean(advantages.abs(), present),
        "adv_min": torch.where(present, advantages, torch.inf).amin(0),
        "adv_max": torch.where(present, advantages, -torch.inf).amax(0),
    }
    none = present.sum(0) == 0
    stats = {
        k: v if k == "present_fraction" else torch.where(none, torch.nan, v)
        for k, v in stats.items()
    }
    return advantages.float(), {k: v.float() for k, v in stats.items()}


def _nan_mean(x: Tensor, present: Tensor) -> Tensor:
    return torch.where(present, x, 0).sum(0) / present.sum(0)


def _check_batch(rewards: Tensor, group_ids: Tensor) -> None:
    """Rewards [B, K] and one group id per sample, or a ValueError saying which is off."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, K], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape[:1]:
        raise ValueError(f"group_ids must be [{rewards.shape[0]}], got {tuple(group_ids.shape)}")


def _grouped(rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """The rewards in float64 on the CPU, where they are present (not NaN), each sample's
    group index in 0..G-1, and G; +-inf is refused (NaN is how a reward says "n/a")."""
    r = rewards.detach().to("cpu", torch.float64)
    if torch.isinf(r).any():
        raise ValueError("rewards contain +-inf; use NaN for 'does not apply'")
    labels, group = torch.unique(group_ids.cpu(), return_inverse=True)
    return r, ~torch.isnan(r), group, len(labels)


def _nan_std(x: Tensor, present: Tensor) -> Tensor:
    mean = _nan_mean(x, present)
    return _nan_mean((x - mean) ** 2, present).sqrt()


def _group_varies(r: Tensor, present: Tensor, group: Tensor, groups: int) -> Tensor:
    """Per group and reward [G, K]: whether the present values are not all equal."""
    index = group[:, None].expand_as(r)

    def reduce(fill: float, how: str) -> Tensor:
        start = torch.full((groups, r.shape[1]), fill, dtype=r.dtype)
        return start.scatter_reduce(0, index, torch.where(present, r, fill), how)

    return reduce(-torch.inf, "amax") > reduce(torch.inf, "amin")


def _group_moments(
    r: Tensor, present: Tensor, group: Tensor, groups: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-group NaN-aware mean, population std and count, each [G, K]."""

    def group_sum(x: Tensor) -> Tensor:
        return torch.zeros(groups, r.shape[1], dtype=r.dtype).index_add_(0, group, x)

    count = group_sum(present.to(r.dtype))
    mean = group_sum(torch.where(present, r, 0)) / count
    variance = group_sum(torch.where(present, r - mean[group], 0) ** 2) / count
    return mean, variance.sqrt(), count


def gdpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    weights: Sequence[float] | Tensor,
    eps: float = 1e-4,
) -> Tensor:
    """GDPO's combined advantage [B] (float32) from rewards [B, K] with NaN.

    Liu et al., "GDPO: Group reward-Decoupled Normalization Policy Optimization"
    (arXiv 2601.05242), as the official code computes it (NVlabs/GDPO,
    ``trl-GDPO/trl-0.18.0-gdpo/trl/trainer/grpo_trainer.py``, ``apply_gdpo``):

    1. per reward k and prompt group: ``A_k = (r_k - group mean) / (group std + eps)``,
       unbiased std (torch's default), eps 1e-4; no clip;
    2. ``S = sum_k w_k A_k``;
    3. over the whole batch: ``A = (S - mean S) / (std S + eps)``, unbiased std, eps 1e-4.

    NaN (reward not applicable): left out of its reward's group statistics, and its
    ``A_k`` counts as 0 in the sum. TRL instead zeroes the NaN *reward* before step 1
    (``nan_to_num``); both agree whenever a reward is NaN for a whole prompt group (the
    usual case: applicability depends on the prompt), and ours does not score "not
    applicable" as a reward of 0 within a group. Where a group's values of a reward all
    agree (or it holds one value: TRL gets NaN there and drops it with ``nansum``) its
    ``A_k`` is exactly 0, not round-off over eps. A sample where no reward with positive
    weight applies gets NaN (it sits out, as in
    [`weighted_reward`][mogradient_diffusion.advantages.weighted_reward]) and stays out of the batch
    statistics. Every prompt group's ``S`` sums to 0, so ``A`` has group mean 0: an objective's own
    group centering leaves it unchanged.
    """
    _check_batch(rewards, group_ids)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it guards zero-std divisions), got {eps}")
    w = _checked_weights(weights, rewards.shape[1])
    r, present, group, groups = _grouped(rewards, group_ids)
    mean, population_std, count = _group_moments(r, present, group, groups)
    unbiased = population_std * (count / (count - 1).clamp_min(1)).sqrt()
    per_reward = (r - mean[group]) / (unbiased[group] + eps)
    # Exactly 0 where a group's values all agree (one value included), not round-off.
    varies = _group_varies(r, present, group, groups)
    per_reward = torch.where(present & varies[group], per_reward, 0.0)
    summed = (per_reward * w).sum(1)
    applies = (present & (w > 0)).any(1)
    values = summed[applies]
    combined = torch.full_like(summed, torch.nan)
    if len(values) > 1:
        combined[applies] = (values - values.mean()) / (values.std() + eps)
    else:
        combined[applies] = 0.0
    return combined.float()


def weighted_reward(rewards: Tensor, weights: Sequence[float] | Tensor) -> Tensor:
    """The weighted-sum baseline's scalar reward [B] from rewards [B, K] with NaN.

    Per sample, ``sum_k w_k r_k / sum_k w_k`` over the rewards present (not NaN): the
    weights are renormalized over what applies, so a sample without an OCR target is
    scored by the other rewards at full strength rather than with OCR counted as 0. NaN
    only where no reward with positive weight is present. As MARBLE's baseline does;
    samples of one prompt share the same present set, so group advantages stay fair.
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, K], got shape {tuple(rewards.shape)}")
    w = _checked_weights(weights, rewards.shape[1])
    r = rewards.detach().to("cpu", torch.float64)
    present = ~torch.isnan(r)
    weight = torch.where(present, w, 0)
    total = (weight * torch.where(present, r, 0)).sum(1)
    norm = weight.sum(1)
    return torch.where(norm > 0, total / norm, torch.nan).float()


def _checked_weights(weights: Sequence[float] | Tensor, count: int) -> Tensor:
    """The reward weights as float64 [K]: one per reward, finite, >= 0, not all 0."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() != count:
        raise ValueError(f"{w.numel()} weights for {count} rewards")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w.tolist()}")
    return w
