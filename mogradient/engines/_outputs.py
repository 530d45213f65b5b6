"""Per-objective gradients with respect to the network's output, for no backward pass
through the network.

A [`CombinableLoss`][mogradient.combinable.CombinableLoss] that names its ``outputs`` (the
tensor its terms are computed from: DiffusionNFT's predicted velocity) gives each
objective's gradient with respect to that output by differentiating only the loss's own
small graph. Harmonizing those gradients instead of the parameter gradients is MGDA-UB's
approximation (Sener & Koltun 2018): the weights are optimal in output space, which is
not the parameter space the update lives in, so whether they conflict there is an
empirical question (``benchmarks/results/mini_solve_scope``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from mogradient.combinable import CombinableLoss


def output_stack(loss: CombinableLoss) -> torch.Tensor:
    """The K x F gradients of ``loss``'s objectives with respect to its ``outputs``
    (flattened), keeping the graph for the backward pass that follows."""
    if loss.outputs is None:
        raise ValueError(
            "this loss does not name its outputs (CombinableLoss.outputs): output-space "
            "gradients need the tensor its terms are computed from"
        )
    losses = loss.objective_losses()
    rows = []
    for value in losses:
        (gradient,) = torch.autograd.grad(value, loss.outputs, retain_graph=True, allow_unused=True)
        rows.append(
            torch.zeros(loss.outputs.numel(), dtype=torch.float64, device=losses.device)
            if gradient is None
            else gradient.reshape(-1).double()
        )
    return torch.stack(rows)


def output_gram(pieces: Iterable[tuple[float, CombinableLoss]], count: int) -> torch.Tensor:
    """The K x K Gram of the output-space gradients of a stream of (scale, loss) pieces.

    Pieces are different forward rows (micro-batches, noise levels), so their outputs are
    different coordinates: the step's Gram is the sum of the pieces' scaled Grams."""
    gram = torch.zeros(count, count, dtype=torch.float64)
    for scale, loss in pieces:
        stack = output_stack(loss).cpu()
        if stack.shape[0] != count:
            raise ValueError(f"a piece has {stack.shape[0]} objectives, expected {count}")
        gram += scale**2 * (stack @ stack.T)
    return gram


def gram_factor(gram: torch.Tensor) -> torch.Tensor:
    """A K x K matrix F with F F^T = ``gram`` (symmetric PSD, negative round-off cut):
    rows with the Gram's norms and angles, for a harmonizer that reads only those. An
    objective whose gradient is exactly zero keeps an exactly zero row (the
    decomposition's round-off would give it a tiny norm, and MGDA a huge weight)."""
    gram = gram.double()
    values, vectors = torch.linalg.eigh(gram)
    factor = vectors * values.clamp_min(0).sqrt()
    factor[gram.diagonal() == 0] = 0.0
    return factor


def output_cosines(gram: torch.Tensor, weights: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """cos(sum_k w_k o_k, o_j) for every objective j, from the output-space Gram (NaN for
    an objective with a zero gradient)."""
    w = torch.as_tensor(weights, dtype=torch.float64)
    gram = gram.double()
    inner = gram @ w
    norm = (w @ inner).clamp_min(0).sqrt()
    return inner / (norm * gram.diagonal().clamp_min(0).sqrt())
