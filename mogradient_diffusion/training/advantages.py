"""Per-reward, per-prompt-group advantages, and the weighted-sum baseline's scalar reward.

DiffusionNFT normalizes each reward within the group of images sharing a prompt:
subtract the group mean, divide by the standard deviation of the whole batch (its
default; per group is the GRPO variant), clip to [-a_max, a_max]. With K rewards this
is done per column, so MARBLE gets one advantage per reward. NaN marks a reward that
does not apply to a sample (OCR on a prompt without quoted text); NaN entries are left
out of every statistic and stay NaN in the advantages. Standard deviations are
population ones (ddof=0, as the references' ``np.std``). Under DDP, gather the rewards
of all ranks first: the global std is a batch-wide statistic.
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
    ``adv_abs_mean``, ``adv_min``, ``adv_max`` (after clipping).
    """
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be [B, K], got shape {tuple(rewards.shape)}")
    if group_ids.shape != rewards.shape[:1]:
        raise ValueError(f"group_ids must be [{rewards.shape[0]}], got {tuple(group_ids.shape)}")
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be > 0 or None, got {clip}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it guards zero-std divisions), got {eps}")
    r = rewards.detach().to("cpu", torch.float64)
    if torch.isinf(r).any():
        raise ValueError("rewards contain +-inf; use NaN for 'does not apply'")
    labels, group = torch.unique(group_ids.cpu(), return_inverse=True)
    present = ~torch.isnan(r)

    group_mean, group_std, group_count = _group_moments(r, present, group, len(labels))
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


def _nan_std(x: Tensor, present: Tensor) -> Tensor:
    mean = _nan_mean(x, present)
    return _nan_mean((x - mean) ** 2, present).sqrt()


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
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.numel() != rewards.shape[1]:
        raise ValueError(f"{w.numel()} weights for {rewards.shape[1]} rewards")
    if not torch.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {w.tolist()}")
    r = rewards.detach().to("cpu", torch.float64)
    present = ~torch.isnan(r)
    weight = torch.where(present, w, 0)
    total = (weight * torch.where(present, r, 0)).sum(1)
    norm = weight.sum(1)
    return torch.where(norm > 0, total / norm, torch.nan).float()
