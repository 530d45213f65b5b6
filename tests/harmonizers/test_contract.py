"""What every registered harmonizer must do (parametrized over HARMONIZERS, or over the
methods a check applies to): finite results and only its declared fallbacks, its declared
promises (docs/core/exactness.md), Gram-only calls, dropped objectives, state round trips."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mogradient
from mogradient import HARMONIZERS, make_harmonizer
from mogradient.amortize import Amortizer
from mogradient.harmonizers import (
    MGDA,
    ConFIG,
    FairGrad,
    GradDrop,
    Harmonization,
    Krum,
    TrimmedMean,
)
from mogradient.harmonizers.promises import (
    BASE_FALLBACKS,
    LINEAR_UNDER_SCALING,
    NON_CONFLICTING,
    PERMUTATION_INVARIANT,
    PROMISES,
    STATIONARY_ZERO,
)

from .stacks import (
    DTYPES,
    TORCHJD_EXAMPLE,
    build,
    jacobians,
    random_jacobian,
    random_stack,
    well_conditioned,
)

SHAPES = ((2, 5), (3, 10), (5, 40))  # (K objectives, D parameters)


SCALES = (1e-10, 1e-5, 1e5, 1e15)


CALLS = 3  # calls per instance: stateful methods meet the family with their state


# Round-off of the combination d = sum_k w_k g_k, in units of eps * sum_k |w_k| ||g_k||.
COMBINATION_ULPS = 64


# Randomized methods get a seed: the suite is derandomized.
OPTIONS = {"cr_mogm": {"inner": "mgda"}} | {
    name: {"seed": 0} for name, cls in HARMONIZERS.items() if cls.randomized
}


Family = Callable[[torch.Generator, int, int, torch.dtype], torch.Tensor]


def _typical(generator: torch.Generator, k: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(k, d, generator=generator, dtype=torch.float64).to(dtype)


def _stationary(generator: torch.Generator, k: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """The last row is minus a positive combination of the others: zero is in the hull."""
    rows = torch.randn(k - 1, d, generator=generator, dtype=torch.float64)
    mix = 0.5 + torch.rand(k - 1, generator=generator, dtype=torch.float64)
    return torch.cat([rows, -(mix @ rows)[None]]).to(dtype)


def _opposed(generator: torch.Generator, k: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """[x, -c x] with c in [0.1, 10], computed in the dtype (the peer suite's pairs)."""
    x = torch.randn(d, generator=generator, dtype=torch.float64).to(dtype)
    c = float(10 ** (2 * torch.rand((), generator=generator, dtype=torch.float64) - 1))
    return torch.stack([x, -c * x])


def _collinear(generator: torch.Generator, k: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows c_k x with signs and sizes of their own, computed in the dtype."""
    x = torch.randn(d, generator=generator, dtype=torch.float64).to(dtype)
    scales = torch.randn(k, generator=generator, dtype=torch.float64) * 3
    return torch.stack([float(c) * x for c in scales])


FAMILIES: dict[str, Family] = {
    "typical": _typical,
    "stationary": _stationary,
    "opposed": _opposed,
    "collinear": _collinear,
}


def _cases(family: str, dtype: torch.dtype, scale: float = 1.0) -> list[torch.Tensor]:
    """Two stacks per shape, the same for every method; scaled in float64, then rounded."""
    seed = 10 * list(FAMILIES).index(family) + DTYPES.index(dtype)
    generator = torch.Generator().manual_seed(seed)
    stacks = [FAMILIES[family](generator, k, d, dtype) for k, d in SHAPES for _ in range(2)]
    return [(scale * stack.to(torch.float64)).to(dtype) for stack in stacks]


def _harmonizer(name: str):
    return make_harmonizer(name, **OPTIONS.get(name, {}))


def _declared(name: str, promise: str) -> bool:
    return promise in getattr(HARMONIZERS[name], "promises", frozenset())


def _results(name: str, stack: torch.Tensor) -> list[Harmonization]:
    """CALLS results on one instance; none for a stack with fewer rows than the method
    needs, which it must refuse with a ValueError saying so."""
    torch.manual_seed(0)  # methods drawing from the global generator draw alike
    harmonizer = _harmonizer(name)
    if len(stack) < getattr(harmonizer, "required_objectives", 1):
        with pytest.raises(ValueError, match="needs at least"):
            harmonizer(stack)
        return []
    return [harmonizer(stack) for _ in range(CALLS)]


def _combination_error(result: Harmonization, stack: torch.Tensor) -> float:
    """Absolute round-off of the direction: eps * sum_k |w_k| ||g_k||, with margin."""
    norms = stack.to(torch.float64).norm(dim=1)
    spread = float((result.weights.abs() * norms).sum())
    return COMBINATION_ULPS * torch.finfo(stack.dtype).eps * spread


def _eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def _warranted(result: Harmonization, stack: torch.Tensor) -> bool:
    """Whether the weights are no larger than the stack's scale warrants: at the gradients'
    own scale (sum_k |w_k| ||g_k|| <= K max ||g_k||, MGDA's simplex weights at a stationary
    point), or cancelling so little that d keeps half the dtype's digits (ratio <= eps^-1/2,
    measured on the stack itself: a Gram of float32 data is itself off by ~eps)."""
    gradients = stack.to(torch.float64)
    norms = gradients.norm(dim=1)
    spread = float((result.weights.abs() * norms).sum())
    if spread <= len(stack) * float(norms.max()):
        return True
    direction = float((result.weights @ gradients).norm())
    return spread <= direction / _eps(stack.dtype) ** 0.5


def _conflicts(result: Harmonization, stack: torch.Tensor) -> list[int]:
    """Objectives whose gradient meets the direction below round-off: g_k . d under
    -||g_k|| times the combination's round-off plus 1e3 eps ||d||."""
    if result.fallback is not None and result.fallback not in BASE_FALLBACKS:
        return []  # a fallback says why
    gradients = stack.to(torch.float64)
    direction = result.direction.to(torch.float64)
    slack = _combination_error(result, stack) + 1e3 * _eps(stack.dtype) * direction.norm()
    products = gradients @ direction
    return [k for k in range(len(stack)) if products[k] < -slack * gradients[k].norm()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_every_method_is_finite_and_takes_only_its_fallbacks(name: str, dtype) -> None:
    allowed = BASE_FALLBACKS | getattr(HARMONIZERS[name], "fallbacks", frozenset())
    for family in FAMILIES:
        for stack in _cases(family, dtype):
            for result in _results(name, stack):
                assert torch.isfinite(result.weights).all(), (family, result.weights)
                assert torch.isfinite(result.direction).all(), family
                assert result.fallback is None or result.fallback in allowed, (
                    family,
                    result.fallback,
                )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_an_all_zero_stack_gives_zero(name: str, dtype) -> None:
    result = _harmonizer(name)(torch.zeros(3, 7, dtype=dtype))
    assert result.fallback == "no_usable_objective"
    assert not result.weights.any() and not result.direction.any()


def _with(promise: str) -> list[str]:
    return sorted(name for name in HARMONIZERS if _declared(name, promise))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _with(NON_CONFLICTING))
def test_non_conflicting_methods_conflict_with_no_gradient(name: str, dtype) -> None:
    """On every family and scale; weights that cancel beyond the precision are refused too:
    the direction they give would be round-off (the peer suite's ~1e7 Nash-MTL weights)."""
    families = [(f, 1.0) for f in FAMILIES] + [("typical", s) for s in SCALES]
    for family, scale in families:
        for stack in _cases(family, dtype, scale):
            for result in _results(name, stack):
                assert not _conflicts(result, stack), (family, scale, result)
                assert _warranted(result, stack), (family, scale, result.weights)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _with(PERMUTATION_INVARIANT))
