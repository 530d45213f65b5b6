"""The harmonizer contract: per-objective gradients (or their Gram) in, raw-gradient weights out.

Weights on the *raw* gradients are the primary output because the amortized path
(one backward of a combined loss) needs weights, not a direction. The base class owns
input validation and the handling of objectives whose gradient is zero or non-finite:
those are left out of the method's computation, get weight zero, and are reported.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from mogradient._finite import all_finite
from mogradient._gram import (
    CosineGram,
    gram_eps,
    scaled_gram,
    summed_eps,
    unscaled,
    validated_gram,
)
from mogradient._qp import solve_simplex_qp_factored
from mogradient.errors import SolverError

# Columns per block of the batched direction product (large enough that per-block
# overhead is negligible, small enough that mid-sized stacks still split over threads).
_COMBINE_BLOCK_COLUMNS = 1 << 16
# Stack entries from which the direction is computed on all threads: a pass long enough
# that a parallel region's possible wait for a descheduled thread is amortized.
_PARALLEL_COMBINE_ENTRIES = 1 << 24
_NUMPY_DTYPES = {
    torch.float16: np.float16,
    torch.float32: np.float32,
    torch.float64: np.float64,
}


@dataclass(frozen=True)
class WeighResult:
    """What [`Harmonizer.weigh`][mogradient.harmonizers.Harmonizer.weigh] computed on the valid
    objectives' Gram matrix.

    Named for the method that returns it: in TorchJD a ``Weighting`` is the method itself.
    A call's full result, weights on every objective, is a
    [`Harmonization`][mogradient.harmonizers.Harmonization].
    """

    weights: torch.Tensor
    kkt_residual: float | None = None
    fallback: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)
    # Set by :meth:`Harmonizer.refine` when the direction was computed more exactly than
    # ``sum_k w_k g_k`` can be (cancelling weights); None means that sum.
    direction: torch.Tensor | None = None


@dataclass(frozen=True)
class Harmonization:
    """Weights on the raw gradients, the direction they give, and what happened."""

    weights: torch.Tensor
    direction: torch.Tensor | None
    gram: torch.Tensor | None = None
    dropped: tuple[int, ...] = ()
    fallback: str | None = None
    kkt_residual: float | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class Harmonizer(ABC):
    """Base class: validate, drop unusable objectives, delegate to
    [`weigh`][mogradient.harmonizers.Harmonizer.weigh]."""

    # Whether the direction is exactly sum_k w_k g_k of the reported weights. Methods that
    # work coordinate by coordinate (TrimmedMean, GradDrop) set it to False: their weights
    # only approximate the direction, so weights cached or re-applied elsewhere (the
    # Amortizer) would not reproduce it.
    direction_is_weighted_sum: ClassVar[bool] = True
    # Whether a call needs the K x D stack; Gram-only calls (``gram=``) raise for such
    # methods (ExcessMTL's per-parameter scales, the coordinate-wise methods).
    needs_stack: ClassVar[bool] = False
    # What the method's definition guarantees (names in mogradient.harmonizers.promises),
    # at its default options, and the fallbacks it may take beside the base class's own:
    # tests/harmonizers/test_contract.py checks every declaration of every method.
    promises: ClassVar[frozenset[str]] = frozenset()
    fallbacks: ClassVar[frozenset[str]] = frozenset()
    # Whether the method keeps state per objective between calls (EMA targets, tracked
    # weights): its state is numbered by objective index, so a call with another K would
    # silently mix two sets of objectives. Such methods refuse a change of K.
    keeps_objective_state: ClassVar[bool] = False
    # Whether the weights draw random numbers from a private generator set by a ``seed``
    # option: a strategy seeds such a method from the run, so that runs are reproducible.
    randomized: ClassVar[bool] = False
    # The K that the kept state was built for (None: no state yet).
    _objective_count: int | None = None

    @property
    def required_objectives(self) -> int:
        """Usable gradients a call needs; fewer raise a ValueError saying so."""
        return 1

    def __call__(
        self, jacobian: torch.Tensor | None = None, *, gram: torch.Tensor | None = None
    ) -> Harmonization:
        """Harmonize a K x D gradient stack, or a K x K Gram matrix when only weights are needed."""
        if (jacobian is None) == (gram is None):
            raise ValueError("pass exactly one of `jacobian` (K x D) or `gram=` (K x K)")
        if jacobian is not None:
            # Harmonization is not part of the graph: never backpropagate through it.
            jacobian = _validated_jacobian(jacobian).detach()
            eps, cosine_eps = torch.finfo(jacobian.dtype).eps, summed_eps(jacobian.dtype)
            scaled, exponents = scaled_gram(jacobian)
            gram = unscaled(scaled, exponents)
        else:
            eps = cosine_eps = gram_eps(gram)
            gram = validated_gram(gram)
            scaled, exponents = gram, torch.zeros(len(gram), dtype=torch.int64)
        valid = _usable_objectives(scaled)
        num_objectives = gram.shape[0]
        self._check_objective_count(num_objectives)
        dropped = tuple(int(index) for index in torch.nonzero(~valid).flatten())
        weights = torch.zeros(num_objectives, dtype=torch.float64)
        if not valid.any():
            weighting = WeighResult(weights, fallback="no_usable_objective")
        else:
            objectives = torch.nonzero(valid).flatten()
            sub_gram = CosineGram.from_scaled(
                scaled.cpu()[objectives][:, objectives], exponents[objectives], eps, cosine_eps
            )
            weighting = self.weigh(sub_gram, objectives)
            if jacobian is not None:
                weighting = self.refine(jacobian, objectives, sub_gram, weighting) or weighting
            self._check_weights(weighting.weights, objectives, sub_gram)
            weights[objectives] = weighting.weights.to(torch.float64)
            if weighting.fallback is None and len(objectives) == 1 and num_objectives > 1:
                weighting = WeighResult(
                    weighting.weights, weighting.kkt_residual, "single_objective"
                )
        extra_dropped = tuple(weighting.extras.get("dropped", ()))
        direction = weighting.direction
        if direction is None and jacobian is not None:
            direction = combine(jacobian, weights, torch.isfinite(torch.diagonal(scaled)))
        if direction is not None:
            direction = self._representable(jacobian, weights, direction)
        return Harmonization(
            weights=weights,
            direction=direction,
            gram=gram,
            dropped=tuple(sorted(set(dropped) | set(extra_dropped))),
            fallback=weighting.fallback,
            kkt_residual=weighting.kkt_residual,
            extras={key: value for key, value in weighting.extras.items() if key != "dropped"},
        )

    def _check_objective_count(self, count: int) -> None:
        """Refuse a call whose K differs from the one the kept state was built for."""
        if not self.keeps_objective_state:
            return
        if self._objective_count is not None and count != self._objective_count:
            raise ValueError(
                f"{type(self).__name__}: the state holds K={self._objective_count} "
                f"objectives, this call has {count}; call reset() (or use a fresh instance) "
                "for a new set of objectives"
            )
        self._objective_count = count

    def _check_weights(
        self, weights: torch.Tensor, objectives: torch.Tensor, gram: CosineGram
    ) -> None:
        """Refuse weights of the wrong shape or non-finite ones, as finally returned."""
        name = type(self).__name__
        if weights.shape != (len(objectives),):
            raise RuntimeError(
                f"{name} returned weights of shape {tuple(weights.shape)}, "
                f"expected ({len(objectives)},)"
            )
        bad = ~torch.isfinite(weights)
        if bad.any():
            indices = objectives[bad.to(objectives.device)].tolist()
            raise SolverError(
                f"{name} produced non-finite weights on objectives {indices}{_span_hint(gram)}"
            )

    def _representable(
        self, jacobian: torch.Tensor | None, weights: torch.Tensor, direction: torch.Tensor
    ) -> torch.Tensor:
        """``direction`` if finite; else the weighted sum summed without overflow, or an
        OverflowError where the exact direction is beyond the stack's dtype.

        Why: a sum of rows near the dtype's maximum overflows in its partial sums (or in
        a method's own formula) where the answer itself may be representable. One sum on
        the usual path.
        """
        if all_finite(direction):
            return direction
        if jacobian is None or not self.direction_is_weighted_sum:
            raise OverflowError(overflow_message(type(self).__name__, direction.dtype))
        exact = _scaled_combination(jacobian, weights)
        rounded = exact.to(jacobian.dtype)
        if all_finite(rounded):
            return rounded
        largest = float(exact.abs().max())
        raise OverflowError(overflow_message(type(self).__name__, jacobian.dtype, largest))

    def reset(self) -> None:
        """Forget the state kept between calls (start of a new run, or a new set of objectives)."""
        self._objective_count = None

    @abstractmethod
    def weigh(self, gram: CosineGram, objectives: torch.Tensor) -> WeighResult:
        """Weights for the usable objectives.

        ``gram`` is their Gram matrix as cosines and norms (K' >= 1 gradients, every
        norm positive): read ``gram.cosines`` and ``gram.norms`` to resolve gradients of
        any size, or ``gram.matrix()``, the Gram up to a common power of two, where the
        smallest may underflow. ``objectives`` holds their indices in the caller's
        numbering, for methods that keep per-objective state. ``gram.eps`` and
        ``gram.cosine_eps`` are the precisions of the gradients and of the cosines:
        decide that zero is in the hull, or that gradients are dependent, at those
        ([`zero_in_hull`][mogradient.harmonizers.zero_in_hull]), never at float64's.
        """

    def refine(
        self,
        jacobian: torch.Tensor,
        objectives: torch.Tensor,
        gram: CosineGram,
        weighting: WeighResult,
    ) -> WeighResult | None:
        """A more exact weighting computed on the stack's usable rows, or None to keep it.

        A float64 Gram resolves a component of one gradient off a near-dependent other
        only to ~sqrt(eps) of its norm. Methods whose answer hinges on such components
        override this to redo the solve on ``jacobian[objectives]`` when ``gram`` says so.
        """
        return None

    def state_dict(self) -> dict[str, Any]:
        """State that a resumed run needs (RNG of randomized methods, the K of per-objective
        state; subclasses add more)."""
        generator = getattr(self, "_generator", None)
        state = {} if generator is None else {"generator": generator.get_state()}
        if self.keeps_objective_state:
            state["objectives"] = self._objective_count
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what [`state_dict`][mogradient.harmonizers.Harmonizer.state_dict] saved; a state
        with other entries is refused (an empty or foreign dict would otherwise leave the method
        silently fresh), and so is one built for another K than this instance's calls had."""
        name = type(self).__name__
        expected, given = set(self.state_dict()), set(state)
        if given != expected:
            missing, unknown = sorted(expected - given), sorted(given - expected)
            raise ValueError(
                f"{name}.load_state_dict: not a state of this method "
                f"(missing {missing}, unknown {unknown}); pass what state_dict() returned"
            )
        if "objectives" in state:
            self._load_objective_count(state["objectives"])
        if "generator" in state:
            self._generator.set_state(state["generator"])

    def _load_objective_count(self, count: int | None) -> None:
        """Take the K of a loaded state; refuse one that differs from this instance's."""
        name = type(self).__name__
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise ValueError(
                f"{name}.load_state_dict: 'objectives' must be a number of objectives or "
                f"None, got {count!r}; pass what state_dict() returned"
            )
        if None not in (count, self._objective_count) and count != self._objective_count:
            raise ValueError(
                f"{name}.load_state_dict: the state holds K={count} objectives, this "
                f"instance's calls had {self._objective_count}; load it into a fresh "
                "instance (or call reset() first) for that set of objectives"
            )
        self._objective_count = count

    def __repr__(self) -> str:
        settings = ", ".join(
            f"{key}={value!r}" for key, value in vars(self).items() if not key.startswith("_")
        )
        return f"{type(self).__name__}({settings})"


