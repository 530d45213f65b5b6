"""MoCo: its update written out in numpy on a fixed tiny model, step by step, and its
surrogate's gradient Y^T lambda; the simplex projection it uses; bad settings and losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import eps

from mogradient.scalarizations import MoCo

from .helpers import F64, Problem, assert_within, run


def simplex_projection_by_bisection(v: np.ndarray) -> np.ndarray:
    """argmin ||x - v|| on the simplex: x = max(v - theta, 0) with sum 1, theta by bisection."""
    low, high = v.min() - 1.0, v.max()
    for _ in range(200):
        middle = (low + high) / 2
        if np.maximum(v - middle, 0).sum() > 1:
            low = middle
        else:
            high = middle
    return np.maximum(v - (low + high) / 2, 0)


@pytest.mark.parametrize("normalize", [False, True])
def test_moco_matches_its_update_and_its_surrogate_gives_y_lambda(normalize: bool) -> None:
    problem = Problem()
    beta, beta_sigma, gamma, gamma_sigma, rho = 0.5, 0.5, 2.0, 0.5, 0.1
    method = MoCo(3, problem.shared, beta, beta_sigma, gamma, gamma_sigma, rho, normalize)
    state = {"y": np.zeros((3, 16)), "lam": np.full(3, 1 / 3), "t": 0}

    def reference(values, shared, heads):
        target = shared
        if normalize:
            target = shared / (np.linalg.norm(shared, axis=1) + 1e-8)[:, None] * values[:, None]
        state["t"] += 1
        t = state["t"]
        y = state["y"] - beta / t**beta_sigma * (state["y"] - target)
        matrix = y @ y.T + rho * np.eye(3)
        lam = simplex_projection_by_bisection(
            state["lam"] - gamma / t**gamma_sigma * matrix @ state["lam"]
        )
        state["y"], state["lam"] = y, lam
        return {
            "weights": lam,
            "shared": y.T @ lam,  # the surrogate's whole point: d = Y^T lambda
            "heads": lam,
            "state": {"tracked": (method.tracked, y, np.abs(y).max())},
        }

    run(method, problem, reference)
    assert np.ptp(state["lam"]) > 0.05, state["lam"]  # lambda left the uniform start


def test_simplex_projection_on_vertices_and_inside() -> None:
    from mogradient.harmonizers._simplex import project_to_simplex as simplex_projection

    for v in ([0.2, 0.3, 0.5], [5.0, -1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, -3.0]):
        vector = np.array(v)
        assert_within(
            simplex_projection(torch.tensor(vector)),
            simplex_projection_by_bisection(vector),
            8 * eps(F64),
        )


def test_bad_settings_and_losses_are_named() -> None:
    problem = Problem()
    with pytest.raises(ValueError, match=r"beta must be in \(0, 1\]"):
        MoCo(3, problem.shared, beta=1.5)
    with pytest.raises(ValueError, match="normalize=True"):
        MoCo(3, problem.shared, normalize=True)(torch.tensor([1.0, -1.0, 1.0], dtype=F64))
