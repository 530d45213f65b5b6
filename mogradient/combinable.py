"""The linearly-combinable-loss protocol: the reason amortized harmonization is exact.

Many per-objective losses share their differentiable parts and differ only in
non-differentiable per-sample coefficients. DiffusionNFT is the motivating case: sample
i's loss for reward k is r_ki * P_i + (1 - r_ki) * N_i, where the branch errors P_i, N_i
are shared by all rewards and r_ki = clip(1/2 + A_ki / (2 a_max), 0, 1). Writing

    L_k = sum_{j, i} C[k, j, i] * T[j, i]

with terms T (J x B, differentiable) and coefficients C (K x J x B, constants), any
combination sum_k w_k L_k has coefficients sum_k w_k C[k] and therefore one backward
pass gives exactly sum_k w_k grad L_k, for any real weights, with masks and clamps
already folded into C. Terms outside the harmonization (a KL penalty) go in ``extra``.
Terms must be finite: a NaN term poisons every combination, even with zero weight.

A loss may also say where it meets the network row by row
([`RowValues`][mogradient.combinable.RowValues]): then `mogradient.engines._rows` gets all K
gradients from one backward per row value instead of one per objective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RowValues:
    """Where a loss meets the network: values computed row by row of the forward batch.

    ``values`` is (V, R) (or (R,) for V = 1): entry [v, r] may depend on the trainable
    parameters only through row r of the forward batch, and the loss only through
    ``values``. The R rows are the batch of every trainable module call, stacked
    ``copies`` times along it (``torch.cat([x, x])`` for classifier-free guidance gives
    copies = 2; row i of a call is row i mod R). Rows must not interact in the forward
    (no BatchNorm in training mode). The terms themselves qualify when term column b is
    row b (DiffusionNFT); a per-row scalar serves every term of its row (Flow-GRPO's
    log-probability), so one backward pass gives all K gradients.
    """

    values: torch.Tensor
    copies: int = 1

    def __post_init__(self) -> None:
        if self.values.ndim not in (1, 2):
            raise ValueError(
                f"row values must have shape (V, R) or (R,), got {tuple(self.values.shape)}"
            )
        if isinstance(self.copies, bool) or not isinstance(self.copies, int) or self.copies < 1:
            raise ValueError(f"copies must be a positive integer, got {self.copies!r}")

    @property
    def matrix(self) -> torch.Tensor:
        """The values as (V, R)."""
        return self.values if self.values.ndim == 2 else self.values.unsqueeze(0)


@dataclass(frozen=True)
class CombinableLoss:
    """K losses given as constant coefficients on shared differentiable per-sample terms."""

    terms: torch.Tensor
    coefficients: torch.Tensor
    extra: torch.Tensor | None = None
    rows: RowValues | None = None
    # The network output the terms are computed from (DiffusionNFT: the predicted
    # velocity), when the loss exposes it: the per-objective gradients with respect to
    # it cost no backward pass through the network (`mogradient.engines.output_gram`).
    outputs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.terms.ndim != 2:
            raise ValueError(
                f"terms must have shape (J terms, B samples), got {tuple(self.terms.shape)}"
            )
        if self.coefficients.ndim != 3 or self.coefficients.shape[1:] != self.terms.shape:
            raise ValueError(
                "coefficients must have shape (K objectives, J terms, B samples) matching "
                f"terms {tuple(self.terms.shape)}; got {tuple(self.coefficients.shape)}"
            )
        if self.coefficients.requires_grad:
            raise ValueError("coefficients must be constants: detach them")
        if self.extra is not None and self.extra.numel() != 1:
            raise ValueError(f"extra must be a scalar loss, got shape {tuple(self.extra.shape)}")
        if not torch.isfinite(self.coefficients).all():
            raise ValueError(
                "coefficients contain NaN or Inf; mask not-applicable samples with a zero "
                "coefficient (see masked_mean_coefficients) instead of NaN"
            )

    @classmethod
    def instance_wise(cls, losses: torch.Tensor) -> CombinableLoss:
        """B per-sample losses as B objectives, sample b's loss being row b's value
        (instance-wise risk minimization: the Gram of per-sample gradients)."""
        if losses.ndim != 1:
            raise ValueError(f"losses must have shape (B,), got {tuple(losses.shape)}")
        terms = losses.unsqueeze(0)
        eye = torch.eye(len(losses), dtype=losses.dtype, device=losses.device)
        return cls(terms, eye.unsqueeze(1), rows=RowValues(terms))

    @classmethod
    def separate(cls, losses: torch.Tensor) -> CombinableLoss:
        """K losses with nothing declared in common (K scalar task losses): term k is L_k
        and objective k's coefficient is 1 on it, so ``combined(w)`` is sum_k w_k L_k and
        the K gradients take K backward passes."""
        if losses.ndim != 1:
            raise ValueError(f"losses must have shape (K,), got {tuple(losses.shape)}")
        eye = torch.eye(len(losses), dtype=losses.dtype, device=losses.device)
        return cls(losses.unsqueeze(1), eye.unsqueeze(2))

    @property
    def num_objectives(self) -> int:
        return self.coefficients.shape[0]

    def objective_losses(self) -> torch.Tensor:
        """The K per-objective losses (without ``extra``), still attached to the graph."""
        return torch.einsum("kjb,jb->k", self._coefficients(), self.terms)

    def combined(self, weights: torch.Tensor | list[float]) -> torch.Tensor:
        """``sum_k w_k L_k + extra`` as one scalar; its gradient is sum_k w_k grad L_k (+ extra)."""
        weights = torch.as_tensor(weights, dtype=self.terms.dtype, device=self.terms.device)
        if weights.shape != (self.num_objectives,):
            raise ValueError(
                f"need {self.num_objectives} weights, got shape {tuple(weights.shape)}"
            )
        if not torch.isfinite(weights).all():
            raise ValueError("weights contain NaN or Inf")
        combined = torch.einsum("k,kjb->jb", weights, self._coefficients())
        loss = (combined * self.terms).sum()
        return loss if self.extra is None else loss + self.extra.reshape(())

    def _coefficients(self) -> torch.Tensor:
        return self.coefficients.to(device=self.terms.device, dtype=self.terms.dtype)


def masked_mean_coefficients(
    per_sample: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """Coefficients that average over each objective's applicable samples only.

    ``per_sample`` is K x J x B (e.g. r_ki and 1 - r_ki for the two branches), ``valid``
    is K x B (False where the objective does not apply, e.g. a NaN reward). Returns
    C[k, j, i] = valid_ki / n_k * per_sample[k, j, i], with exact zeros (not NaN) for
    invalid samples and for objectives without any valid sample. n_k is the number of
    valid samples here, or ``counts[k]`` when these B samples are one piece of a larger
    batch (gradient accumulation): then the pieces' losses add up to that batch's mean,
    and a lone applicable sample in a piece does not get its objective's whole weight.
    """
    if valid.shape != (per_sample.shape[0], per_sample.shape[2]):
        raise ValueError(
            f"valid must have shape (K, B) = {(per_sample.shape[0], per_sample.shape[2])}, "
            f"got {tuple(valid.shape)}"
        )
    # The mask and counts may come from the host (a trainer keeps advantages there): move
    # them to the values' device before they meet.
    valid = valid.to(device=per_sample.device, dtype=torch.bool)
    if counts is None:
        counts = valid.sum(dim=1)
    else:
        counts = counts.to(per_sample.device)
        if counts.shape != (valid.shape[0],) or bool((counts < valid.sum(dim=1)).any()):
            raise ValueError(
                f"counts must have shape (K,) = ({valid.shape[0]},) and be at least the valid "
                f"samples of this piece {valid.sum(dim=1).tolist()}, got {counts.tolist()}"
            )
    counts = counts.reshape(-1, 1).clamp_min(1).to(per_sample.dtype)
    scale = valid.to(per_sample.dtype) / counts
    safe = torch.where(valid[:, None, :], per_sample, torch.zeros_like(per_sample))
    return (safe * scale[:, None, :]).detach()
