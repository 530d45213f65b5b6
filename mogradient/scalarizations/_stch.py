"""STCH: smooth Tchebycheff scalarization, a log-sum-exp smoothing of the weighted worst loss."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mogradient.scalarizations._base import (
    Scalarization,
    ScalarizedLoss,
    positive,
    preferences_and_reference,
)


class STCH(Scalarization):
    """Smooth Tchebycheff scalarization (Lin et al. 2024, ICML; arXiv 2402.19078).

    Tchebycheff scalarization minimizes the weighted worst loss max_k p_k (L_k - z_k),
    whose optima cover the whole Pareto front (convex or not) but whose gradient jumps
    between tasks. STCH replaces the max by mu log sum_k exp(p_k (L_k - z_k) / mu), the
    smooth Tchebycheff function as the authors' code computes it (Xi-L/STCH,
    STCH_PSL/run_stch_psl.py), which is smooth, lies within mu log K above the max, and
    weighs each task by a softmax of its weighted excess: the worst task gets most of the
    weight, how much depending on ``mu``.

    ``mu`` is required: the authors' code uses 1 for multi-task learning (the default of
    its STCH_MTL, which applies STCH to log(L_k / n_k), n the losses averaged over a
    warm-up epoch) and 0.01 for Pareto set learning. ``preferences`` p default to uniform
    1/K; ``reference`` z (the ideal point, a lower bound on the losses) defaults to 0.
    Either fixes ``num_tasks``. Computed with the largest term factored out, so small
    ``mu`` cannot overflow.
    """

    def __init__(
        self,
        num_tasks: int | None = None,
        *,
        mu: float,
        preferences: Sequence[float] | torch.Tensor | None = None,
        reference: Sequence[float] | torch.Tensor | None = None,
    ) -> None:
        num_tasks, preferences, reference = preferences_and_reference(
            num_tasks, preferences, reference
        )
        super().__init__(num_tasks)
        self.mu = positive(mu, "mu")
        self.register_buffer("preferences", preferences)
        self.register_buffer("reference", reference)

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        if self.preferences is None:
            preferences = torch.full_like(losses, 1.0 / len(losses)).detach()
        else:
            preferences = self.preferences.to(losses)
        excess = losses if self.reference is None else losses - self.reference.to(losses)
        weighted = preferences * excess
        # mu log sum exp(y / mu) = mu log sum exp((y - c) / mu) + c for any constant c.
        largest = weighted.detach().max()
        scaled = (weighted - largest) / self.mu
        loss = self.mu * torch.logsumexp(scaled, dim=0) + largest
        weights = torch.softmax(scaled.detach(), dim=0) * preferences
        return ScalarizedLoss(loss, weights)
