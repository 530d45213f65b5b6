"""COSMOS: one preference-conditioned model for the whole Pareto front."""

from __future__ import annotations

import torch

from mogradient.scalarizations._base import Scalarization, ScalarizedLoss, non_negative, positive


class COSMOS(Scalarization):
    """Conditioned one-shot multi-objective search (Ruchte & Grabocka 2021, ICDM).

    Each step draws a preference r from a symmetric Dirichlet(``concentration``), the
    model sees r with its input (concatenated to it, say), and the loss is the linear
    scalarization minus a cosine penalty, sum_k r_k L_k - lam cos(r, L): the cosine pulls
    the loss vector towards the ray of r, so that one model, conditioned on r, traces
    the Pareto front as r varies. ``lam`` 0 is the plain weighted sum.

    Call order each step: ``r = cosmos.next_preference()`` before the forward (feed r to
    the model), then ``cosmos(losses)``, which uses that r until the next draw. The
    draws come from a private seeded generator (``seed``; fresh entropy without one),
    independent of torch's global RNG. The gradient is
    d loss / d L = r - lam (r / (|r| |L|) - (r . L) L / (|r| |L|^3)), which is
    ``weights``; ``extras["cosine"]`` is cos(r, L). The loss vector must not be all
    zeros (no cosine). The draw and the loss are those of the authors' code
    (ruchtem/cosmos, multi_objective/methods/cosmos/cosmos.py). State in ``state_dict``:
    the generator's state, the current preference and whether one was drawn.
    """

    def __init__(
        self, num_tasks: int, lam: float, concentration: float = 1.0, seed: int | None = None
    ) -> None:
        super().__init__(num_tasks)
        self.lam = non_negative(lam, "lam")
        self.concentration = positive(concentration, "concentration")
        generator = torch.Generator()
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(seed)
        self.register_buffer("rng_state", generator.get_state())
        self.register_buffer(
            "preference", torch.full((num_tasks,), 1.0 / num_tasks, dtype=torch.float64)
        )
        self.register_buffer("drawn", torch.zeros((), dtype=torch.bool))

    def next_preference(self) -> torch.Tensor:
        """Draw r ~ Dirichlet(concentration), keep it for the loss, and return a copy."""
        generator = torch.Generator()
        generator.set_state(self.rng_state.cpu())
        concentration = torch.full((len(self.preference),), self.concentration, dtype=torch.float64)
        # Gamma draws normalized: a Dirichlet draw (torch's own Dirichlet takes no generator).
        draws = torch._standard_gamma(concentration, generator=generator)
        draws = draws.clamp_min(torch.finfo(torch.float64).tiny)
        self.preference.copy_(draws / draws.sum())
        self.rng_state.copy_(generator.get_state())
        self.drawn.fill_(True)
        return self.preference.clone()

    def check_domain(self, values: torch.Tensor) -> None:
        if not bool((values != 0).any()):
            raise ValueError(
                "COSMOS: every loss is 0.0, so cos(r, L) is undefined; skip this step or "
                "shift the losses by a lower bound below them"
            )

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        if not bool(self.drawn):
            raise ValueError(
                "COSMOS needs a preference first: call next_preference() before the forward "
                "and condition the model's input on it"
            )
        preference = self.preference.to(losses)
        weighted = (preference * losses).sum()
        norms = preference.norm() * losses.norm()
        cosine = weighted / norms
        loss = weighted - self.lam * cosine
        values = losses.detach()
        norms, weighted = norms.detach(), weighted.detach()
        weights = preference - self.lam * (
            preference / norms - weighted * values / (norms * values.norm() ** 2)
        )
        return ScalarizedLoss(
            loss, weights, {"cosine": cosine.detach(), "preference": preference.clone()}
        )
