"""Our GradNorm, IMTL, UW, DWA and GLS against LibMTL 1.1.5's own weightings, step by step.

Each test builds two copies of one seeded model (a Linear + tanh trunk, one linear head per
task, MSE losses on targets of scales 1, 3 and 10, a fresh batch every step), runs
LibMTL's ``backward`` on one copy (bound by the benchmark's LibMTL driver, as in the MTL
head-to-head) and ours on the other, and compares at every step what each produced: the
task weights, the gradients on the shared parameters, on the heads and on the learned
scales. Both copies then take the same SGD step; where the methods agree they evolve
independently, so any drift would show. In float64 LibMTL runs under a float64 default
dtype (its gradient buffers are ``torch.zeros`` of the default dtype).

Differences by design, asserted as such rather than hidden:

* GradNorm. LibMTL learns logits z with w = K softmax(z), stepped by the training
  optimizer; we step w itself by gradient descent on L_grad, clip at zero and renormalize
  to sum K (as the paper does), so one step of each from the same w lands elsewhere.
  Both minimize the same L_grad: with LibMTL's logits set to log w before each step, the
  L_grad it backpropagates must equal ours, and its gradient on z must be the chain rule
  of ours on w, w * (q - (w . q) / K) with q = dL_grad/dw = sign(G - target) ||grad_W L||.
  LibMTL backpropagates each loss alone, so the heads get the unweighted sum_k grad L_k;
  ours gets head k w_k grad L_k, the gradient of sum_k w_k L_k on which the paper trains
  every other weight. LibMTL takes L(0) as epoch 0's mean loss and reweights only from
  epoch 1; ours takes the first call's losses: the test gives LibMTL ours and starts it
  at epoch 1. The copies are resynced to ours before every step, since the heads differ.
* GLS. The same gradients. LibMTL reports L_k / (K prod_j L_j) as its weights, which is
  not d loss / d L_k; ours reports that derivative, G / (K L_k) with G the geometric mean.
* IMTL. Where G v = (||g_k||)_k has sum(v) < 0, LibMTL's alpha = v / sum(v) points the
  shared step uphill for every loss; ours divides by |sum(v)| (IMTL-G's "negative_sum"
  fallback), the same direction reversed. Elsewhere the two agree to rounding.
* UW starts LibMTL's way here (log-variances -0.5; ours defaults to the paper's 0).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tolerances import chain_atol
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_dtype  # noqa: E402
from benchmarks.mtl.methods import LibMTL, libmtl_installed  # noqa: E402
from benchmarks.mtl.parity_model import TASKS, Model, batches  # noqa: E402
from mogradient.scalarizations.dwa import DWA  # noqa: E402
from mogradient.scalarizations.gls import GLS  # noqa: E402
from mogradient.scalarizations.gradnorm import GradNorm  # noqa: E402
from mogradient.scalarizations.imtl import IMTL  # noqa: E402
from mogradient.scalarizations.uw import UW  # noqa: E402

if not libmtl_installed():
    pytest.skip(
        "LibMTL is not installed (make mtl installs LibMTL==1.1.5 with --no-deps)",
        allow_module_level=True,
    )

F64 = torch.float64
STEPS = 5
LR = 0.05
DTYPES = [F64, torch.float32]
# The two sides evaluate the same formulas in other orders (per-loss backward vs our
# gradient engine, einsum vs matmul, float32 vs our float64 norms): a few ulps of the
# result's scale per operation, a few dozen operations deep. The copies evolve on their
# own (SGD on parameters each side computed), so the budget grows with the step count.
# A wrong formula, order or sign is off by O(1) of the scale.
ULPS_PER_STEP = 64


def libmtl(name: str, model: Model, dtype: torch.dtype, **options: float) -> LibMTL:
    driver = LibMTL(name, dict(options))
    with default_dtype(dtype):
        driver.bind(model)
    return driver


def run_libmtl(driver: LibMTL, model: Model, losses: torch.Tensor) -> torch.Tensor:
    with default_dtype(losses.dtype):
        return driver.backward(model, list(losses), None)


def flat(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameter.grad.reshape(-1) for parameter in parameters]).double()


def heads(model: Model) -> torch.Tensor:
    """K x (head size) gradients: head k's row is what loss k sent it."""
    return torch.stack([flat(list(head.parameters())) for head in model.heads])


def check(
    actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, step: int, what: str
) -> None:
    """Equal up to the rounding budget at ``step``, in ulps of max(1, |expected|)."""
    actual = torch.as_tensor(actual, dtype=torch.float64).detach()
    expected = torch.as_tensor(expected, dtype=torch.float64).detach()
    scale = max(1.0, float(expected.abs().max()))
    difference = float((actual - expected).abs().max())
    atol = chain_atol(dtype, scale, ULPS_PER_STEP * (step + 1))
    assert difference <= atol, (what, step, difference, atol, actual, expected)