def test_permutation_invariant_methods(name: str, dtype) -> None:
    generator = torch.Generator().manual_seed(1)
    for stack in _cases("typical", dtype):
        order = torch.randperm(len(stack), generator=generator)
        if not (results := _results(name, stack)):
            continue  # too few rows for the method: refused, checked there
        plain, permuted = results[0], _results(name, stack[order])[0]
        tolerance = _combination_error(plain, stack)
        torch.testing.assert_close(permuted.direction, plain.direction, rtol=0, atol=tolerance)
        assert permuted.fallback == plain.fallback


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _with(LINEAR_UNDER_SCALING))
def test_linear_methods_scale_with_the_stack(name: str, dtype) -> None:
    for factor in (1e-3, 7.5, 1e4):
        for stack in _cases("typical", dtype):
            if not (results := _results(name, stack)):
                continue
            plain = results[0]
            scaled = _results(name, (factor * stack.to(torch.float64)).to(dtype))[0]
            tolerance = factor * _combination_error(plain, stack) + _combination_error(
                scaled, stack * factor
            )
            torch.testing.assert_close(
                scaled.direction.to(torch.float64),
                factor * plain.direction.to(torch.float64),
                rtol=1e3 * _eps(dtype),
                atol=tolerance,
            )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", _with(STATIONARY_ZERO))
def test_stationary_points_give_a_zero_direction(name: str, dtype) -> None:
    for family in ("stationary", "opposed"):
        for stack in _cases(family, dtype):
            for result in _results(name, stack):
                size = result.direction.to(torch.float64).norm()
                scale = stack.to(torch.float64).norm(dim=1).max()
                bound = _combination_error(result, stack) + 1e3 * _eps(dtype) * scale
                assert size <= bound, (family, float(size), result.fallback)


