"""MARBLE as released (aim-uofa/MARBLE @1bf9543): a solve covers one micro-step.

The release decides per micro-step: one micro-batch at one trained noise level (its
SD3.5-M recipe has 8 x 24 = 192 per optimizer step). A micro-step takes the cache
unless none exists yet, or the optimizer step is below the warm-up (1), or ``period``
(10) steps have passed since the last solve; so step 0 solves on every micro-step and
steps 10, 20, ... on their first micro-step only (train.py:1481-1493, 1727). A solve
micro-step takes the K per-reward gradients of that micro-step (plus the KL term's),
solves MGDA on the unit gradients and applies the fresh direction (train.py:1617-1741);
every other micro-step takes one backward of the NFT loss on the *mixed advantage*
sum_k alpha_k A_k, NaN counted as 0, clipped after mixing, with no per-reward masks
(train.py:1495-1560). ``alpha`` is the simplex solution, smoothed over solves as
cache <- rho cache + (1 - rho) alpha, fallbacks included, not renormalized
(train.py:1715-1726). Reward groups are one MGDA objective each (the mean of their
members' gradients); on cached micro-steps each member gets alpha / group size
(train.py:817-845, 1689-1703).

This module holds the schedule, the cache and the mixing; the trainer runs the passes.
Our MARBLE (``strategy.solve_scope: step``) solves once on the whole step's gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from mogradient.harmonizers import MGDA


class MicroStepMarble:
    """The release's per-micro-step schedule, alpha cache and advantage mixing.

    ``groups`` lists reward names solved as one objective each (the release's
    ``reward_groups``); the other rewards are objectives of their own. ``unit_weights``
    (one per objective, the release's ``reward_weights``) scale the unit gradients
    before the solve; ``alpha_lower_bound`` (its ``alpha_floor``) bounds alpha inside
    the QP. ``equal_alpha`` fixes alpha to 1/G and never solves (the release's
    ``equal_alpha`` ablation).
    """

    def __init__(
        self,
        reward_names: Sequence[str],
        *,
        period: int = 10,
        warmup_steps: int = 1,
        rho: float = 0.7,
        alpha_lower_bound: float = 0.0,
        unit_weights: Sequence[float] | None = None,
        groups: Sequence[Sequence[str]] = (),
        equal_alpha: bool = False,
    ) -> None:
        if period < 1 or warmup_steps < 0 or not 0.0 <= rho < 1.0:
            raise ValueError(
                f"period must be >= 1, warmup_steps >= 0 and rho in [0, 1); got {period}, "
                f"{warmup_steps}, {rho}"
            )
        self.reward_names = list(reward_names)
        self.members = objective_members(self.reward_names, groups)
        self.objective_names = ["+".join(self.reward_names[k] for k in m) for m in self.members]
        self.harmonizer = MGDA(
            normalize=True, alpha_lower_bound=alpha_lower_bound, unit_weights=unit_weights
        )
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)
        self.rho = float(rho)
        self.equal_alpha = bool(equal_alpha)
        count = len(self.members)
        self.alpha: torch.Tensor | None = (
            torch.full((count,), 1.0 / count, dtype=torch.float64) if equal_alpha else None
        )
        self.last_solve: int | None = None

    # ---------------------------------------------------------------- schedule
    def solves(self, step: int) -> bool:
        """Whether the next micro-step of optimizer step ``step`` solves."""
        if self.alpha is None:
            return True
        if self.equal_alpha:
            return False
        since = step - (self.last_solve if self.last_solve is not None else -self.period)
        return step < self.warmup_steps or since >= self.period

    def plan(self, step: int) -> str:
        """Which micro-steps of optimizer step ``step`` solve: ``every`` (warm-up),
        ``first`` (a solve step: its first micro-step, whose solve refreshes the cache for
        the rest), ``none``."""
        if not self.solves(step):
            return "none"
        return "every" if step < self.warmup_steps else "first"

    def steps_since_solve(self, step: int) -> int | None:
        return None if self.last_solve is None else step - self.last_solve

    # ------------------------------------------------------------------ solves
    def solve(self, stack: torch.Tensor, step: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """One micro-step's solve on its per-reward stack [K, D]: the weights on the
        stack's rows that give the fresh direction, and what to log. Folds the solved
        alpha into the cache and marks ``step`` as the last solve."""
        objectives = self.objective_stack(stack)
        result = self.harmonizer(objectives)
        alpha = torch.zeros(len(self.members), dtype=torch.float64)
        usable = [g for g in range(len(self.members)) if g not in result.dropped]
        if len(usable) == 1:  # the release's single_valid: that gradient alone, one-hot
            alpha[usable] = 1.0
        elif usable:
            alpha[usable] = torch.tensor(result.extras["alpha"], dtype=torch.float64)
        self._fold(alpha)
        self.last_solve = step
        weights = torch.zeros(len(self.reward_names), dtype=torch.float64)
        for g, members in enumerate(self.members):
            weights[members] = result.weights[g] / len(members)
        norms = objectives.double().norm(dim=1)
        usable_norms = norms[usable]
        record = {
            "fresh_alpha": alpha.tolist(),
            "raw_norms": norms.tolist(),
            "rescale": float(usable_norms.mean()) if len(usable) else 0.0,
            "fallback": result.fallback,
        }
        return weights, record

    def objective_stack(self, stack: torch.Tensor) -> torch.Tensor:
        """[K, D] per-reward gradients as [G, D] objective gradients (a group's mean);
        the stack itself where every reward is its own objective (no copy of K x D)."""
        if self.members == [[k] for k in range(len(self.reward_names))]:
            return stack
        return torch.stack([stack[m].mean(dim=0) for m in self.members])

    def _fold(self, alpha: torch.Tensor) -> None:
        """The release's EMA: 0.7 old + 0.3 new on every solve, no renormalization."""
        if self.alpha is None or self.rho == 0:
            self.alpha = alpha.clone()
        else:
            self.alpha = self.rho * self.alpha + (1 - self.rho) * alpha

    # ------------------------------------------------------------ cached steps
    def reward_coefficients(self) -> torch.Tensor:
        """[K] each reward's share of the mixed advantage: its objective's cached alpha
        divided by the objective's size."""
        if self.alpha is None:
            raise RuntimeError("no cached alpha yet: a solve comes first")
        coefficients = torch.zeros(len(self.reward_names), dtype=torch.float64)
        for g, members in enumerate(self.members):
            coefficients[members] = self.alpha[g] / len(members)
        return coefficients

    def mixed(self, advantages: torch.Tensor) -> torch.Tensor:
        """[..., K] per-reward advantages as the one mixed column [..., 1]:
        sum_k c_k A_k with NaN as 0 (the loss clips the mix)."""
        coefficients = self.reward_coefficients().to(advantages.dtype)
        return (torch.nan_to_num(advantages, nan=0.0) @ coefficients)[..., None]

    # ------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        alpha = None if self.alpha is None else self.alpha.tolist()
        return {"alpha": alpha, "last_solve": self.last_solve}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        alpha = state["alpha"]
        if alpha is not None and len(alpha) != len(self.members):
            raise ValueError(
                f"the checkpoint caches {len(alpha)} alphas, this run has "
                f"{len(self.members)} objectives {self.objective_names}"
            )
        self.alpha = None if alpha is None else torch.tensor(alpha, dtype=torch.float64)
        self.last_solve = state["last_solve"]


def objective_members(
    reward_names: Sequence[str], groups: Sequence[Sequence[str]]
) -> list[list[int]]:
    """Each MGDA objective's reward indices: the groups in order, then every ungrouped
    reward on its own, in reward order (as the release orders its MGDA names)."""
    index = {name: k for k, name in enumerate(reward_names)}
    members: list[list[int]] = []
    seen: set[str] = set()
    for group in groups:
        unknown = [name for name in group if name not in index]
        repeated = [name for name in group if name in seen]
        if not group or unknown or repeated:
            raise ValueError(
                f"reward group {list(group)}: each group names one or more configured "
                f"rewards {list(reward_names)}, each reward in at most one group"
                + (f" (unknown {unknown})" if unknown else "")
                + (f" (repeated {repeated})" if repeated else "")
            )
        seen.update(group)
        members.append([index[name] for name in group])
    members += [[k] for k, name in enumerate(reward_names) if name not in seen]
    return members