def combine(
    jacobian: torch.Tensor, weights: torch.Tensor, finite_rows: torch.Tensor | None = None
) -> torch.Tensor:
    """``sum_k w_k g_k``, reading the stack once; rows with zero weight never leak NaN/Inf.

    ``finite_rows`` (K booleans, e.g. a finite Gram diagonal) marks rows known to hold no
    NaN/Inf; other zero-weight rows are read once to check before the one-pass product.
    """
    weights = weights.to(device=jacobian.device)
    used = weights != 0
    if not used.any():
        return torch.zeros(jacobian.shape[1], dtype=jacobian.dtype, device=jacobian.device)
    narrowed = weights.to(jacobian.dtype)
    if not (torch.isfinite(narrowed).all() and torch.equal(narrowed != 0, used)):
        return _combine_in_float64(jacobian, weights, used)
    unchecked = ~used if finite_rows is None else ~used & ~finite_rows.to(used.device)
    if all(torch.isfinite(jacobian[index].sum()) for index in torch.nonzero(unchecked).flatten()):
        # 0 * finite = 0: one matrix-vector product over all rows is exact.
        if jacobian.requires_grad and torch.is_grad_enabled():
            return narrowed @ jacobian
        direction = _new_vector(jacobian)
        _weighted_rows_into(narrowed, jacobian, direction)
        return direction
    # Unused rows may hold NaN (0 * NaN = NaN): accumulate the used rows one by one
    # rather than copying them out of a possibly huge stack.
    direction = _new_vector(jacobian).zero_()
    for index in torch.nonzero(used).flatten().tolist():
        direction.add_(jacobian[index], alpha=float(weights[index]))
    return direction