def recorded(into: list[torch.Tensor]) -> Callable[..., None]:
    """Tensor.backward that first keeps (a detached copy of) what it backpropagates."""
    backward = torch.Tensor.backward

    def record(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        into.append(tensor.detach().clone())
        backward(tensor, *args, **kwargs)

    return record


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradnorm_takes_libmtls_weights_shared_gradient_and_l_grad(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
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


def test_imtl_flips_where_libmtls_weights_would_ascend() -> None:
    # Here G v = (||g_k||)_k has sum(v) < 0. LibMTL divides by sum(v): its direction has
    # a negative projection on every gradient, so the step raises every loss. We divide by
    # |sum(v)| (IMTL-G's documented "negative_sum" fallback): the same direction, reversed.
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


@pytest.mark.parametrize("dtype", DTYPES)
def test_uw_matches_libmtl_over_steps(dtype: torch.dtype) -> None:
    ours, theirs = Model(dtype), Model(dtype)
    method = UW(TASKS, init=-0.5).to(dtype)
    driver = libmtl("UW", theirs, dtype)
    ours_optimizer = torch.optim.SGD([*ours.parameters(), *method.parameters()], lr=LR)
    their_optimizer = torch.optim.SGD(
        [*theirs.parameters(), *driver._weighting.parameters()], lr=LR
    )
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        their_weights = run_libmtl(driver, theirs, theirs.losses(batch))
        result = method(ours.losses(batch))
        result.loss.backward()

        check(result.weights, their_weights, dtype, step, "weights")
        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        check(heads(ours), heads(theirs), dtype, step, "heads")
        grad = method.log_variances.grad
        check(grad, driver._weighting.loss_scale.grad, dtype, step, "log-variances")
        ours_optimizer.step()
        their_optimizer.step()


@pytest.mark.parametrize("dtype", DTYPES)
def test_dwa_matches_libmtl_over_epochs(dtype: torch.dtype) -> None:
    epochs, per_epoch = 4, 2
    ours, theirs = Model(dtype), Model(dtype)
    method = DWA(TASKS, temperature=2.0)
    driver = libmtl("DWA", theirs, dtype, T=2.0)
    driver._weighting.train_loss_buffer = np.zeros((TASKS, epochs))
    ours_optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    data = batches(dtype, epochs * per_epoch)
    for epoch in range(epochs):
        driver._weighting.epoch = epoch
        their_sum = np.zeros(TASKS)
        for batch in data[epoch * per_epoch : (epoch + 1) * per_epoch]:
            ours_optimizer.zero_grad()
            their_optimizer.zero_grad()
            their_losses = theirs.losses(batch)
            their_sum += their_losses.detach().double().numpy()
            their_weights = run_libmtl(driver, theirs, their_losses)
            result = method(ours.losses(batch))
            result.loss.backward()

            check(result.weights, their_weights, dtype, epoch, "weights")
            shared, their_shared = flat(ours.shared_parameters()), flat(theirs.shared_parameters())
            check(shared, their_shared, dtype, epoch, "W")
            check(heads(ours), heads(theirs), dtype, epoch, "heads")
            ours_optimizer.step()
            their_optimizer.step()
        driver._weighting.train_loss_buffer[:, epoch] = their_sum / per_epoch
        method.end_epoch()
    assert float(np.ptp(their_weights.numpy())) > 0.01  # the last epoch reweighed


@pytest.mark.parametrize("dtype", DTYPES)
def test_gls_has_libmtls_gradients_and_reports_the_derivative(dtype: torch.dtype) -> None:
    ours, theirs = Model(dtype), Model(dtype)
    method = GLS(TASKS)
    driver = libmtl("GLS", theirs, dtype)
    ours_optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        their_losses = theirs.losses(batch)
        their_weights = run_libmtl(driver, theirs, their_losses)
        losses = ours.losses(batch)
        result = method(losses)
        result.loss.backward()

        check(flat(ours.shared_parameters()), flat(theirs.shared_parameters()), dtype, step, "W")
        check(heads(ours), heads(theirs), dtype, step, "heads")
        values = losses.detach().double()
        mean = values.prod() ** (1 / TASKS)
        # Scaled by the sum of the weights: the two reports' values are ~1e-4 and ~1e-1.
        expected = mean / (TASKS * values)
        check(result.weights / expected.sum(), expected / expected.sum(), dtype, step, "ours")
        theirs_expected = values / (TASKS * values.prod())
        check(
            their_weights / theirs_expected.sum(),
            theirs_expected / theirs_expected.sum(),
            dtype,
            step,
            "LibMTL's",
        )
        ours_optimizer.step()
        their_optimizer.step()