def test_every_promise_is_named_and_described() -> None:
    for name, cls in HARMONIZERS.items():
        unknown = set(getattr(cls, "promises", frozenset())) - set(PROMISES)
        assert not unknown, (name, unknown)
    assert any(_with(promise) for promise in PROMISES)


@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_a_zero_row_is_dropped_and_the_others_harmonized_alone(name: str) -> None:
    """A deliberate difference from TorchJD (docs/core/exactness.md): an exactly-zero
    gradient is an objective without signal, so it gets weight 0 and the method runs on the
    others (``Mean([[2, 0], [0, 0]])`` is [2, 0] here, [1, 0] in TorchJD)."""
    generator = torch.Generator().manual_seed(2)
    for k, d in SHAPES:
        others = torch.randn(k + 1, d, generator=generator, dtype=torch.float64)
        stack = torch.cat([others[:1], torch.zeros(1, d, dtype=torch.float64), others[1:]])
        alone, with_zero = _results(name, others), _results(name, stack)
        if not alone:
            continue
        assert with_zero[0].dropped == (1,) and with_zero[0].weights[1] == 0
        tolerance = _combination_error(alone[0], others)
        torch.testing.assert_close(
            with_zero[0].direction, alone[0].direction, rtol=0, atol=tolerance
        )


def test_the_documented_table_is_the_declarations() -> None:
    """docs/core/exactness.md's table of promises is the classes' data, row by row."""
    from pathlib import Path

    page = Path(__file__).resolve().parents[2] / "docs" / "core" / "exactness.md"
    lines = page.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| method | `non_"))
    columns = [cell.strip(" `") for cell in lines[header].strip("|").split("|")][1:-1]
    rows = {}
    for line in lines[header + 2 :]:
        if not line.startswith("| `"):
            break
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        name = cells[0].strip("`")
        cells_by_column = zip(columns, cells[1:-1], strict=True)
        promised = {column for column, cell in cells_by_column if cell == "yes"}
        fallbacks = {item.strip(" `") for item in cells[-1].split(",") if item.strip()}
        rows[name] = (promised, fallbacks)
    assert set(rows) == set(HARMONIZERS)
    for name, cls in HARMONIZERS.items():
        assert rows[name] == (set(cls.promises), set(cls.fallbacks)), name


@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_a_state_round_trips_and_a_foreign_one_is_refused(name: str) -> None:
    """load_state_dict({}) or {'bogus': 1} left seven stateful methods silently fresh."""
    stack = _cases("typical", torch.float64)[-1]  # K = 5: every method's minimum
    first, second = _harmonizer(name), _harmonizer(name)
    first(stack)
    second.load_state_dict(first.state_dict())
    torch.testing.assert_close(second(stack).direction, first(stack).direction)
    if first.state_dict():
        with pytest.raises(ValueError, match="missing"):
            _harmonizer(name).load_state_dict({})
    with pytest.raises(ValueError, match="unknown"):
        _harmonizer(name).load_state_dict({**first.state_dict(), "bogus": 1})