def _new_vector(jacobian: torch.Tensor) -> torch.Tensor:
    """An uninitialized length-D vector like the stack's rows, on CPU from numpy.

    Why numpy: it asks Linux for transparent huge pages on large arrays, and the
    first-touch faults of a fresh 4 KiB-paged direction of tens of millions of entries
    cost more than reading the whole stack once.
    """
    numpy_dtype = _NUMPY_DTYPES.get(jacobian.dtype)
    if jacobian.device.type == "cpu" and numpy_dtype is not None:
        return torch.from_numpy(np.empty(jacobian.shape[1], dtype=numpy_dtype))
    return torch.empty(jacobian.shape[1], dtype=jacobian.dtype, device=jacobian.device)


def _weighted_rows_into(weights: torch.Tensor, jacobian: torch.Tensor, out: torch.Tensor) -> None:
    """``out = weights @ jacobian``, on all of torch's threads when the stack is large.

    On CPU one matrix-vector product is a single-threaded BLAS call (only the calling
    thread accumulates CPU time). A batched product over column blocks is split over
    torch's intra-op threads, which also first-touch their own part of ``out``; every
    entry is the same K-term sum either way. Small stacks stay on one thread: on a machine
    shared with other jobs a parallel region can wait a scheduler tick for a descheduled
    thread (the caveat in benchmarks/results/mgda_exactness.md).
    """
    num_objectives, dim = jacobian.shape
    width = _COMBINE_BLOCK_COLUMNS
    parallel = jacobian.device.type == "cpu" and jacobian.numel() >= _PARALLEL_COMBINE_ENTRIES
    done = dim // width * width if parallel else 0
    if done:
        count = done // width
        blocks = jacobian[:, :done].reshape(num_objectives, count, width).transpose(0, 1)
        rows = weights.expand(count, 1, num_objectives)
        torch.bmm(rows, blocks, out=out[:done].view(count, 1, width))
    if done < dim:
        torch.mv(jacobian[:, done:].T, weights, out=out[done:])


