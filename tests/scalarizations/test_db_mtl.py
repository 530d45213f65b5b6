"""DB-MTL: its update written out in numpy on a fixed tiny model, step by step; bad
settings and losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.scalarizations import DBMTL

from .helpers import F64, Problem, run


@pytest.mark.parametrize("beta_sigma", [0.0, 0.5])
def test_db_mtl_matches_its_update_over_steps(beta_sigma: float) -> None:
    problem = Problem()
    beta, shift = 0.9, 1e-8
    method = DBMTL(3, problem.shared, beta=beta, beta_sigma=beta_sigma)
    state = {"h": np.zeros((3, 16)), "t": 0}

    def reference(values, shared, heads):
        log_gradients = shared / (values + shift)[:, None]  # grad log(L + eps) = grad L / (L + eps)
        state["t"] += 1
        decay = beta / state["t"] ** beta_sigma
        state["h"] = decay * state["h"] + (1 - decay) * log_gradients
        norms = np.linalg.norm(state["h"], axis=1)
        direction = (norms.max() / (norms + shift)) @ state["h"]
        return {
            "weights": 1 / (values + shift),
            "shared": direction,
            "heads": 1 / (values + shift),
            "state": {"averages": (method.averages, state["h"], np.abs(state["h"]).max())},
        }

    run(method, problem, reference)


def test_bad_settings_and_losses_are_named() -> None:
    problem = Problem()
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\)"):
        DBMTL(3, problem.shared, beta=1.0)
    with pytest.raises(ValueError, match=r"DBMTL: task 2's loss is -0.5"):
        DBMTL(3, problem.shared)(torch.tensor([1.0, 1.0, -0.5], dtype=F64))