@pytest.mark.parametrize("name", sorted(HARMONIZERS))
def test_gram_only_input_gives_the_same_weights(name: str) -> None:
    jacobian = torch.randn(5, 11, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    options = {"seed": 0} if HARMONIZERS[name].randomized else {}
    if HARMONIZERS[name].needs_stack:
        with pytest.raises(ValueError, match="stack"):
            make_harmonizer(name, **options)(gram=jacobian @ jacobian.T)
        return
    from_gram = make_harmonizer(name, **options)(gram=jacobian @ jacobian.T)
    assert from_gram.direction is None
    torch.testing.assert_close(
        from_gram.weights, make_harmonizer(name, **options)(jacobian).weights
    )


# Gram methods that run with their defaults on any K >= 2 and whose weights ignore a common
# scale of the gradients (Nash-MTL's up to a factor).
GRAM_METHODS = ("cagrad", "nash_mtl", "upgrad", "dual_proj", "imtl_g", "aligned_mtl", "grad_vac")


@pytest.mark.parametrize("name", GRAM_METHODS)
def test_registered_and_usable_with_defaults(name: str) -> None:
    harmonizer = make_harmonizer(name)
    cls = type(harmonizer)
    assert mogradient.harmonizers.HARMONIZERS[name] is cls
    assert cls.__name__ in mogradient.harmonizers.__all__
    assert cls.__doc__ and "20" in cls.__doc__.splitlines()[0]  # cites author and year
    result = harmonizer(TORCHJD_EXAMPLE)
    assert result.weights.shape == (2,) and torch.isfinite(result.weights).all()
    torch.testing.assert_close(result.direction, result.weights @ TORCHJD_EXAMPLE)
    gram_only = make_harmonizer(name, **({"seed": 0} if name == "grad_vac" else {}))
    again = make_harmonizer(name, **({"seed": 0} if name == "grad_vac" else {}))
    torch.testing.assert_close(
        gram_only(gram=TORCHJD_EXAMPLE @ TORCHJD_EXAMPLE.T).weights, again(TORCHJD_EXAMPLE).weights
    )


@pytest.mark.parametrize("name", GRAM_METHODS)
def test_dropped_objective_gets_zero_weight(name: str) -> None:
    jacobian = random_jacobian(3, 4, 6)
    jacobian[2] = 0.0
    result = build(name)(jacobian)
    assert result.dropped == (2,) and result.weights[2] == 0
    reference = build(name)(jacobian[[0, 1, 3]])
    torch.testing.assert_close(result.weights[[0, 1, 3]], reference.weights)


@pytest.mark.parametrize("name", GRAM_METHODS)
@pytest.mark.parametrize("scale", [1e-10, 1e10])
def test_weights_are_scale_invariant(name: str, scale: float) -> None:
    jacobian = random_jacobian(5, 4, 7, spread=1.0)
    options = {"max_norm": 0.0} if name == "nash_mtl" else {}
    base = build(name, **options)(jacobian).weights
    scaled = build(name, **options)(jacobian * scale).weights
    # Nash-MTL's alpha scales as 1/scale (G alpha = 1/alpha); the others are invariant.
    factor = scale if name == "nash_mtl" else 1.0
    torch.testing.assert_close(scaled * factor, base, rtol=1e-9, atol=0)


@given(
    jacobians(),
    st.sampled_from(["upgrad", "dual_proj", "cagrad", "nash_mtl", "imtl_g", "aligned_mtl"]),
    st.randoms(use_true_random=False),
)
def test_permuting_objectives_permutes_weights(jacobian: torch.Tensor, name: str, random) -> None:
    # GradVac is left out: its random visiting order makes it order-dependent by design.
    if len(jacobian) < 2:
        return
    order = list(range(len(jacobian)))
    random.shuffle(order)
    base, permuted = build(name)(jacobian), build(name)(jacobian[order])
    scale = float(jacobian.norm(dim=1).max())
    weight_scale = float(base.weights.abs().max()) + 1e-300
    if name in ("nash_mtl", "imtl_g", "aligned_mtl") and not well_conditioned(jacobian):
        return  # ill-posed there (no Nash solution / pinv / eigen-threshold ties)
    torch.testing.assert_close(
        permuted.direction, base.direction, atol=1e-7 * max(scale, 1e-300), rtol=1e-7
    )
    if well_conditioned(jacobian):
        torch.testing.assert_close(
            permuted.weights, base.weights[order], atol=1e-7 * weight_scale, rtol=1e-7
        )


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("cagrad", {"c": -0.1}, "c must be"),
        ("cagrad", {"c": float("nan")}, "c must be"),
        ("nash_mtl", {"max_norm": -1.0}, "max_norm"),
        ("nash_mtl", {"max_iterations": 0}, "max_iterations"),
        ("upgrad", {"pref_vector": [1.0, -1.0]}, "pref_vector"),
        ("upgrad", {"pref_vector": [[1.0, 1.0]]}, "pref_vector"),
        ("upgrad", {"reg_eps": -1e-4}, "reg_eps"),
        ("dual_proj", {"pref_vector": [0.0, 0.0]}, "pref_vector"),
        ("aligned_mtl", {"scale_mode": "max"}, "scale_mode"),
        ("grad_vac", {"beta": 1.5}, "beta"),
        ("grad_vac", {"eps": -1.0}, "eps"),
    ],
)
def test_invalid_options_are_rejected(name: str, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make_harmonizer(name, **options)


def test_weighted_sum_methods_are_amortizable() -> None:
    for harmonizer in (ConFIG(), FairGrad(), Krum(), MGDA()):
        assert harmonizer.direction_is_weighted_sum
        Amortizer(harmonizer)


@pytest.mark.parametrize(
    "make",
    [ConFIG, FairGrad, Krum, lambda: TrimmedMean(1), lambda: GradDrop(seed=3)],
    ids=["config", "fair_grad", "krum", "trimmed_mean", "grad_drop"],
)
def test_zero_gradient_is_left_out(make: object) -> None:
    stack = random_stack(8, 5, 10)
    stack[2] = 0.0
    result = make()(stack)
    assert result.dropped == (2,) and result.weights[2] == 0
    reference = make()(stack[[0, 1, 3, 4]])
    torch.testing.assert_close(result.direction, reference.direction)