def _combine_in_float64(
    jacobian: torch.Tensor, weights: torch.Tensor, used: torch.Tensor
) -> torch.Tensor:
    """The combination for weights that over- or underflow the stack's dtype.

    Gradients whose norms span float32's whole range get weights like 1e60 on their
    smallest rows; summing in float64 span by span keeps the (representable) result.
    """
    direction = _new_vector(jacobian)
    span = 1 << 20
    rows = torch.nonzero(used).flatten().tolist()
    for start in range(0, jacobian.shape[1], span):
        piece = torch.zeros(
            min(span, jacobian.shape[1] - start), dtype=torch.float64, device=jacobian.device
        )
        for index in rows:
            piece.add_(
                jacobian[index, start : start + span].to(torch.float64), alpha=float(weights[index])
            )
        direction[start : start + span] = piece
    return direction


def _scaled_combination(jacobian: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``sum_k w_k g_k`` in float64, every term divided by one power of two 2^top.

    Why: rows near the dtype's maximum overflow in partial sums (3e38 + 3e38 - 3e38 in
    float32) and float64 rows near 1e308 even in float64. With each row scaled to
    max |entry| in [0.5, 1) and its weight's share of 2^top (at most 1), every partial
    sum is at most K; powers of two are exact, so the result is the plain sum's, and
    it is Inf only where it is beyond float64. Rows with weight zero are never read.
    """
    used = torch.nonzero(weights != 0).flatten().tolist()
    peaks = [float(jacobian[index].abs().max()) for index in used]
    row_powers = [math.frexp(peak)[1] for peak in peaks]
    weight_parts = [math.frexp(float(weights[index])) for index in used]
    top = max(power + part[1] for power, part in zip(row_powers, weight_parts, strict=True))
    direction = torch.zeros(jacobian.shape[1], dtype=torch.float64, device=jacobian.device)
    for index, power, (mantissa, exponent) in zip(used, row_powers, weight_parts, strict=True):
        row = _times_power_of_two(jacobian[index].to(torch.float64), -power)
        direction.add_(row, alpha=math.ldexp(mantissa, exponent + power - top))
    return _times_power_of_two(direction, top)


def _times_power_of_two(values: torch.Tensor, power: int) -> torch.Tensor:
    """``values * 2^power`` in steps that float64 represents (2^1024 itself is not)."""
    while power:
        step = max(-1000, min(1000, power))
        values = values * math.ldexp(1.0, step)
        power -= step
    return values


def overflow_message(method: str, dtype: torch.dtype, largest: float | None = None) -> str:
    """One line saying that ``method``'s direction is beyond ``dtype`` and what to do."""
    name = str(dtype).removeprefix("torch.")
    if largest is None:
        reach = ""
    elif math.isfinite(largest):
        reach = (
            f" (its exact entries reach {largest:.3g}; {name} holds {torch.finfo(dtype).max:.3g})"
        )
    else:
        reach = " (its exact entries are beyond float64's range too)"
    wider = "" if dtype == torch.float64 else ", or compute the gradients in float64"
    return (
        f"{method}'s direction is not representable in {name}{reach}: scale the losses down{wider}"
    )


