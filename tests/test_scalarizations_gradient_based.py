"""GradNorm, DB-MTL, MoCo, IMTL and COSMOS: each against its update written out in numpy on a
fixed tiny model, step by step; the surrogate's gradient on the shared parameters and the
heads against the method's intended direction; COSMOS against TorchJD; state round trips;
validation; a 2-task model trained with each method."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tolerances import chain_atol, eps
from torch import nn

from mogradient.scalarizations.base import Scalarization
from mogradient.scalarizations.cosmos import COSMOS
from mogradient.scalarizations.db_mtl import DBMTL
from mogradient.scalarizations.gradnorm import GradNorm
from mogradient.scalarizations.imtl import IMTL
from mogradient.scalarizations.moco import MoCo

F64 = torch.float64
STEPS = 5
# Reference and method evaluate the same float64 formulas in other orders (sums of <= 16
# terms, a norm, a K x K solve or sort): tens of ulps of the result's scale per step. The
# reference's state (averages, lambda, weights) evolves on its own, so the budget grows
# with the step count. A wrong formula or update order is off by O(1) of the scale.
ULPS_PER_STEP = 64


def budget(scale: float, step: int) -> float:
    return chain_atol(F64, max(1.0, scale), ULPS_PER_STEP * (step + 1))


def assert_close(actual, expected, atol: float, what: str = "") -> None:
    actual = np.asarray(torch.as_tensor(actual, dtype=F64).detach().cpu())
    expected = np.asarray(expected, dtype=np.float64)
    difference = float(np.max(np.abs(actual - expected)))
    assert difference <= atol, (what, difference, atol, actual, expected)


class Problem:
    """A fixed float64 trunk (Linear + tanh) with one linear head per task, MSE losses."""

    def __init__(self, tasks: int = 3, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(16, 3, generator=generator, dtype=F64)
        self.targets = torch.randn(tasks, 16, generator=generator, dtype=F64) * torch.arange(
            1.0, tasks + 1, dtype=F64
        ).unsqueeze(1)
        torch.manual_seed(seed)
        self.trunk = nn.Linear(3, 4).double()
        self.heads = nn.ModuleList(nn.Linear(4, 1).double() for _ in range(tasks))

    @property
    def shared(self) -> list[torch.Tensor]:
        return list(self.trunk.parameters())

    @property
    def head_parameters(self) -> list[torch.Tensor]:
        return list(self.heads.parameters())

    def losses(self) -> torch.Tensor:
        features = torch.tanh(self.trunk(self.inputs))
        return torch.stack(
            [
                ((head(features).squeeze(1) - target) ** 2).mean()
                for head, target in zip(self.heads, self.targets, strict=True)
            ]
        )


def jacobian(losses: torch.Tensor, parameters: list[torch.Tensor]) -> np.ndarray:
    """K x D gradients by plain autograd, one loss at a time (not the library's engine)."""
    rows = []
    for loss in losses:
        grads = torch.autograd.grad(loss, parameters, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat(
                [
                    (torch.zeros_like(p) if g is None else g).reshape(-1)
                    for g, p in zip(grads, parameters, strict=True)
                ]
            )
        )
    return torch.stack(rows).numpy()


def flat_grad(parameters: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([p.grad.reshape(-1) for p in parameters]).numpy()


def run(method: Scalarization, problem: Problem, reference, steps: int = STEPS) -> None:
    """Step the model with the method and compare each step with ``reference(L, G, H)``.

    ``L`` are the losses, ``G`` and ``H`` the K x D gradients on the shared parameters and
    the heads; the reference returns the weights, the shared parameters' gradient, the
    heads' coefficients on ``H`` and state to compare (name: (actual, expected, scale)).
    """
    optimizer = torch.optim.SGD(
        [*problem.trunk.parameters(), *problem.heads.parameters(), *method.parameters()], lr=0.1
    )
    for step in range(steps):
        losses = problem.losses()
        shared_jacobian = jacobian(losses, problem.shared)
        head_jacobian = jacobian(losses, problem.head_parameters)
        values = losses.detach().numpy().copy()
        optimizer.zero_grad()
        result = method(losses)
        result.loss.backward()
        expected = reference(values, shared_jacobian, head_jacobian)
        scale = max(
            np.abs(shared_jacobian).sum(0).max() * np.abs(expected["heads"]).max(),
            np.abs(expected["shared"]).max(),
        )
        checks = {
            "weights": (result.weights, expected["weights"], np.abs(expected["weights"]).max()),
            "shared": (flat_grad(problem.shared), expected["shared"], scale),
            "heads": (
                flat_grad(problem.head_parameters),
                expected["heads"] @ head_jacobian,
                np.abs(head_jacobian).max() * np.abs(expected["heads"]).max(),
            ),
            **expected.get("state", {}),
        }
        for name, (actual, wanted, size) in checks.items():
            assert_close(actual, wanted, budget(float(size), step), name)
        optimizer.step()


# --- GradNorm -----------------------------------------------------------------------------


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


# --- DB-MTL -------------------------------------------------------------------------------


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


# --- MoCo ---------------------------------------------------------------------------------


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
        assert_close(
            simplex_projection(torch.tensor(vector)),
            simplex_projection_by_bisection(vector),
            8 * eps(F64),
        )


# --- IMTL ---------------------------------------------------------------------------------


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
    assert_close(result.extras["alpha"], [1 - second, second], budget(1.0, 0))


# --- COSMOS -------------------------------------------------------------------------------

LOSS_ROWS = np.array([[2.0, 0.5, 1.2], [1.6, 0.45, 1.1], [0.9, 0.40, 0.85], [0.7, 0.39, 0.6]])


def test_cosmos_matches_its_formula_and_gradient() -> None:
    lam = 2.0
    method = COSMOS(3, lam, concentration=0.7, seed=1)
    for values in LOSS_ROWS:
        r = method.next_preference().numpy()
        assert np.all(r >= 0) and abs(r.sum() - 1) < 4 * eps(F64)
        losses = torch.tensor(values, dtype=F64, requires_grad=True)
        result = method(losses)
        (gradient,) = torch.autograd.grad(result.loss, losses)
        nr, nl = np.linalg.norm(r), np.linalg.norm(values)
        cosine = r @ values / (nr * nl)
        expected_gradient = r - lam * (r / (nr * nl) - cosine * values / nl**2)
        assert_close(result.loss, r @ values - lam * cosine, budget(lam + 1, 0))
        assert_close(gradient, expected_gradient, budget(lam / nl + 1, 0))
        assert_close(result.weights, gradient, budget(lam / nl + 1, 0))


def test_cosmos_same_as_torchjd() -> None:
    torchjd_scalarization = pytest.importorskip("torchjd.scalarization")
    lam = 3.0
    method = COSMOS(3, lam, seed=4)
    for values in LOSS_ROWS:
        r = method.next_preference()
        theirs = torchjd_scalarization.COSMOS(lam, weights=r.clone())
        ours_in = torch.tensor(values, dtype=F64, requires_grad=True)
        theirs_in = torch.tensor(values, dtype=F64, requires_grad=True)
        our_loss, their_loss = method(ours_in).loss, theirs(theirs_in)
        # torch's cosine_similarity normalizes each vector, then takes the dot product; we
        # divide the dot product by both norms. Each path's cosine is within gamma_{K+4}
        # of the exact one (|cos| <= 1 bounds sum |r_i L_i| / (|r| |L|)), so the losses
        # differ by <= lam * 2 (K + 4) u plus an ulp of the weighted sum.
        k, u = len(values), eps(F64) / 2
        atol = lam * 2 * (k + 4) * u + chain_atol(F64, abs(float(our_loss.detach())) + 1, 2)
        assert abs(float((our_loss - their_loss).detach())) <= atol
        ours_grad = torch.autograd.grad(our_loss, ours_in)[0]
        theirs_grad = torch.autograd.grad(their_loss, theirs_in)[0]
        # The gradient's cosine part has size lam / |L| (times |r| / |r| terms <= 1): the
        # same count of roundings per path, on that scale, a few times for the chain rule.
        grad_atol = chain_atol(F64, lam / np.linalg.norm(values) + 1, 4 * (k + 4))
        torch.testing.assert_close(ours_grad, theirs_grad, rtol=0, atol=grad_atol)


def test_cosmos_preferences_are_seeded_dirichlet_draws() -> None:
    first, second = COSMOS(3, 1.0, seed=7), COSMOS(3, 1.0, seed=7)
    draws = [first.next_preference() for _ in range(5)]
    assert all(torch.equal(a, second.next_preference()) for a in draws)
    assert not torch.equal(COSMOS(3, 1.0, seed=8).next_preference(), draws[0])
    # The global RNG is neither read nor moved.
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first.next_preference()
    assert torch.equal(before, torch.get_rng_state())
    # Dirichlet(a, a, a): mean 1/3, variance a * 2a / ((3a)^2 (3a + 1)) per component.
    for concentration in (1.0, 5.0):
        method = COSMOS(3, 1.0, concentration=concentration, seed=0)
        sample = torch.stack([method.next_preference() for _ in range(3000)]).numpy()
        a = concentration
        variance = 2 * a * a / ((3 * a) ** 2 * (3 * a + 1))
        # 5 standard errors of the mean; the sample variance within 15% (3000 draws).
        assert np.all(np.abs(sample.mean(0) - 1 / 3) < 5 * np.sqrt(variance / 3000))
        assert np.all(np.abs(sample.var(0) / variance - 1) < 0.15), sample.var(0) / variance


# --- state --------------------------------------------------------------------------------

BUILDERS = {
    "gradnorm": lambda k, shared: GradNorm(k, shared, lr=0.1),
    "dbmtl": lambda k, shared: DBMTL(k, shared, beta_sigma=0.5),
    "moco": lambda k, shared: MoCo(k, shared, gamma=1.0),
    "imtl": lambda k, shared: IMTL(k, shared).double(),
    "cosmos": lambda k, shared: COSMOS(k, 1.0, seed=3),
}


def advance(method: Scalarization, problem: Problem, steps: int) -> list[tuple]:
    optimizer = torch.optim.SGD(
        [*problem.trunk.parameters(), *problem.heads.parameters(), *method.parameters()], lr=0.05
    )
    produced = []
    for _ in range(steps):
        if isinstance(method, COSMOS):
            method.next_preference()
        result = method(problem.losses())
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        produced.append((result.loss.detach().clone(), result.weights.clone()))
    return produced


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_state_dict_round_trip_resumes_identically(name: str) -> None:
    problem = Problem()
    original = BUILDERS[name](3, problem.shared)
    advance(original, problem, 3)
    state = {key: value.clone() for key, value in original.state_dict().items()}
    twin = copy.deepcopy(problem)  # the same model, as a checkpoint would restore it
    restored = BUILDERS[name](3, twin.shared)
    restored.load_state_dict(state)
    for key, value in original.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    ours, theirs = advance(original, problem, 3), advance(restored, twin, 3)
    for (loss_a, weights_a), (loss_b, weights_b) in zip(ours, theirs, strict=True):
        assert torch.equal(loss_a, loss_b) and torch.equal(weights_a, weights_b)
    for mine, yours in zip(problem.shared, twin.shared, strict=True):
        assert torch.equal(mine, yours)
    with pytest.raises(RuntimeError, match="size mismatch"):
        BUILDERS[name](2, Problem(tasks=2).shared).load_state_dict(state)


def test_shared_parameters_are_not_state_or_parameters() -> None:
    problem = Problem()
    for name, build in BUILDERS.items():
        method = build(3, problem.shared)
        keys = set(method.state_dict())
        assert not any(key.startswith("_shared") for key in keys), (name, keys)
        expected = [(3,)] if name == "imtl" else []
        assert [tuple(p.shape) for p in method.parameters()] == expected, name


# --- validation ---------------------------------------------------------------------------


def test_invalid_settings_and_losses_are_named() -> None:
    problem = Problem()
    frozen = nn.Linear(2, 2).requires_grad_(False)
    for build, error, message in [
        (lambda: GradNorm(3, []), ValueError, "GradNorm: shared is empty"),
        (lambda: MoCo(3, frozen.parameters()), ValueError, r"shared\[0\].*does not require grad"),
        (lambda: DBMTL(3, problem.trunk.named_parameters()), TypeError, "not named_parameters"),
        (lambda: MoCo(3, problem.shared, beta=1.5), ValueError, r"beta must be in \(0, 1\]"),
        (lambda: DBMTL(3, problem.shared, beta=1.0), ValueError, r"beta must be in \[0, 1\)"),
        (lambda: GradNorm(3, problem.shared, lr=0.0), ValueError, "lr must be finite and positive"),
        (lambda: COSMOS(3, -1.0), ValueError, "lam must be finite and non-negative"),
        (lambda: COSMOS(3, 1.0, concentration=0.0), ValueError, "concentration"),
    ]:
        with pytest.raises(error, match=message):
            build()
    for method, values, message in [
        (GradNorm(3, problem.shared), [1.0, 0.0, 1.0], "GradNorm: task 1's loss is 0.0"),
        (DBMTL(3, problem.shared), [1.0, 1.0, -0.5], "DBMTL: task 2's loss is -0.5"),
        (IMTL(3, problem.shared), [-1.0, 1.0, 1.0], "IMTL: task 0's loss is -1.0"),
        (MoCo(3, problem.shared, normalize=True), [1.0, -1.0, 1.0], "normalize=True"),
        (COSMOS(3, 1.0, seed=0), [1.0, 1.0, 1.0], r"call next_preference\(\) before"),
    ]:
        with pytest.raises(ValueError, match=message):
            method(torch.tensor(values, dtype=F64))
    with pytest.raises(ValueError, match=r"MoCo differentiates the losses but they carry no graph"):
        MoCo(3, problem.shared)(problem.losses().detach())
    cosmos = COSMOS(3, 1.0, seed=0)
    cosmos.next_preference()
    with pytest.raises(ValueError, match=r"every loss is 0\.0"):
        cosmos(torch.zeros(3, dtype=F64))


# --- end to end ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_a_tiny_two_task_model_trains_with_each_method(name: str) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    targets = [inputs @ torch.randn(4, generator=generator), torch.tanh(inputs[:, 0]) * 3.0]
    torch.manual_seed(0)
    conditioned = name == "cosmos"  # COSMOS's model sees the preference with its input
    trunk = nn.Sequential(nn.Linear(4 + 2 * conditioned, 16), nn.Tanh())
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    builders = {
        "gradnorm": lambda: GradNorm(2, trunk[0].parameters()),
        "dbmtl": lambda: DBMTL(2, trunk.parameters()),
        "moco": lambda: MoCo(2, trunk.parameters()),
        "imtl": lambda: IMTL(2, trunk.parameters()),
        "cosmos": lambda: COSMOS(2, 1.0, seed=0),
    }
    method = builders[name]()
    parameters = [*trunk.parameters(), *heads.parameters(), *method.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.02)
    history = []
    for _ in range(40):
        features_in = inputs
        if conditioned:
            features_in = torch.cat([inputs, method.next_preference().float().expand(64, 2)], 1)
        features = trunk(features_in)
        losses = torch.stack(
            [
                ((h(features).squeeze(1) - y) ** 2).mean()
                for h, y in zip(heads, targets, strict=True)
            ]
        )
        result = method(losses)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        assert torch.isfinite(result.loss) and torch.isfinite(result.weights).all()
        history.append(losses.detach())
    history = torch.stack(history)
    assert torch.isfinite(history).all()
    assert (history[-5:].mean(0) < 0.7 * history[:5].mean(0)).all(), history[[0, -1]]
