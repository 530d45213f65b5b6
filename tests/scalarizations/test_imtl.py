"""IMTL (IMTL-L's scales, then IMTL-G on the scaled gradients): its update written out in
numpy on a fixed tiny model, step by step; LibMTL's two-task formula and its code over
steps; where LibMTL's weights would ascend; bad losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import chain_atol
from torch import nn

from mogradient.scalarizations import IMTL

from .helpers import F64, Problem, assert_within, budget, jacobian, run
from .libmtl import (
    DTYPES,
    LR,
    STEPS,
    TASKS,
    ULPS_PER_STEP,
    Model,
    batches,
    check,
    flat,
    heads,
    libmtl,
    needs_libmtl,
    run_libmtl,
)


def imtl_g_weights(stack: np.ndarray) -> np.ndarray:
    """Liu et al.'s closed form: G v = (||g_k||)_k, alpha = v / sum(v)."""
    v = np.linalg.solve(stack @ stack.T, np.linalg.norm(stack, axis=1))
    return v / v.sum()


def test_imtl_matches_imtl_l_then_imtl_g_over_steps() -> None:
    problem = Problem()
    method = IMTL(3, problem.shared).double()
    state = {"s": np.zeros(3)}

    def reference(values, shared, heads):
        scales = np.exp(state["s"])
        scaled = scales[:, None] * shared
        alpha = imtl_g_weights(scaled)
        # The projections of d on every unit gradient are equal (IMTL-G's defining property).
        direction = alpha @ scaled
        projections = scaled @ direction / np.linalg.norm(scaled, axis=1)
        assert np.ptp(projections) < 1e-10 * np.abs(projections).max()
        s_gradient = scales * values - 1
        expected_s = state["s"] - 0.1 * s_gradient  # SGD on exp(s) L - s after this step
        current_s = state["s"]
        state["s"] = expected_s
        return {
            "weights": scales,
            "shared": direction,
            "heads": scales,
            "state": {
                "s_grad": (method.loss_scales.log_scales.grad, s_gradient, 1.0),
                "s": (method.loss_scales.log_scales, current_s, 1.0),
            },
        }

    run(method, problem, reference)


def test_imtl_alpha_is_libmtl_two_task_formula() -> None:
    # LibMTL's 2-task form: alpha_2 = g_1 . u^T (D u^T)^-1, D = g_1 - g_2, u = u_1 - u_2.
    problem = Problem(tasks=2)
    method = IMTL(2, problem.shared).double()
    losses = problem.losses()
    stack = jacobian(losses, problem.shared)
    result = method(losses)
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True)
    difference, unit_difference = stack[0] - stack[1], units[0] - units[1]
    second = stack[0] @ unit_difference / (difference @ unit_difference)
    assert_within(result.extras["alpha"], [1 - second, second], budget(1.0, 0))


@needs_libmtl
@pytest.mark.parametrize("dtype", DTYPES)
def test_imtl_matches_libmtl_over_steps(dtype: torch.dtype) -> None:
    ours, theirs = Model(dtype), Model(dtype)
    method = IMTL(TASKS, ours.shared_parameters()).to(dtype)
    driver = libmtl("IMTL", theirs, dtype)
    ours_optimizer = torch.optim.SGD([*ours.parameters(), *method.parameters()], lr=LR)
    their_optimizer = torch.optim.SGD(
        [*theirs.parameters(), *driver._weighting.parameters()], lr=LR
    )
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        their_scales = driver._weighting.loss_scale.detach().exp()
        alpha = run_libmtl(driver, theirs, theirs.losses(batch))
        result = method(ours.losses(batch))
        result.loss.backward()

        check(result.extras["alpha"], alpha, dtype, step, "alpha")
        check(result.weights, their_scales, dtype, step, "exp(s)")
        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        check(heads(ours), heads(theirs), dtype, step, "heads")
        check(
            method.loss_scales.log_scales.grad,
            driver._weighting.loss_scale.grad,
            dtype,
            step,
            "scales",
        )
        ours_optimizer.step()
        their_optimizer.step()
    assert float(np.ptp(alpha.numpy())) > 0.05  # IMTL-G did not settle on equal weights


class KnownGradients(nn.Module):
    """Losses 1 + <g_k, p> at p = 0: the shared gradients are the given rows g_k."""

    def __init__(self, gradients: torch.Tensor) -> None:
        super().__init__()
        self.gradients = gradients
        self.trunk = nn.Module()
        self.trunk.point = nn.Parameter(torch.zeros(gradients.shape[1], dtype=gradients.dtype))
        self.heads = nn.ModuleList(nn.Identity() for _ in gradients)  # LibMTL counts them

    def shared_parameters(self) -> list[torch.Tensor]:
        return [self.trunk.point]

    def losses(self) -> torch.Tensor:
        return 1 + self.gradients @ self.trunk.point


@needs_libmtl
def test_imtl_flips_where_libmtls_weights_would_ascend() -> None:
    # A difference by design. Here G v = (||g_k||)_k has sum(v) < 0. LibMTL divides by
    # sum(v): its direction has a negative projection on every gradient, so the step raises
    # every loss. We divide by |sum(v)| (IMTL-G's documented "negative_sum" fallback): the
    # same direction, reversed. Elsewhere the two agree to rounding.
    rows = torch.tensor([[-1.9, -0.8, -0.1], [-0.5, -0.1, 0.1], [0.9, 2.2, 0.7]], dtype=F64)
    ours, theirs = KnownGradients(rows), KnownGradients(rows)
    method = IMTL(TASKS, ours.shared_parameters()).double()
    driver = libmtl("IMTL", theirs, F64)
    alpha = run_libmtl(driver, theirs, theirs.losses())
    result = method(ours.losses())
    result.loss.backward()

    assert result.extras["fallback"] == "negative_sum"
    # Both solve G v = (||g_k||)_k (condition number ~1.5e3 here): that many more ulps.
    condition = float(torch.linalg.cond(rows @ rows.T))
    scale = float(alpha.abs().max())
    atol = chain_atol(F64, scale, ULPS_PER_STEP * condition)
    assert float((result.extras["alpha"] + alpha).abs().max()) <= atol
    their_direction, direction = flat(theirs.shared_parameters()), flat(ours.shared_parameters())
    assert bool((rows @ their_direction < 0).all()), rows @ their_direction
    assert bool((rows @ direction > 0).all()), rows @ direction
    assert float((direction + their_direction).abs().max()) <= atol * float(rows.abs().sum())


def test_a_negative_loss_is_named() -> None:
    problem = Problem()
    with pytest.raises(ValueError, match=r"IMTL: task 0's loss is -1.0"):
        IMTL(3, problem.shared)(torch.tensor([-1.0, 1.0, 1.0], dtype=F64))