def _span_hint(gram: CosineGram) -> str:
    """Why weights overflow where the gradients' norms reach beyond ~1e300 of each other or
    of 1 (a raw weight scales like the direction's size over its gradient's norm)."""
    logs = torch.log10(gram.norms) + gram.exponent * math.log10(2.0)
    low, high = float(logs.min()), float(logs.max())
    if max(high, -low, high - low) < 300:
        return ""
    # A norm below 2^-1074 of the largest underflowed in the Gram's units.
    smallest = f"1e{low:.0f}" if math.isfinite(low) else f"below 1e{high - 323:.0f}"
    return (
        f" (the gradients' norms span {smallest} to 1e{high:.0f}, at or beyond float64's "
        "range for weights on raw gradients: rescale the losses of the extreme objectives)"
    )


def validated_flag(value: bool, name: str) -> bool:
    """``value`` if it is a bool (numpy's too), else a ValueError naming the option.

    ``bool(value)`` would read the string ``"false"`` (a quoted YAML value) as True and
    silently run the other variant of the method.
    """
    if not isinstance(value, bool | np.bool_):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return bool(value)


def validated_preferences(
    preferences: list[float] | torch.Tensor | None, name: str
) -> torch.Tensor | None:
    """A 1-D, finite, non-negative, not-all-zero float64 preference vector (or None)."""
    if preferences is None:
        return None
    preferences = torch.as_tensor(preferences, dtype=torch.float64).detach().cpu()
    if (
        preferences.ndim != 1
        or len(preferences) == 0
        or not torch.isfinite(preferences).all()
        or (preferences < 0).any()
        or preferences.sum() <= 0
    ):
        raise ValueError(
            f"{name} must be a non-empty 1-D list of finite, non-negative numbers, not all zero"
        )
    return preferences.clone()


