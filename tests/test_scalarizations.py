"""Scalarizations: each method against its formula written out in numpy, step by step for
the stateful ones; gradients against finite differences; state round trips; validation;
TorchJD 0.18 on identical inputs; a tiny 2-task model trained with each method."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from tolerances import chain_atol, eps, reduction_atol
from torch import nn

from mogradient.scalarizations import (
    DWA,
    FAMO,
    GLS,
    IMTLL,
    PBI,
    SCALARIZATIONS,
    STCH,
    UW,
    Scalarization,
    make_scalarization,
)

F64 = torch.float64
# Each reference value below is a few dozen float64 operations (exp/log within an ulp,
# K-term sums) away from the same inputs along another order: 64 ulps of the result's
# scale covers that. A wrong formula is off by O(1) of the scale.
ULPS = 64
LOSS_SEQUENCE = np.array(
    [[2.0, 0.5, 1.2], [1.6, 0.45, 1.1], [1.1, 0.44, 0.9], [0.9, 0.40, 0.85], [0.7, 0.39, 0.6]]
)


def as_losses(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64, requires_grad=True)


def assert_close(actual, expected, ulps: float = ULPS) -> None:
    expected = np.asarray(expected, dtype=np.float64)
    actual = np.asarray(torch.as_tensor(actual, dtype=F64).detach())
    scale = max(1.0, float(np.max(np.abs(expected))))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=chain_atol(F64, scale, ulps))


def loss_gradient(method: Scalarization, values) -> tuple[float, np.ndarray, np.ndarray]:
    """The scalarized loss, its autograd gradient w.r.t. the losses, and the reported weights."""
    losses = as_losses(values)
    result = method(losses)
    (gradient,) = torch.autograd.grad(result.loss, losses)
    return float(result.loss.detach()), gradient.numpy(), result.weights.numpy()


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


# --- formulas, step by step -------------------------------------------------------------


def test_uw_matches_its_formula_over_sgd_steps() -> None:
    method = UW(3, init=0.3).double()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    s = method.log_variances.detach().numpy().copy()  # 0.3 rounded to float32, then widened
    np.testing.assert_allclose(s, 0.3, rtol=eps(torch.float32))
    for values in LOSS_SEQUENCE:
        optimizer.zero_grad()
        loss, gradient, weights = loss_gradient(method, values)
        method(as_losses(values)).loss.backward()
        optimizer.step()
        assert_close(loss, np.sum(0.5 * np.exp(-s) * values + 0.5 * s))
        assert_close(weights, 0.5 * np.exp(-s))
        assert_close(gradient, 0.5 * np.exp(-s))
        s = s - 0.1 * (-0.5 * np.exp(-s) * values + 0.5)  # d/ds of the loss
        assert_close(method.log_variances, s)


def test_imtll_matches_its_formula_over_sgd_steps() -> None:
    method = IMTLL(3).double()
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1)
    s = np.zeros(3)
    for values in LOSS_SEQUENCE:
        optimizer.zero_grad()
        loss, gradient, weights = loss_gradient(method, values)
        method(as_losses(values)).loss.backward()
        optimizer.step()
        assert_close(loss, np.sum(np.exp(s) * values - s))
        assert_close(weights, np.exp(s))
        assert_close(gradient, np.exp(s))
        s = s - 0.1 * (np.exp(s) * values - 1.0)
        assert_close(method.log_scales, s)


def test_gls_is_the_geometric_mean() -> None:
    method = GLS()
    for values in LOSS_SEQUENCE:
        loss, gradient, weights = loss_gradient(method, values)
        mean = np.prod(values) ** (1 / 3)
        assert_close(loss, mean)
        assert_close(gradient, mean / (3 * values))
        assert_close(weights, gradient)


def test_dwa_follows_the_epoch_averages() -> None:
    method = DWA(3, temperature=2.0)
    history: list[np.ndarray] = []
    for epoch in range(4):
        batches = LOSS_SEQUENCE[epoch : epoch + 2] * (1.0 + 0.1 * epoch)
        for values in batches:
            if len(history) < 2:
                expected = np.ones(3)
            else:
                expected = 3 * softmax(history[-1] / history[-2] / 2.0)
            loss, gradient, weights = loss_gradient(method, values)
            assert_close(weights, expected)
            assert_close(gradient, expected)
            assert_close(loss, expected @ values)
        method.end_epoch()
        history.append(batches.mean(axis=0))
    method.end_epoch()  # an empty epoch changes nothing
    assert_close(method.averages, np.stack(history[-2:]))


def test_stch_is_the_smoothed_weighted_max() -> None:
    preferences, reference, mu = np.array([0.5, 0.3, 0.2]), np.array([0.1, 0.0, 0.2]), 0.5
    method = STCH(mu=mu, preferences=preferences, reference=reference)
    for values in LOSS_SEQUENCE:
        excess = preferences * (values - reference)
        loss, gradient, weights = loss_gradient(method, values)
        assert_close(loss, mu * np.log(np.sum(np.exp(excess / mu))))
        assert_close(gradient, softmax(excess / mu) * preferences)
        assert_close(weights, gradient)
    # Default preferences are uniform; a tiny mu neither overflows nor loses the max.
    loss, _, weights = loss_gradient(STCH(mu=1e-4), [1e3, 2e3])
    assert math.isclose(loss, 1e3, rel_tol=1e-12)
    assert_close(weights, [0.0, 0.5])


def test_pbi_is_distance_along_plus_penalty_off_the_ray() -> None:
    preferences, reference, theta = np.array([1.0, 2.0, 2.0]), np.array([0.0, 0.1, 0.0]), 5.0
    method = PBI(theta=theta, preferences=preferences, reference=reference)
    direction = preferences / 3.0
    for values in LOSS_SEQUENCE:
        excess = values - reference
        along = excess @ direction
        off = excess - along * direction
        loss, gradient, weights = loss_gradient(method, values)
        assert_close(loss, along + theta * np.linalg.norm(off))
        assert_close(gradient, direction + theta * off / np.linalg.norm(off))
        assert_close(weights, gradient)
    assert (weights < 0).any(), "a task ahead of the ray is pushed back: a negative weight"
    # On the ray (always, with one task) the penalty's gradient is its zero subgradient.
    loss, gradient, weights = loss_gradient(PBI(), [0.7])
    assert loss == 0.7 and gradient.tolist() == [1.0] and weights.tolist() == [1.0]


class NumpyFAMO:
    """FAMO written out: softmax logits, the log-loss combination, Adam on the logits."""

    def __init__(self, k: int, lr: float, decay: float, bounds: np.ndarray) -> None:
        self.lr, self.decay, self.bounds, self.shift = lr, decay, bounds, 1e-8
        self.w, self.m, self.v, self.t = np.zeros(k), np.zeros(k), np.zeros(k), 0

    def __call__(self, values: np.ndarray) -> tuple[float, np.ndarray]:
        self.before = values
        z, d = softmax(self.w), values - self.bounds + self.shift
        c = 1.0 / np.sum(z / d)
        return c * np.sum(z * np.log(d)), c * z / d

    def update(self, values: np.ndarray) -> None:
        delta = np.log(self.before - self.bounds + self.shift) - np.log(
            values - self.bounds + self.shift
        )
        z = softmax(self.w)
        jacobian = np.diag(z) - np.outer(z, z)  # d softmax / d w
        g = jacobian.T @ delta + self.decay * self.w
        self.t += 1
        self.m = 0.9 * self.m + 0.1 * g
        self.v = 0.999 * self.v + 0.001 * g * g
        m_hat, v_hat = self.m / (1 - 0.9**self.t), self.v / (1 - 0.999**self.t)
        self.w = self.w - self.lr * m_hat / (np.sqrt(v_hat) + 1e-8)


def test_famo_matches_its_formula_over_updates() -> None:
    bounds = np.array([0.1, 0.0, 0.3])
    method = FAMO(3, lr=0.05, weight_decay=1e-3, min_losses=bounds)
    reference = NumpyFAMO(3, 0.05, 1e-3, bounds)
    for before, after in itertools.pairwise(LOSS_SEQUENCE):
        loss, gradient, weights = loss_gradient(method, before)
        expected_loss, expected_weights = reference(before)
        assert_close(loss, expected_loss)
        assert_close(gradient, expected_weights)
        assert_close(weights, expected_weights)
        assert math.isclose(weights.sum(), 1.0, rel_tol=1e-12)  # a convex combination
        method.update(torch.tensor(after, dtype=F64))
        reference.update(after)
        # Adam's step m / sqrt(v) is scale-free: rounding in g moves it by ulps of lr.
        assert_close(method.logits, reference.w)
    assert np.ptp(reference.w) > 0.01  # the weights did move


def test_weights_are_the_gradient_of_the_loss_for_every_method() -> None:
    values = [1.3, 0.6, 2.2]
    for name, options in _OPTIONS.items():
        method = make_scalarization(name, num_tasks=3, **options).double()
        if name in ("uw", "imtll"):
            with torch.no_grad():
                next(method.parameters()).copy_(torch.tensor([0.2, -0.4, 0.1]))
        _, gradient, weights = loss_gradient(method, values)
        assert_close(weights, gradient)


# --- finite differences -----------------------------------------------------------------


def central_differences(function, point: np.ndarray, step: float) -> np.ndarray:
    rows = []
    for index in range(len(point)):
        shift = np.zeros_like(point)
        shift[index] = step
        rows.append((function(point + shift) - function(point - shift)) / (2 * step))
    return np.array(rows)


@pytest.mark.parametrize(
    "build",
    [
        lambda: STCH(mu=0.5, preferences=[0.2, 0.5, 0.3]),
        lambda: GLS(),
        lambda: IMTLL(3).double(),
        lambda: PBI(theta=3.0, preferences=[1.0, 1.0, 2.0]),
        lambda: FAMO(3).double(),
    ],
    ids=["stch", "gls", "imtll", "pbi", "famo"],
)
def test_gradient_matches_finite_differences(build) -> None:
    point = np.array([1.3, 0.6, 2.2])
    method = build()
    if isinstance(method, FAMO):
        # The normalizer c is a constant in FAMO's backward: differentiate at fixed c.
        method.logits.copy_(torch.tensor([0.3, -0.2, 0.1], dtype=F64))
        loss, gradient, _ = loss_gradient(method, point)
        c = 1.0 / np.sum(softmax(method.logits.numpy()) / (point + 1e-8))

        def function(x: np.ndarray) -> float:
            return c * float(softmax(method.logits.numpy()) @ np.log(x + 1e-8))
    else:
        loss, gradient, _ = loss_gradient(method, point)

        def function(x: np.ndarray) -> float:
            return float(method(torch.tensor(x, dtype=F64)).loss.detach())

    step = 1e-5
    # Central differences err by |f'''| h^2 / 6 (|f'''| < 100 for these losses in
    # [0.6, 2.2] and settings) plus rounding, 2 eps |f| / h per evaluation pair.
    atol = 100 * step**2 / 6 + 4 * eps(F64) * max(1.0, abs(loss)) / step
    np.testing.assert_allclose(gradient, central_differences(function, point, step), atol=atol)


def test_uw_gradient_in_losses_and_log_variances_matches_finite_differences() -> None:
    method = UW(2).double()
    point = np.array([1.4, 0.3, 0.2, -0.5])  # two losses, then two log-variances

    def function(x: np.ndarray) -> float:
        with torch.no_grad():
            method.log_variances.copy_(torch.tensor(x[2:]))
        return float(method(torch.tensor(x[:2], dtype=F64)).loss.detach())

    numeric = central_differences(function, point, 1e-5)
    with torch.no_grad():
        method.log_variances.copy_(torch.tensor(point[2:]))
    losses = as_losses(point[:2])
    loss = method(losses).loss
    analytic = torch.autograd.grad(loss, [losses, method.log_variances])
    atol = 100 * 1e-10 / 6 + 4 * eps(F64) * max(1.0, float(loss.detach())) / 1e-5
    np.testing.assert_allclose(torch.cat(analytic).numpy(), numeric, atol=atol)


# --- state ------------------------------------------------------------------------------


def _advance(method: Scalarization, rows: np.ndarray) -> list[float]:
    """A few steps of the full call order; returns the losses it produced."""
    produced = []
    optimizer = torch.optim.SGD(method.parameters(), lr=0.1) if list(method.parameters()) else None
    for index, values in enumerate(rows):
        result = method(as_losses(values))
        produced.append(float(result.loss.detach()))
        if optimizer is not None:
            optimizer.zero_grad()
            result.loss.backward()
            optimizer.step()
        if method.needs_losses_after_step:
            method.update(torch.tensor(values * 0.9, dtype=F64))
        if index % 2 == 1:
            method.end_epoch()
    return produced


@pytest.mark.parametrize("name", ["uw", "imtll", "dwa", "famo"])
def test_state_dict_round_trip_resumes_identically(name: str) -> None:
    original = make_scalarization(name, num_tasks=3).double()
    _advance(original, LOSS_SEQUENCE[:3])
    original(as_losses(LOSS_SEQUENCE[3]))  # mid-epoch for DWA, an update pending for FAMO
    state = {key: value.clone() for key, value in original.state_dict().items()}
    restored = make_scalarization(name, num_tasks=3).double()
    restored.load_state_dict(state)
    for key, value in original.state_dict().items():
        assert torch.equal(restored.state_dict()[key], value), key
    if name == "famo":
        original.update(torch.tensor(LOSS_SEQUENCE[4], dtype=F64))
        restored.update(torch.tensor(LOSS_SEQUENCE[4], dtype=F64))
    assert _advance(original, LOSS_SEQUENCE) == _advance(restored, LOSS_SEQUENCE)
    with pytest.raises(RuntimeError, match="size mismatch"):
        make_scalarization(name, num_tasks=2).load_state_dict(state)


def test_famo_logits_are_not_parameters_and_uw_log_variances_are() -> None:
    assert list(FAMO(2).parameters()) == []
    assert [tuple(p.shape) for p in UW(2).parameters()] == [(2,)]
    assert list(GLS().parameters()) == [] and list(STCH(mu=1.0).parameters()) == []


# --- validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("method", "values", "message"),
    [
        (GLS(), [1.0, float("nan")], r"task 1's loss is nan"),
        (STCH(mu=1.0), [float("inf"), 1.0], r"task 0's loss is inf"),
        (GLS(), [1.0, 0.0], r"GLS: task 1's loss is 0.0 but must be above 0.0.*logarithm"),
        (UW(2), [-0.1, 1.0], r"UW: task 0's loss is -0.1 but must be at least 0.0"),
        (IMTLL(2), [1.0, -2.0], r"IMTLL: task 1's loss is -2.0"),
        (FAMO(2, min_losses=[0.5, 0.0]), [0.4, 1.0], r"FAMO: task 0.*min_losses"),
        (UW(3), [1.0, 2.0], r"built for 3 tasks but got 2 losses"),
        (STCH(mu=1.0, preferences=[1.0, 1.0]), [1.0], r"built for 2 tasks"),
        (GLS(), torch.ones(2, 2), r"must be K >= 1 scalars"),
        (GLS(), [], r"must be K >= 1 scalars"),
    ],
)
def test_invalid_losses_are_named(method: Scalarization, values, message: str) -> None:
    if not isinstance(values, torch.Tensor):
        values = [torch.tensor(value, dtype=F64) for value in values]
    with pytest.raises(ValueError, match=message):
        method(values)


def test_misuse_and_bad_settings_raise() -> None:
    with pytest.raises(TypeError, match="floating point"):
        GLS()(torch.tensor([1, 2]))
    with pytest.raises(TypeError, match="does not learn from the losses after the step"):
        UW(2).update(torch.ones(2))
    with pytest.raises(ValueError, match=r"update\(\) needs this step's losses first"):
        FAMO(2).update(torch.ones(2))
    famo = FAMO(2)
    famo(torch.ones(2))
    famo.update(torch.ones(2))
    with pytest.raises(ValueError, match="needs this step's losses first"):
        famo.update(torch.ones(2))  # once per call
    dwa = DWA(2)
    dwa(torch.tensor([1.0, -3.0]))
    with pytest.raises(ValueError, match=r"task 1's average loss this epoch is -3\.0"):
        dwa.end_epoch()
    for build, message in [
        (lambda: STCH(mu=0.0), "mu must be finite and positive"),
        (lambda: DWA(2, temperature=-1.0), "temperature"),
        (lambda: PBI(theta=-1.0), "theta must be finite and non-negative"),
        (lambda: STCH(mu=1.0, preferences=[1.0, -1.0]), "non-negative and not all zero"),
        (lambda: PBI(2, preferences=[1.0, 1.0, 1.0]), "3 entries but num_tasks is 2"),
        (lambda: STCH(mu=1.0, preferences=[1.0, 1.0], reference=[0.0]), "1 entries"),
        (lambda: UW(0), "num_tasks must be a positive integer"),
        (lambda: FAMO(2, lr=-1.0), "lr"),
        (lambda: make_scalarization("nope"), "unknown scalarization 'nope'"),
    ]:
        with pytest.raises(ValueError, match=message):
            build()


# --- TorchJD 0.18 -----------------------------------------------------------------------

torchjd_scalarization = pytest.importorskip("torchjd.scalarization")


def both_gradients(ours: Scalarization, theirs: nn.Module, values) -> tuple:
    mine, their = as_losses(values), as_losses(values)
    our_loss = ours(mine).loss
    their_loss = theirs(their)
    return (
        float(our_loss.detach()),
        float(their_loss.detach()),
        torch.autograd.grad(our_loss, mine)[0],
        torch.autograd.grad(their_loss, their)[0],
    )


def test_same_as_torchjd_uw_imtll_gls_stch() -> None:
    s = torch.tensor([0.2, -0.3, 0.5], dtype=F64)
    uw, their_uw = UW(3).double(), torchjd_scalarization.UW(3).double()
    imtll, their_imtll = IMTLL(3).double(), torchjd_scalarization.IMTLL(3).double()
    with torch.no_grad():
        for parameter in (uw.log_variances, their_uw.log_var, imtll.log_scales):
            parameter.copy_(s)
        their_imtll.log_scale.copy_(s)
    preferences = torch.tensor([0.5, 0.3, 0.2], dtype=F64)
    reference = torch.tensor([0.1, 0.0, 0.2], dtype=F64)
    pairs = [
        (uw, their_uw),
        (imtll, their_imtll),
        (GLS(), torchjd_scalarization.GeometricMean()),
        (
            STCH(mu=0.3, preferences=preferences, reference=reference),
            torchjd_scalarization.STCH(0.3, weights=preferences, reference=reference),
        ),
    ]
    for values in LOSS_SEQUENCE:
        for ours, theirs in pairs:
            our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
            # Same formula in float64, evaluated in another order: the 2K-term sums
            # bound the difference, plus an ulp per exp/log of each term.
            atol = reduction_atol(F64, 2 * len(values), 4 * abs(our_loss) + 4)
            assert abs(our_loss - their_loss) <= atol, type(ours).__name__
            torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)


def test_same_as_torchjd_pbi_up_to_its_smoothing_constant() -> None:
    # TorchJD computes d2 as sqrt(|off|^2 + 1e-12) to keep the gradient finite on the ray;
    # ours is |off| exactly. sqrt(d^2 + e) - d <= e / (2 d), so off the ray the losses
    # differ by at most theta * 1e-12 / (2 d2) (plus rounding), and on it by theta * 1e-6.
    theta, smoothing = 5.0, 1e-12
    preferences = torch.tensor([1.0, 2.0, 2.0], dtype=F64)
    ours = PBI(theta=theta, preferences=preferences)
    theirs = torchjd_scalarization.PBI(theta, weights=preferences)
    for values in LOSS_SEQUENCE:
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
        distance = float(ours(torch.tensor(values)).extras["d2"])
        bound = theta * smoothing / (2 * distance) + chain_atol(F64, our_loss, ULPS)
        assert abs(their_loss - our_loss) <= bound
        # The gradients differ by theta * off * (1/d - 1/sqrt(d^2 + e)) <= theta e / (2 d^2).
        bound = theta * smoothing / (2 * distance**2) + chain_atol(F64, theta, ULPS)
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=bound)
    single = torch.ones(1, dtype=F64)
    our_loss, their_loss, our_grad, their_grad = both_gradients(
        PBI(theta=theta, preferences=single), torchjd_scalarization.PBI(theta, single), [0.7]
    )
    assert our_loss == 0.7
    assert math.isclose(their_loss - our_loss, theta * smoothing**0.5, rel_tol=1e-9)
    assert our_grad.tolist() == their_grad.tolist() == [1.0]


def test_same_as_torchjd_dwa_over_epochs() -> None:
    ours, theirs = DWA(3), torchjd_scalarization.DWA(2.0)
    for epoch in range(4):
        for values in LOSS_SEQUENCE[epoch : epoch + 2] * (1.0 + 0.1 * epoch):
            our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
            # Weights: a ratio, a 3-term softmax and the factor K from the same epoch
            # sums (ours sum in float64 as TorchJD does here): a few ulps of K.
            torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=chain_atol(F64, 3, 16))
            assert abs(our_loss - their_loss) <= chain_atol(F64, 3 * our_loss, 16)
        ours.end_epoch()
        theirs.step()


def test_same_as_torchjd_famo_over_updates() -> None:
    bounds = torch.tensor([0.1, 0.0, 0.3], dtype=F64)
    ours = FAMO(3, lr=0.05, weight_decay=1e-3, min_losses=bounds)
    theirs = torchjd_scalarization.FAMO(3, min_losses=bounds, lr=0.05, weight_decay=1e-3).double()
    steps = len(LOSS_SEQUENCE) - 1
    for index in range(steps):
        before, after = LOSS_SEQUENCE[index], LOSS_SEQUENCE[index + 1]
        our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, before)
        atol = chain_atol(F64, max(1.0, abs(our_loss)), ULPS)
        assert abs(our_loss - their_loss) <= atol
        torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=atol)
        ours.update(torch.tensor(after, dtype=F64))
        theirs.update(torch.tensor(after, dtype=F64))
        # Their softmax JVP goes through autograd, ours is closed-form, and torch's Adam
        # updates its first moment with lerp: the gradients differ by ulps (relative) and
        # Adam's scale-free step turns that into ulps of lr per step, accumulated.
        logits_atol = (index + 1) * chain_atol(F64, 0.05, ULPS)
        torch.testing.assert_close(ours.logits, theirs._w.detach(), rtol=0, atol=logits_atol)
    assert ours.logits.abs().max() > 0.05  # the logits moved several steps' worth


# --- end to end -------------------------------------------------------------------------

_OPTIONS: dict[str, dict] = {
    "uw": {},
    "dwa": {},
    "gls": {},
    "imtll": {},
    "stch": {"mu": 0.1},
    "pbi": {},
    "famo": {},
}


# Methods that need the shared parameters or a drawn preference: their own test file.
GRADIENT_BASED = {"gradnorm", "dbmtl", "imtl", "moco", "cosmos"}


def test_every_method_is_in_the_registry_and_the_end_to_end_test() -> None:
    assert set(_OPTIONS) | GRADIENT_BASED == set(SCALARIZATIONS)
    assert not set(_OPTIONS) & GRADIENT_BASED


@pytest.mark.parametrize("name", sorted(_OPTIONS))
def test_a_tiny_two_task_model_trains_with_each_method(name: str) -> None:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(64, 4, generator=generator)
    targets = [inputs @ torch.randn(4, generator=generator), torch.tanh(inputs[:, 0]) * 3.0]
    torch.manual_seed(0)
    trunk = nn.Sequential(nn.Linear(4, 16), nn.Tanh())
    heads = nn.ModuleList([nn.Linear(16, 1), nn.Linear(16, 1)])
    method = make_scalarization(name, num_tasks=2, **_OPTIONS[name])
    parameters = [*trunk.parameters(), *heads.parameters(), *method.parameters()]
    optimizer = torch.optim.Adam(parameters, lr=0.02)

    def task_losses() -> torch.Tensor:
        features = trunk(inputs)
        return torch.stack(
            [
                ((head(features).squeeze(1) - y) ** 2).mean()
                for head, y in zip(heads, targets, strict=True)
            ]
        )

    history = []
    for step in range(50):
        losses = task_losses()
        result = method(losses)
        optimizer.zero_grad()
        result.loss.backward()
        optimizer.step()
        if method.needs_losses_after_step:
            with torch.no_grad():
                method.update(task_losses())
        if step % 10 == 9:
            method.end_epoch()
        assert torch.isfinite(result.loss) and torch.isfinite(result.weights).all()
        history.append(losses.detach())
    history = torch.stack(history)
    assert torch.isfinite(history).all()
    assert (history[-5:].mean(0) < 0.7 * history[:5].mean(0)).all(), history[[0, -1]]
