"""State kept per objective is state for one K: a call or a loaded state with another K is
refused, and ``reset()`` starts over.

Harmonizers keep such state keyed by objective index (GradVac's pair targets, MoDo's and
SDMGrad's simplex weights, CR-MOGM's average, ExcessMTL's and PCD's moving averages), so a
call with K = 2 after K = 3 would silently carry objective 0 and 1's state into whatever
the caller now numbers 0 and 1. Scalarizations size their state at construction
(``num_tasks``) and refuse other counts on the call and on ``load_state_dict``.
"""

from __future__ import annotations

import pytest
import torch

from mogradient.harmonizers import HARMONIZERS, Harmonizer, RewardDropout, make_harmonizer
from mogradient.scalarizations import SCALARIZATIONS, make_scalarization

OPTIONS = {"cr_mogm": {"inner": "mgda"}} | {
    name: {"seed": 0} for name in ("pcgrad", "rlw", "grad_vac", "grad_drop")
}
# The registered methods that keep state per objective between calls.
STATEFUL = ["cr_mogm", "excess_mtl", "grad_vac", "modo", "pcd", "sdmgrad"]
# State entries that are not per objective: the RNG, and the K of the rest.
NOT_PER_OBJECTIVE = {"generator", "objectives"}


def build(name: str) -> Harmonizer:
    return make_harmonizer(name, **OPTIONS.get(name, {}))


def stack(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 6, generator=generator, dtype=torch.float64)


def test_the_stateful_methods_are_the_ones_with_state() -> None:
    """Every method whose state holds more than its RNG declares it, and they are the
    ones tested here: a method registered later with state is caught."""
    with_state = []
    for name in sorted(HARMONIZERS):
        harmonizer = build(name)
        harmonizer(stack(3))
        if set(harmonizer.state_dict()) - NOT_PER_OBJECTIVE:
            with_state.append(name)
        assert getattr(harmonizer, "keeps_objective_state", False) == (name in with_state), name
    assert with_state == STATEFUL


@pytest.mark.parametrize("name", STATEFUL)
def test_a_call_with_another_count_is_refused(name: str) -> None:
    harmonizer = build(name)
    harmonizer(stack(3))
    before = harmonizer.state_dict()
    with pytest.raises(
        ValueError, match=r"state holds K=3 objectives, this call has 2; call reset"
    ):
        harmonizer(stack(2))
    assert set(harmonizer.state_dict()) == set(before)
    harmonizer.reset()
    assert torch.isfinite(harmonizer(stack(2)).weights).all()


@pytest.mark.parametrize("name", STATEFUL)
def test_a_dropped_objective_is_not_another_count(name: str) -> None:
    """A zero row is a dropped objective for one step, not a new set of objectives."""
    harmonizer = build(name)
    harmonizer(stack(3))
    missing = stack(3, seed=1)
    missing[1] = 0.0
    assert harmonizer(missing).dropped == (1,)
    harmonizer(stack(3, seed=2))


@pytest.mark.parametrize("name", STATEFUL)
def test_a_state_for_another_count_is_refused_on_load(name: str) -> None:
    """Into an instance already used with K = 2; a fresh instance takes the state's K
    and refuses calls with another."""
    source = build(name)
    source(stack(3))
    state = source.state_dict()
    used = build(name)
    used(stack(2))
    with pytest.raises(
        ValueError, match=r"state holds K=3 objectives, this instance's calls had 2"
    ):
        used.load_state_dict(state)
    fresh = build(name)
    fresh.load_state_dict(state)
    with pytest.raises(ValueError, match="state holds K=3 objectives, this call has 2"):
        fresh(stack(2))
    assert torch.isfinite(fresh(stack(3)).weights).all()


def test_reward_dropout_keeps_its_inner_methods_count() -> None:
    dropout = RewardDropout(make_harmonizer("grad_vac", seed=0), probability=0.5, seed=0)
    dropout(stack(3))
    with pytest.raises(ValueError, match="state holds K=3 objectives, this call has 2"):
        dropout(stack(2))
    dropout.reset()
    assert dropout.inner.targets == {}
    dropout(stack(2))
    stateless = RewardDropout(make_harmonizer("mean"), probability=0.5, seed=0)
    stateless(stack(3))
    stateless(stack(2))


SCALARIZATION_OPTIONS = {"stch": {"mu": 0.1}, "cosmos": {"lam": 1.0}}
NEEDS_SHARED = {"grad_norm", "db_mtl", "imtl", "moco"}


def scalarization(name: str, count: int) -> torch.nn.Module:
    options = dict(SCALARIZATION_OPTIONS.get(name, {}))
    if name in NEEDS_SHARED:
        options["shared"] = [torch.nn.Parameter(torch.ones(2))]
    return make_scalarization(name, num_tasks=count, **options)


@pytest.mark.parametrize("name", sorted(SCALARIZATIONS))
def test_scalarizations_refuse_another_count(name: str) -> None:
    with pytest.raises(ValueError, match="built for 3 tasks but got 2 losses"):
        scalarization(name, 3)(torch.ones(2, requires_grad=True))
    state = scalarization(name, 2).state_dict()
    if state:
        with pytest.raises(RuntimeError, match="size mismatch"):
            scalarization(name, 3).load_state_dict(state)
