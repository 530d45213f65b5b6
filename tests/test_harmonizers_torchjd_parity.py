"""ConFIG, FairGrad, Krum, TrimmedMean and GradDrop: definitions, TorchJD 0.18 parity, stress.

1. Each method against its definition, computed here on the stack independently of the
   code under test (numpy pinv, scipy, brute force, numpy sort/masks).
2. Each against the TorchJD 0.18 aggregator of the same name on identical stacks:
   TorchJD's J = [[-4, 1, 1], [6, 1, 1]] and random K = 3..5, D = 10..50 stacks.
   Tolerances: TorchJD on the float64 stack rounds like us, up to its own solver
   tolerance (FairGrad: scipy's least_squares stops at a relative step of xtol = 1e-8).
   On a float32 stack both see the same values; TorchJD then computes in float32: a
   backward-stable pseudo-inverse or Gram of K x D float32 rows is off by at most
   ~D u32 (u32 = 2^-24) relative, amplified by the condition number kappa of the unit
   rows (twice for FairGrad, which works on their Gram): we allow 2 D u32 kappa^p.
3. Stress on the stacks of tests/test_exactness_stress.py: finite results at norm
   spreads 1e-8..1e8 and on near-singular stacks, and each method's guarantee.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.optimize
import torch
from test_exactness_stress import NEAR_SINGULAR_KINDS, near_singular_stack, spread_stack
from tolerances import reduction_atol

from mogradient.amortize import Amortizer
from mogradient.harmonizers.config_grad import ConFIG
from mogradient.harmonizers.dropout import RewardDropout
from mogradient.harmonizers.fairgrad import FairGrad
from mogradient.harmonizers.graddrop import GradDrop
from mogradient.harmonizers.krum import Krum
from mogradient.harmonizers.mgda import MGDA
from mogradient.harmonizers.trimmed_mean import TrimmedMean

aggregation = pytest.importorskip("torchjd.aggregation")

U32 = 2.0**-24
TORCHJD_EXAMPLE = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]], dtype=torch.float64)
RANDOM_SHAPES = ((3, 10), (4, 25), (5, 50), (5, 10))
SPREADS = (0.0, 4.0, 8.0)  # norms over 10^-e .. 10^e
ALPHAS = (0.5, 1.0, 2.0)


def random_stack(seed: int, count: int, dim: int) -> torch.Tensor:
    return torch.randn(
        count, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )


def parity_stacks(min_count: int = 2) -> list[torch.Tensor]:
    stacks = [random_stack(seed, *shape) for seed, shape in enumerate(RANDOM_SHAPES)]
    return [stack for stack in [TORCHJD_EXAMPLE, *stacks] if len(stack) >= min_count]


def stress_stacks() -> list[tuple[str, torch.Tensor]]:
    stacks = [
        (f"spread-1e{exponent:g}-K{count}", spread_stack(seed, count, 12, (-exponent, exponent)))
        for seed, count in enumerate((3, 5))
        for exponent in SPREADS
    ]
    stacks += [
        (f"{kind}-K{count}", near_singular_stack(kind, seed, count))
        for kind in NEAR_SINGULAR_KINDS
        for seed, count in enumerate((3, 5))
    ]
    return stacks


STRESS = stress_stacks()
STRESS_IDS = [name for name, _ in STRESS]


def relative(ours: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((ours.double() - theirs.double()).norm() / ours.double().norm())


def unit_condition(stack: torch.Tensor) -> float:
    singular = torch.linalg.svdvals(stack / stack.norm(dim=1, keepdim=True))
    return float(singular[0] / singular[-1])


def float32_bound(stack: torch.Tensor, power: int = 1) -> float:
    return 2 * stack.shape[1] * U32 * unit_condition(stack) ** power


# --- ConFIG --------------------------------------------------------------------------


def config_reference(stack: np.ndarray, preferences: np.ndarray | None = None) -> np.ndarray:
    """ConFIG on the stack (the authors' README).

    t = pinv(unit rows) p, scaled to sum_k g_k . t/||t||.
    """
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True)
    target = np.linalg.pinv(units) @ (np.ones(len(stack)) if preferences is None else preferences)
    unit_target = target / np.linalg.norm(target)
    return float(np.sum(stack @ unit_target)) * unit_target


@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_config_matches_its_definition_and_torchjd(stack: torch.Tensor) -> None:
    result = ConFIG()(stack)
    np.testing.assert_allclose(
        result.direction.numpy(), config_reference(stack.numpy()), rtol=1e-12
    )
    cosines = (stack @ result.direction) / (stack.norm(dim=1) * result.direction.norm())
    assert cosines.min() > 0 and float(cosines.max() - cosines.min()) <= 1e-13
    assert relative(result.direction, aggregation.ConFIG()(stack)) <= 2 * stack.shape[
        1
    ] * 2.0**-53 * unit_condition(stack)
    single = stack.float()
    ours = ConFIG()(single).direction
    assert relative(ours, aggregation.ConFIG()(single)) <= float32_bound(single.double())
    torch.testing.assert_close(
        ConFIG()(gram=stack @ stack.T).weights, result.weights, rtol=1e-12, atol=0
    )


def test_config_preferences_match_definition_and_torchjd() -> None:
    stack = random_stack(7, 4, 20)
    preferences = torch.tensor([1.0, 2.0, 0.5, 1.0], dtype=torch.float64)
    result = ConFIG(pref_vector=preferences)(stack)
    reference = config_reference(stack.numpy(), preferences.numpy())
    np.testing.assert_allclose(result.direction.numpy(), reference, rtol=1e-12)
    theirs = aggregation.ConFIG(pref_vector=preferences)(stack)
    assert relative(result.direction, theirs) <= 1e-13


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_config_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere, on the stack and on the Gram alone. The direction matches numpy's
    pinv on the stack to 2 D eps kappa (kappa: the unit rows' condition number, 1e7 on
    near-singular stacks, where the stack refinement is what gets there; the Gram-only
    weights are then off by ~eps / lambda_min, up to 1e-2, and are only checked finite).
    Guarantee: for linearly independent gradients u_k . t = 1 for all k, so every
    g_k . d > 0 at one common cosine; rank-deficient stacks meet it in the least-squares
    sense only: where that direction conflicts with a gradient (cosine below -1e-3, far
    beyond round-off) there is no common direction and the weights are zero."""
    result = ConFIG()(stack)
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()
    gram_only = ConFIG()(gram=stack @ stack.T).weights
    assert torch.isfinite(gram_only).all()
    reference = torch.from_numpy(config_reference(stack.numpy()))
    kappa = unit_condition(stack)
    if name.startswith("rank_deficient"):
        served = (stack @ reference) / (stack.norm(dim=1) * reference.norm())
        if served.min() < -1e-3:
            assert result.fallback == "no_common_direction" and not result.weights.any()
            return
        assert relative(result.direction, reference) <= 1e-12
        return
    bound = 2 * stack.shape[1] * 2.0**-53 * kappa
    assert relative(result.direction, reference) <= bound
    cosines = (stack @ result.direction) / (stack.norm(dim=1) * result.direction.norm())
    assert (cosines > 0).all()
    assert float(cosines.max() - cosines.min()) <= bound * float(cosines.max())
    if name.startswith("spread"):
        torch.testing.assert_close(gram_only, result.weights, rtol=1e-10, atol=0)


# --- FairGrad ------------------------------------------------------------------------


def fairgrad_reference(stack: np.ndarray, alpha: float) -> np.ndarray:
    """G w = w^(-1/alpha), w > 0, solved by scipy in x = log w on the relative residual
    (G w)_k w_k^(1/alpha) - 1, from the orthogonal-gradients guess."""
    gram = stack @ stack.T

    def residual(log_weights: np.ndarray) -> np.ndarray:
        weights = np.exp(log_weights)
        return (gram @ weights) * weights ** (1.0 / alpha) - 1.0

    start = -alpha / (alpha + 1.0) * np.log(np.diag(gram))
    solution = scipy.optimize.least_squares(residual, start, xtol=1e-15, ftol=1e-15, gtol=1e-15)
    assert np.abs(solution.fun).max() <= 1e-12
    return np.exp(solution.x)


def system_residual(stack: np.ndarray, weights: np.ndarray, alpha: float) -> float:
    """max_k |(G w)_k - w_k^(-1/alpha)| / (w_k^(-1/alpha) + (|G| w)_k), G from the stack."""
    gram = stack @ stack.T
    demand = weights ** (-1.0 / alpha)
    return float(np.max(np.abs(gram @ weights - demand) / (demand + np.abs(gram) @ weights)))


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_fairgrad_matches_its_system_and_torchjd(stack: torch.Tensor, alpha: float) -> None:
    result = FairGrad(alpha)(stack)
    assert result.fallback is None and result.kkt_residual <= 1e-12
    np.testing.assert_allclose(
        result.weights.numpy(), fairgrad_reference(stack.numpy(), alpha), rtol=1e-10
    )
    # TorchJD's scipy least_squares stops at a relative step of xtol = 1e-8.
    assert relative(result.direction, aggregation.FairGrad(alpha)(stack)) <= 1e-8
    single = stack.float()
    theirs = aggregation.FairGrad(alpha)(single)
    assert relative(FairGrad(alpha)(single).direction, theirs) <= float32_bound(single.double(), 2)
    torch.testing.assert_close(
        FairGrad(alpha)(gram=stack @ stack.T).weights, result.weights, rtol=1e-10, atol=0
    )


def test_fairgrad_alpha_zero_is_the_mean_as_in_torchjd() -> None:
    stack = random_stack(3, 4, 12)
    result = FairGrad(0.0)(stack)
    torch.testing.assert_close(result.direction, stack.mean(dim=0))
    torch.testing.assert_close(result.direction, aggregation.FairGrad(0.0)(stack))


def hull_min_norm_squared(stack: np.ndarray) -> float:
    """min over the simplex of ||sum_k a_k u_k||^2, by scipy's NNLS with a heavy sum-to-one row."""
    units = stack / np.linalg.norm(stack, axis=1, keepdims=True)
    heavy = 1e4
    system = np.vstack([units.T, heavy * np.ones(len(stack))])
    target = np.concatenate([np.zeros(stack.shape[1]), [heavy]])
    alpha, _ = scipy.optimize.nnls(system, target)
    alpha /= alpha.sum()
    return float(np.sum((alpha @ units) ** 2))


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_fairgrad_stress(name: str, stack: torch.Tensor, alpha: float) -> None:
    """Finite everywhere. Guarantee: g_k . d = w_k^(-1/alpha) > 0 for every k whenever the
    system has a solution, i.e. unless zero is in the gradients' convex hull; there the
    weights are zero (``pareto_stationary``), which the hull's min-norm on the stack
    confirms (below the float64 Gram's round-off, 4 K eps, up to NNLS's own accuracy)."""
    result = FairGrad(alpha)(stack)
    assert torch.isfinite(result.weights).all() and torch.isfinite(result.direction).all()
    values = stack.numpy()
    if result.fallback == "pareto_stationary":
        assert not result.weights.any()
        assert hull_min_norm_squared(values) <= 1e3 * len(values) * np.finfo(float).eps
        return
    assert result.fallback is None and (result.weights > 0).all()
    assert system_residual(values, result.weights.numpy(), alpha) <= 1e-10
    # On the stack, up to the rounding of d = sum_k w_k g_k (huge cancelling weights on a
    # near-opposed pair leave g_k . d = w_k^(-1/alpha) below it).
    norms = stack.norm(dim=1)
    rounding = 4 * len(stack) * 2.0**-53 * norms * float(result.weights.abs() @ norms)
    assert (stack @ result.direction > -rounding).all()


# --- Krum ----------------------------------------------------------------------------


def krum_scores(stack: np.ndarray, n_byzantine: int, squared: bool = True) -> np.ndarray:
    """Brute force on the stack: sum of the K - f - 2 smallest distances to other rows."""
    count = len(stack)
    scores = []
    for i in range(count):
        distances = sorted(
            float(np.sum((stack[i] - stack[j]) ** 2)) for j in range(count) if j != i
        )
        if not squared:
            distances = sorted(np.sqrt(distances))
        scores.append(sum(distances[: count - n_byzantine - 2]))
    return np.array(scores)


@pytest.mark.parametrize("n_byzantine", [0, 1])
@pytest.mark.parametrize("n_selected", [1, 2])
@pytest.mark.parametrize("stack", parity_stacks(4), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_krum_matches_brute_force_and_torchjd(
    stack: torch.Tensor, n_byzantine: int, n_selected: int
) -> None:
    values = stack.numpy()
    for squared in (True, False):
        result = Krum(n_byzantine, n_selected, squared)(stack)
        scores = krum_scores(values, n_byzantine, squared)
        expected = np.argsort(scores, kind="stable")[:n_selected]
        assert result.extras["selected"] == expected.tolist()
        torch.testing.assert_close(result.direction, stack[expected].mean(dim=0), rtol=0, atol=0)
        torch.testing.assert_close(
            Krum(n_byzantine, n_selected, squared)(gram=stack @ stack.T).weights, result.weights
        )
    # TorchJD scores by plain distances: squared=False selects the same rows.
    plain = Krum(n_byzantine, n_selected, squared=False)
    theirs = aggregation.Krum(n_byzantine, n_selected)
    assert relative(plain(stack).direction, theirs(stack)) <= 2.0**-53
    single = stack.float()
    assert relative(plain(single).direction, theirs(single)) <= U32


def test_krum_scores_squared_distances_unlike_torchjd() -> None:
    """The paper's score sums squared distances; TorchJD 0.18 sums distances. On this stack
    (f = 0: two nearest neighbours) the squared score picks [1, 2], the plain one [1, 1]."""
    stack = torch.tensor(
        [[1.0, 2.0], [1.0, -4.0], [3.0, 1.0], [-2.0, 2.0], [1.0, 1.0]], dtype=torch.float64
    )
    assert int(np.argmin(krum_scores(stack.numpy(), 0))) == 0
    assert int(np.argmin(krum_scores(stack.numpy(), 0, squared=False))) == 4
    assert Krum()(stack).extras["selected"] == [0]
    assert Krum(squared=False)(stack).extras["selected"] == [4]
    torch.testing.assert_close(aggregation.Krum(0)(stack), stack[4])


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_krum_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere; the selected row's brute-force score is the smallest, up to the
    Gram's round-off in distances (near-duplicates score alike). Guarantee: the update
    is one of the gradients, nothing about conflicts."""
    result = Krum()(stack)
    assert torch.isfinite(result.weights).all()
    (selected,) = result.extras["selected"]
    torch.testing.assert_close(result.direction, stack[selected], rtol=0, atol=0)
    scores = krum_scores(stack.numpy(), 0)
    largest = float(stack.norm(dim=1).max()) ** 2
    assert scores[selected] <= scores.min() + 64 * np.finfo(float).eps * largest


def test_krum_needs_enough_gradients() -> None:
    with pytest.raises(ValueError, match="at least 4 usable"):
        Krum(n_byzantine=1)(random_stack(0, 3, 5))


# --- coordinate-wise methods: TrimmedMean and GradDrop -------------------------------


def trimmed_mean_reference(stack: np.ndarray, trim: int) -> np.ndarray:
    ordered = np.sort(stack, axis=0)
    return ordered[trim : len(stack) - trim].mean(axis=0)


@pytest.mark.parametrize("trim", [0, 1, 2])
@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_trimmed_mean_matches_sort_and_trim_and_torchjd(stack: torch.Tensor, trim: int) -> None:
    if len(stack) < 2 * trim + 1:
        with pytest.raises(ValueError, match="needs at least"):
            TrimmedMean(trim)(stack)
        return
    kept = len(stack) - 2 * trim
    result = TrimmedMean(trim)(stack)
    reference = trimmed_mean_reference(stack.numpy(), trim)
    bound = reduction_atol(torch.float64, kept, float(stack.abs().sum(dim=0).max())) / kept
    assert float(np.abs(result.direction.numpy() - reference).max()) <= bound
    assert relative(result.direction, aggregation.TrimmedMean(trim)(stack)) <= 2.0**-53
    single = stack.float()
    theirs = aggregation.TrimmedMean(trim)(single)
    bound32 = reduction_atol(torch.float32, kept, float(single.abs().sum(dim=0).max())) / kept
    assert float(
        (TrimmedMean(trim)(single).direction - theirs).abs().max()
    ) <= bound32 + U32 * float(theirs.abs().max())


def graddrop_reference(
    stack: np.ndarray, draws: np.ndarray, leak: np.ndarray | None = None
) -> np.ndarray:
    """GradDrop coordinate by coordinate, with the uniform draws U given."""
    leak = np.zeros(len(stack)) if leak is None else leak
    total, size = stack.sum(axis=0), np.abs(stack).sum(axis=0)
    purity = 0.5 * (1 + np.divide(total, size, out=np.zeros_like(total), where=size > 0))
    mask = ((purity > draws) & (stack > 0)) | ((purity < draws) & (stack < 0))
    return ((leak[:, None] + (1 - leak[:, None]) * mask) * stack).sum(axis=0)


def draws_for(seed: int, dim: int) -> np.ndarray:
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(dim, generator=generator, dtype=torch.float64).numpy()


@pytest.mark.parametrize("stack", parity_stacks(), ids=lambda s: f"K{len(s)}D{s.shape[1]}")
def test_graddrop_matches_numpy_rule_and_torchjd(stack: torch.Tensor) -> None:
    """TorchJD draws U from torch's global generator in the stack's dtype: seeded alike on
    a float64 stack it draws our U and must agree to the last bit of the sums. On a
    float32 stack its U are float32 draws, so we compare with TorchJD on the same values
    in float64, which we then match up to our one rounding to float32."""
    seed = 11
    values = stack.numpy()
    leak = np.linspace(0.0, 0.5, len(stack))
    for leaks in (None, leak):
        result = GradDrop(leak=leaks, seed=seed)(stack)
        reference = graddrop_reference(values, draws_for(seed, stack.shape[1]), leaks)
        bound = reduction_atol(torch.float64, len(stack), float(np.abs(values).sum(axis=0).max()))
        assert float(np.abs(result.direction.numpy() - reference).max()) <= bound
        torch.manual_seed(seed)
        theirs = aggregation.GradDrop(leak=None if leaks is None else torch.from_numpy(leaks))(
            stack
        )
        assert float((result.direction - theirs).abs().max()) <= bound
    single = stack.float()
    ours = GradDrop(seed=seed)(single).direction
    torch.manual_seed(seed)
    theirs = aggregation.GradDrop()(single.double())
    assert float((ours.double() - theirs).abs().max()) <= U32 * float(theirs.abs().max())


def test_graddrop_replays_from_state_dict() -> None:
    stack = random_stack(2, 4, 30)
    harmonizer = GradDrop(seed=5)
    harmonizer(stack)
    state = harmonizer.state_dict()
    expected = harmonizer(stack).direction
    resumed = GradDrop(seed=123)
    resumed.load_state_dict(state)
    torch.testing.assert_close(resumed(stack).direction, expected, rtol=0, atol=0)
    assert not torch.equal(GradDrop(seed=6)(stack).direction, GradDrop(seed=5)(stack).direction)


@pytest.mark.parametrize(("name", "stack"), STRESS, ids=STRESS_IDS)
def test_coordinatewise_stress(name: str, stack: torch.Tensor) -> None:
    """Finite everywhere. Guarantees: each TrimmedMean coordinate lies between the
    (b+1)-th smallest and largest values there; each GradDrop coordinate (no leak) is the
    sum of the positive values there or of the negative ones."""
    values = stack.numpy()
    trimmed = TrimmedMean(1)(stack)
    assert torch.isfinite(trimmed.direction).all() and torch.isfinite(trimmed.weights).all()
    ordered = np.sort(values, axis=0)
    direction = trimmed.direction.numpy()
    assert (ordered[1] <= direction).all() and (direction <= ordered[-2]).all()
    dropped = GradDrop(seed=0)(stack)
    assert torch.isfinite(dropped.direction).all() and torch.isfinite(dropped.weights).all()
    positive, negative = np.clip(values, 0, None).sum(axis=0), np.clip(values, None, 0).sum(axis=0)
    direction = dropped.direction.numpy()
    bound = reduction_atol(torch.float64, len(stack), float(np.abs(values).sum(axis=0).max()))
    assert np.all((np.abs(direction - positive) <= bound) | (np.abs(direction - negative) <= bound))
    reference = graddrop_reference(values, draws_for(0, stack.shape[1]))
    assert float(np.abs(direction - reference).max()) <= bound


def test_coordinatewise_weights_are_least_squares_and_flagged() -> None:
    stack = random_stack(4, 5, 20)
    for harmonizer in (TrimmedMean(1), GradDrop(seed=1)):
        result = harmonizer(stack)
        assert result.extras["weights"] == "least_squares"
        solution, *_ = np.linalg.lstsq(stack.numpy().T, result.direction.numpy(), rcond=None)
        np.testing.assert_allclose(result.weights.numpy(), solution, rtol=1e-10)
        gap = stack.numpy().T @ solution - result.direction.numpy()
        expected = np.linalg.norm(gap) / np.linalg.norm(result.direction.numpy())
        assert result.extras["weights_residual"] == pytest.approx(expected, rel=1e-8)
        assert expected > 1e-3  # the direction is not in the gradients' span


@pytest.mark.parametrize(
    "harmonizer", [TrimmedMean(1), GradDrop(seed=0)], ids=["trimmed_mean", "graddrop"]
)
def test_coordinatewise_refuse_the_gram_and_amortization(harmonizer: object) -> None:
    stack = random_stack(5, 4, 9)
    with pytest.raises(ValueError, match="pass the K x D gradient stack"):
        harmonizer(gram=stack @ stack.T)
    with pytest.raises(ValueError, match="cached weights cannot reproduce"):
        Amortizer(harmonizer)
    with pytest.raises(ValueError, match="needs the gradient stack"):
        RewardDropout(harmonizer, probability=0.5, seed=0)(stack)
    harmonizer(stack)  # still usable on a stack after the refusals


def test_weighted_sum_methods_are_amortizable() -> None:
    for harmonizer in (ConFIG(), FairGrad(), Krum(), MGDA()):
        assert harmonizer.direction_is_weighted_sum
        Amortizer(harmonizer)


@pytest.mark.parametrize(
    "make",
    [ConFIG, FairGrad, Krum, lambda: TrimmedMean(1), lambda: GradDrop(seed=3)],
    ids=["config", "fairgrad", "krum", "trimmed_mean", "graddrop"],
)
def test_zero_gradient_is_left_out(make: object) -> None:
    stack = random_stack(8, 5, 10)
    stack[2] = 0.0
    result = make()(stack)
    assert result.dropped == (2,) and result.weights[2] == 0
    reference = make()(stack[[0, 1, 3, 4]])
    torch.testing.assert_close(result.direction, reference.direction)