def preferences_for(preferences: torch.Tensor | None, objectives: torch.Tensor) -> torch.Tensor:
    """The usable objectives' preferences: 1/K' by default, else the configured entries.

    When some objectives were dropped the remaining preferences are rescaled to keep the
    configured total (as [`FixedWeights`][mogradient.harmonizers.FixedWeights] does), so
    the update's size does not shrink with the number of objectives present.
    """
    count = len(objectives)
    if preferences is None:
        return torch.full((count,), 1.0 / count, dtype=torch.float64)
    if int(objectives.max()) >= len(preferences):
        raise ValueError(
            f"got objective index {int(objectives.max())} but only {len(preferences)} "
            "preferences; give one preference per objective"
        )
    present = preferences[objectives.cpu()].clone()
    if count < len(preferences) and present.sum() > 0:
        present = present * (preferences.sum() / present.sum())
    return present


def zero_in_hull(gram: CosineGram) -> bool:
    """Whether zero is in the gradients' convex hull within the Gram's precision: the min
    over the simplex of a^T C a (C the cosines) is at most 4 K eps (``gram.cosine_eps``).

    Why this bound: the cosines are known to ~eps, so a^T C a is too, up to the K x K
    errors' spectral norm, and below a few K eps the Gram cannot tell the hull from zero.
    Above it, a direction d = sum_k b_k u_k (b > 0) keeps its promise through round-off
    in the same precision: with p the min-norm point, ||d|| >= ||p|| sum_k b_k, so for
    Nash-MTL (||d||^2 = K and u_k . d = 1/b_k >= 1/sum_j b_j) rounding each u_j by eps,
    which moves u_k . d by up to eps sum_j b_j, costs at most
    eps (sum_j b_j)^2 <= eps K / ||p||^2 < 1/4 of it.
    """
    count = len(gram)
    hull = solve_simplex_qp_factored(gram.cosines.numpy(), np.ones(count))
    return hull.objective <= 4 * count * gram.cosine_eps


def seeded_generator(seed: int | None) -> torch.Generator:
    """A private RNG for a randomized method: reproducible with a seed, fresh entropy without."""
    generator = torch.Generator()
    if seed is not None:
        generator.manual_seed(seed)
    else:
        generator.seed()
    return generator


def _validated_jacobian(jacobian: torch.Tensor) -> torch.Tensor:
    if not isinstance(jacobian, torch.Tensor):
        raise TypeError(f"the gradient stack must be a torch.Tensor, got {type(jacobian).__name__}")
    if jacobian.ndim != 2:
        raise ValueError(
            "the gradient stack must have shape (K objectives, D parameters); "
            f"got shape {tuple(jacobian.shape)}. Flatten each gradient and stack them."
        )
    if jacobian.shape[0] == 0 or jacobian.shape[1] == 0:
        raise ValueError(f"the gradient stack is empty: shape {tuple(jacobian.shape)}")
    if not jacobian.is_floating_point():
        raise TypeError(f"the gradient stack must be floating point, got {jacobian.dtype}")
    return jacobian


def _usable_objectives(gram: torch.Tensor) -> torch.Tensor:
    """Objectives whose gradient is finite and not exactly zero, read off the diagonal of
    the row-scaled Gram (`scaled_gram`).

    A NaN or Inf anywhere in a gradient makes its squared norm non-finite; the other
    objectives' entries stay usable. A small gradient is still a gradient: the scaled
    Gram keeps it exact at any norm, and the methods read it in its own units.
    """
    diagonal = torch.diagonal(gram).cpu()
    return torch.isfinite(diagonal) & (diagonal > 0)
