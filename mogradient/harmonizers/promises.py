"""What a harmonizer promises about its answer, as data: ``Harmonizer.promises``.

Why as data: each method's docstring states guarantees that follow from its definition
(MGDA's min-norm point conflicts with no gradient; Nash-MTL's weights scale with no
gradient), and one property suite (``tests/harmonizers/test_contract.py``) checks every
declared promise of every registered method on the same input families, in float32 and
float64. A method registered later is covered by declaring what it promises.

Every method, whatever it declares, returns finite weights and direction, takes only the
fallbacks it declares (``Harmonizer.fallbacks``, beside the base class's own), and on an
all-zero stack returns zero with ``fallback="no_usable_objective"``.
"""

from __future__ import annotations

NON_CONFLICTING = "non_conflicting"
PERMUTATION_INVARIANT = "permutation_invariant"
LINEAR_UNDER_SCALING = "linear_under_scaling"
STATIONARY_ZERO = "stationary_zero"

PROMISES = {
    NON_CONFLICTING: (
        "g_k . d >= 0 for every objective, up to the round-off of combining the gradients in "
        "their precision, unless a fallback says why not; and the weights do not cancel "
        "beyond that precision (sum_k |w_k| ||g_k|| stays within 1% / eps of ||d||)"
    ),
    PERMUTATION_INVARIANT: (
        "reordering the objectives reorders the weights and leaves the direction unchanged"
    ),
    LINEAR_UNDER_SCALING: "d(c J) = c d(J) for every c > 0",
    STATIONARY_ZERO: (
        "where a non-negative combination of the gradients is zero (no direction improves "
        "every objective) the direction is zero to round-off"
    ),
}

# Fallbacks the base class takes for every method.
BASE_FALLBACKS = frozenset({"no_usable_objective", "single_objective"})
