"""GradNorm: its update written out in numpy on a fixed tiny model, step by step; LibMTL's
weights, shared gradient and L_grad; bad settings and losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mogradient.scalarizations import GradNorm

from .helpers import F64, Problem, run
from .libmtl import (
    DTYPES,
    LR,
    STEPS,
    TASKS,
    Model,
    batches,
    check,
    flat,
    heads,
    libmtl,
    needs_libmtl,
    recorded,
    run_libmtl,
)


def test_gradnorm_matches_its_update_over_steps() -> None:
    problem = Problem()
    alpha, lr = 1.5, 0.2
    method = GradNorm(3, problem.shared, alpha=alpha, lr=lr)
    state = {"w": np.ones(3), "initial": None}

    def reference(values, shared, heads):
        norms = np.linalg.norm(shared, axis=1)
        if state["initial"] is None:
            state["initial"] = values
        w = state["w"]
        g = w * norms
        inverse_rate = values / state["initial"]
        target = g.mean() * (inverse_rate / inverse_rate.mean()) ** alpha
        stepped = np.maximum(w - lr * np.sign(g - target) * norms, 0.0)
        state["w"] = stepped * 3 / stepped.sum()
        return {
            "weights": w,
            "shared": w @ shared,
            "heads": w,
            "state": {"next": (method.task_weights, state["w"], 3.0)},
        }

    run(method, problem, reference)
    assert np.ptp(state["w"]) > 0.05, state["w"]  # the weights moved


@needs_libmtl
@pytest.mark.parametrize("dtype", DTYPES)
def test_gradnorm_takes_libmtls_weights_shared_gradient_and_l_grad(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Differences by design, asserted as such rather than hidden.

    LibMTL learns logits z with w = K softmax(z), stepped by the training optimizer; we
    step w itself by gradient descent on L_grad, clip at zero and renormalize to sum K (as
    the paper does), so one step of each from the same w lands elsewhere. Both minimize the
    same L_grad: with LibMTL's logits set to log w before each step, the L_grad it
    backpropagates must equal ours, and its gradient on z must be the chain rule of ours on
    w, w * (q - (w . q) / K) with q = dL_grad/dw = sign(G - target) ||grad_W L||.
    LibMTL backpropagates each loss alone, so the heads get the unweighted sum_k grad L_k;
    ours gets head k w_k grad L_k, the gradient of sum_k w_k L_k on which the paper trains
    every other weight. LibMTL takes L(0) as epoch 0's mean loss and reweights only from
    epoch 1; ours takes the first call's losses: the test gives LibMTL ours and starts it
    at epoch 1. The copies are resynced to ours before every step, since the heads differ.
    """
    ours, theirs = Model(dtype), Model(dtype)
    method = GradNorm(TASKS, ours.shared_parameters(), alpha=1.5, lr=0.01)
    driver = libmtl("GradNorm", theirs, dtype, alpha=1.5)
    weighting = driver._weighting  # the bound LibMTL object: its logits, epoch and L(0)
    weighting.epoch = 1
    optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    for step, batch in enumerate(batches(dtype, STEPS)):
        theirs.load_state_dict(ours.state_dict())
        with torch.no_grad():
            weighting.loss_scale.copy_(method.task_weights.log())
        weighting.loss_scale.grad = None
        theirs.zero_grad()
        optimizer.zero_grad()
        their_losses = theirs.losses(batch)
        if step == 0:
            weighting.train_loss_buffer = their_losses.detach().double().numpy()[:, None]
        backpropagated: list[torch.Tensor] = []
        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "backward", recorded(backpropagated))
            their_weights = run_libmtl(driver, theirs, their_losses)
        assert len(backpropagated) == TASKS + 1  # each loss alone, then L_grad
        result = method(ours.losses(batch))
        result.loss.backward()

        weights = result.weights.double()
        check(weights, their_weights, dtype, step, "weights")
        check(result.extras["gradnorm_loss"], backpropagated[-1], dtype, step, "L_grad")
        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        # LibMTL's heads get each loss's own gradient, ours the w-weighted one.
        check(heads(ours), weights[:, None] * heads(theirs), dtype, step, "heads")
        norms, targets = result.extras["gradient_norms"], result.extras["targets"]
        gap = weights * norms - targets
        assert float(gap.abs().min()) > 1e-3 * float(targets.max())  # the signs are settled
        slope = torch.sign(gap) * norms  # dL_grad/dw
        logit_slope = weights * (slope - (weights @ slope) / TASKS)  # through w = K softmax(z)
        check(weighting.loss_scale.grad, logit_slope, dtype, step, "L_grad on logits")
        optimizer.step()
    assert float(np.ptp(method.task_weights.numpy())) > 0.05  # the weights moved


def test_bad_settings_and_losses_are_named() -> None:
    problem = Problem()
    with pytest.raises(ValueError, match="lr must be finite and positive"):
        GradNorm(3, problem.shared, lr=0.0)
    with pytest.raises(ValueError, match=r"GradNorm: task 1's loss is 0.0"):
        GradNorm(3, problem.shared)(torch.tensor([1.0, 0.0, 1.0], dtype=F64))
