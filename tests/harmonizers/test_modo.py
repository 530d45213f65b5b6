"""MoDo against its definition and TorchJD over consecutive calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.harmonizers import (
    MoDo,
)

from .stacks import STACK_FAMILIES, U, run, simplex_projection

aggregation = pytest.importorskip("torchjd.aggregation")


def modo_reference(stacks: list[torch.Tensor], gamma: float, rho: float) -> np.ndarray:
    """MoDo (Chen et al. 2023, the authors' code), one sample.

    lambda <- Proj(lambda - gamma (G + rho) lambda).
    """
    count = stacks[0].shape[0]
    weights = np.full(count, 1.0 / count)
    history = []
    for stack in stacks:
        jacobian = stack.numpy()
        gram = jacobian @ jacobian.T
        weights = simplex_projection(weights - gamma * (gram @ weights + rho * weights))
        history.append(weights)
    return np.stack(history)


def amplified(step_error: float, lipschitz: list[float]) -> np.ndarray:
    """Bound after each step on an error of ``step_error`` made at every step and carried
    through step maps with the given Lipschitz constants."""
    bounds, total = [], 0.0
    for constant in lipschitz:
        total = constant * total + step_error
        bounds.append(total)
    return np.array(bounds)


def projected_step_lipschitz(matrices: list[np.ndarray], rate: float, shrink: float) -> list:
    """||shrink I - rate A||_2 for symmetric PSD A: the Lipschitz constant of one step."""
    constants = []
    for matrix in matrices:
        eigenvalues = np.linalg.eigvalsh(matrix)
        constants.append(float(np.abs(shrink - rate * eigenvalues).max()))
    return constants


MODO_SETTINGS = [(0.1, 0.1), (0.01, 0.0), (1e-3, 0.5)]


def modo_tolerance(stacks: list[torch.Tensor], gamma: float, rho: float) -> np.ndarray:
    grams = [(stack @ stack.T).numpy() for stack in stacks]
    size = max(float(np.abs(gram).sum(axis=1).max()) for gram in grams)
    # One step: y = (1 - gamma rho) lambda - gamma G lambda has K-term sums of size gamma
    # ||G||_inf, then a projection: 4 (K + 2) u (1 + gamma ||G||_inf) covers both.
    count = len(grams[0])
    step = 4 * (count + 2) * U * (1.0 + gamma * size)
    return amplified(step, projected_step_lipschitz(grams, gamma, 1.0 - gamma * rho))


@pytest.mark.parametrize("family", STACK_FAMILIES)
@pytest.mark.parametrize(("gamma", "rho"), MODO_SETTINGS)
def test_modo_matches_its_definition_and_torchjd(family: str, gamma: float, rho: float) -> None:
    stacks = STACK_FAMILIES[family]
    ours = run(MoDo(gamma=gamma, rho=rho), stacks)
    reference = modo_reference(stacks, gamma, rho)
    weighting = aggregation.MoDoWeighting(gamma=gamma, rho=rho)
    theirs = np.stack([weighting(stack @ stack.T).numpy() for stack in stacks])
    tolerance = modo_tolerance(stacks, gamma, rho)[:, None]
    assert (np.abs(ours - reference) <= tolerance).all()
    assert (np.abs(ours - theirs) <= tolerance).all()


def test_modo_limit_where_the_step_overflows() -> None:
    # Norms 1e-160 .. 1e160: gamma G lambda overflows; lambda goes to the face where G lambda
    # is least, which for two conflicting gradients is the smaller gradient's vertex.
    stack = torch.tensor([[1e160, 0.0], [-1e-160, 1e-170]], dtype=torch.float64)
    weights = MoDo()(stack).weights
    torch.testing.assert_close(weights, torch.tensor([0.0, 1.0], dtype=torch.float64))
