"""mogradient.engines.mtl_backward: heads get their own gradients, the trunk a
harmonized one, checked against independently computed Jacobians and against TorchJD.

The model is a float64 trunk (two tanh layers) and K heads with different losses. The
reference Jacobian of each test is computed directly: K separate ``torch.autograd.grad``
calls from each loss to the parameters, not through the features. Our results go through
the features, a vmapped backward and the harmonizer, so they differ from the references
by rounding only: a few layers of float64 arithmetic amplified by the solver's
conditioning, far below 1e-12 relative to the gradient's scale, while a wrong row, a
missing term or the wrong weights change results by O(1).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import mogradient as mg
from mogradient.engines import mtl_backward
from mogradient.errors import UnusedParameterError

RELATIVE = 1e-12
NUM_TASKS = 3
BATCH = 7


class Net(nn.Module):
    """A trunk and NUM_TASKS heads: regression, binary and 4-class classification."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.trunk = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 6), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(6, 1), nn.Linear(6, 1), nn.Linear(6, 4)])
        self.double()

    def losses(self, features: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        out = [head(features) for head in self.heads]
        return [
            nn.functional.mse_loss(out[0].squeeze(1), batch["value"]),
            nn.functional.binary_cross_entropy_with_logits(out[1].squeeze(1), batch["flag"]),
            nn.functional.cross_entropy(out[2], batch["label"]),
        ]

    def shared(self) -> list[nn.Parameter]:
        return list(self.trunk.parameters())

    def head(self, task: int) -> list[nn.Parameter]:
        return list(self.heads[task].parameters())


def make_batch(seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(BATCH, 5, generator=generator, dtype=torch.float64),
        "value": torch.randn(BATCH, generator=generator, dtype=torch.float64),
        "flag": torch.randint(2, (BATCH,), generator=generator).double(),
        "label": torch.randint(4, (BATCH,), generator=generator),
    }


def forward(model: Net, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    features = model.trunk(batch["x"])
    return features, model.losses(features, batch)


def jacobian(losses: list[torch.Tensor], inputs: list[torch.Tensor]) -> torch.Tensor:
    """K x D: one autograd.grad per loss, straight from the loss to ``inputs``."""
    rows = [torch.autograd.grad(loss, inputs, retain_graph=True) for loss in losses]
    return torch.stack([torch.cat([grad.reshape(-1) for grad in row]) for row in rows])


def grads_of(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameter.grad.reshape(-1) for parameter in parameters])


def assert_relative(actual: torch.Tensor, expected: torch.Tensor, relative: float) -> None:
    scale = float(expected.abs().max())
    assert scale > 0
    error = float((actual - expected).abs().max())
    assert error <= relative * scale, f"difference {error:.3e} vs scale {scale:.3e}"


HARMONIZERS: dict[str, Callable[[], mg.Harmonizer]] = {
    "UPGrad": mg.harmonizers.UPGrad,
    "MGDA": lambda: mg.harmonizers.MGDA(normalize=False),
    "MGDA-NR": mg.harmonizers.MGDA,
    "PCGrad": lambda: mg.harmonizers.PCGrad(seed=3),
    "CAGrad": mg.harmonizers.CAGrad,
    "Mean": mg.harmonizers.Mean,
}


@pytest.mark.parametrize("name", list(HARMONIZERS))
@pytest.mark.parametrize(
    ("method", "chunk_size"), [("batched", None), ("batched", 2), ("sequential", None)]
)
def test_trunk_mode_harmonizes_the_trunk_jacobian(
    name: str, method: str, chunk_size: int | None
) -> None:
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    full = jacobian(losses, model.shared())
    expected = HARMONIZERS[name]()(full)
    own = [jacobian([loss], model.head(task))[0] for task, loss in enumerate(losses)]

    result = mtl_backward(
        losses,
        features,
        HARMONIZERS[name](),
        shared_parameters=model.shared(),
        method=method,
        chunk_size=chunk_size,
    )

    assert_relative(grads_of(model.shared()), expected.direction, RELATIVE)
    assert_relative(result.direction, expected.direction, RELATIVE)
    assert_relative(result.weights, expected.weights, RELATIVE)
    for task in range(NUM_TASKS):
        assert_relative(grads_of(model.head(task)), own[task], RELATIVE)


def test_inferred_parameters_and_accumulation() -> None:
    """Without parameter lists the graph gives the same split; a second call adds to .grad."""
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    expected = mg.harmonizers.UPGrad()(jacobian(losses, model.shared())).direction
    mtl_backward(losses, features, mg.harmonizers.UPGrad(), retain_graph=True)
    first = [parameter.grad.clone() for parameter in model.parameters()]
    assert_relative(grads_of(model.shared()), expected, RELATIVE)
    mtl_backward(losses, features, mg.harmonizers.UPGrad())
    for parameter, before in zip(model.parameters(), first, strict=True):
        assert_relative(parameter.grad, 2 * before, RELATIVE)


@pytest.mark.parametrize("normalize", [False, True])
def test_features_mode_is_mgda_ub(normalize: bool) -> None:
    """Weights from the features' Jacobian; the trunk gets the weighted sum's gradient."""
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    on_features = jacobian(losses, [features])
    expected = mg.harmonizers.MGDA(normalize=normalize)(on_features)
    trunk_mgda = mg.harmonizers.MGDA(normalize=normalize)(jacobian(losses, model.shared()))
    own = [jacobian([loss], model.head(task))[0] for task, loss in enumerate(losses)]

    result = mtl_backward(
        losses,
        features,
        mg.harmonizers.MGDA(normalize=normalize),
        mode="features",
        retain_graph=True,
    )

    assert_relative(result.weights, expected.weights, RELATIVE)
    assert_relative(result.direction, expected.direction, RELATIVE)
    weighted = sum(
        float(weight) * loss for weight, loss in zip(result.weights, losses, strict=True)
    )
    reference = torch.cat([g.reshape(-1) for g in torch.autograd.grad(weighted, model.shared())])
    assert_relative(grads_of(model.shared()), reference, RELATIVE)
    for task in range(NUM_TASKS):
        assert_relative(grads_of(model.head(task)), own[task], RELATIVE)
    # The upper bound is an approximation: on this model its weights are not the trunk's.
    assert float((result.weights - trunk_mgda.weights).abs().max()) > 1e-3


class SharedAfterFeatures(Net):
    """Net plus a scale every head's output is multiplied by, and head 0 reusing the
    trunk's second weight: both are reached by the losses without the features."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.3, dtype=torch.float64))

    def losses(self, features: torch.Tensor, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        tied = torch.tanh(features @ self.trunk[2].weight).mean(dim=1, keepdim=True)
        out = [self.scale * head(features) for head in self.heads]
        out[0] = out[0] + tied
        return [
            nn.functional.mse_loss(out[0].squeeze(1), batch["value"]),
            nn.functional.binary_cross_entropy_with_logits(out[1].squeeze(1), batch["flag"]),
            nn.functional.cross_entropy(out[2], batch["label"]),
        ]


def test_parameters_shared_after_the_features_join_the_trunk() -> None:
    model, batch = SharedAfterFeatures(), make_batch()
    shared = [*model.shared(), model.scale]
    features, losses = forward(model, batch)
    expected = mg.harmonizers.UPGrad()(jacobian(losses, shared)).direction
    own = [jacobian([loss], model.head(task))[0] for task, loss in enumerate(losses)]

    mtl_backward(
        losses, features, mg.harmonizers.UPGrad()
    )  # inferred: scale and the tied weight shared

    assert_relative(grads_of(shared), expected, RELATIVE)
    for task in range(NUM_TASKS):
        assert_relative(grads_of(model.head(task)), own[task], RELATIVE)

    features, losses = forward(model, batch)
    with pytest.raises(ValueError, match="reached by several losses"):
        mtl_backward(
            losses,
            features,
            mg.harmonizers.UPGrad(),
            shared_parameters=model.shared(),
            head_parameters=[[*model.head(0), model.scale], model.head(1), model.head(2)],
        )


def test_several_feature_tensors() -> None:
    """Two outputs of the trunk, neither computed from the other (a cut of the graph)."""
    model, batch = Net(), make_batch()
    hidden = model.trunk[1](model.trunk[0](batch["x"]))
    features, side = model.trunk[3](model.trunk[2](hidden)), hidden.square()
    losses = model.losses(features, batch)
    losses[0] = losses[0] + side.mean()  # task 0 also reads the side output
    expected = mg.harmonizers.UPGrad()(jacobian(losses, model.shared())).direction

    mtl_backward(
        losses, [features, side], mg.harmonizers.UPGrad(), shared_parameters=model.shared()
    )

    assert_relative(grads_of(model.shared()), expected, RELATIVE)

    losses = model.losses(features, batch)
    with pytest.raises(ValueError, match="features 0 are computed from features 1"):
        mtl_backward(losses, [features, hidden], mg.harmonizers.UPGrad())


# --- against TorchJD 0.18 ------------------------------------------------------------


def torchjd_pair(name: str) -> tuple[mg.Harmonizer, object]:
    """Ours and TorchJD's aggregator of the same definition.

    TorchJD's UPGrad projector divides the Gram by its trace (no effect on the solution)
    and adds reg_eps = 1e-4 to its diagonal (a different problem): compared exactly with
    reg_eps = 0, and with the default against our UPGrad(reg_eps=1e-4), which solves that
    same regularized problem. TorchJD's MGDA is Frank-Wolfe, which converges slowly when
    the min-norm point lies on a face of the simplex (here: one weight is 0); with its
    defaults (a step below 1e-3, 100 iterations) its direction is 2% off on this model,
    so it runs to a step below 1e-9 or 10^4 iterations, and its tolerance comes from its
    own duality gap.
    """
    aggregation = pytest.importorskip("torchjd.aggregation")
    linalg = pytest.importorskip("torchjd._linalg")
    exact = linalg.QuadprogProjector(norm_eps=0.0, reg_eps=0.0)
    return {
        "UPGrad exact": (mg.harmonizers.UPGrad(), aggregation.UPGrad(projector=exact)),
        "UPGrad default": (mg.harmonizers.UPGrad(reg_eps=1e-4), aggregation.UPGrad()),
        "MGDA": (
            mg.harmonizers.MGDA(normalize=False),
            aggregation.MGDA(epsilon=1e-9, max_iters=10_000),
        ),
    }[name]


@pytest.mark.parametrize("name", ["UPGrad exact", "UPGrad default", "MGDA"])
def test_matches_torchjd_mtl_backward(name: str) -> None:
    """Same model (float64, so TorchJD also computes in float64), same batch.

    Tolerance: UPGrad's K x K QPs are solved exactly by both (our active-set solver,
    quadprog) and differ by rounding amplified by the Gram's condition number kappa, so
    the directions agree within 100 * kappa * eps * ||d||. For MGDA the bound is
    TorchJD's: for weights alpha on the simplex, with gap = a'Ga - min_t (Ga)_t, the
    min-norm point d* satisfies ||d - d*||^2 <= f(alpha) - f* <= 2 gap (convexity of
    f = a'Ga, and d* . (d - d*) >= 0 on the hull), so ||d - d*|| <= sqrt(2 gap).
    Heads are the same computation in both: RELATIVE.
    """
    autojac = pytest.importorskip("torchjd.autojac")
    ours, theirs = torchjd_pair(name)
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    gram = (lambda j: j @ j.T)(jacobian(losses, model.shared()))
    result = mtl_backward(losses, features, ours, shared_parameters=model.shared())
    our_trunk = grads_of(model.shared())
    our_heads = [grads_of(model.head(task)) for task in range(NUM_TASKS)]

    model.zero_grad(set_to_none=True)
    features, losses = forward(model, batch)
    heads = [model.head(task) for task in range(NUM_TASKS)]
    autojac.mtl_backward(
        losses, features=features, shared_params=model.shared(), tasks_params=heads
    )
    weights = autojac.jac_to_grad(model.shared(), theirs).to(torch.float64)

    scale = float(our_trunk.norm())
    if name == "MGDA":
        products = gram @ weights
        gap = float(weights @ products - products.min())
        tolerance = (2 * max(gap, 0.0)) ** 0.5 + 1e3 * torch.finfo(torch.float64).eps * scale
        assert tolerance < 0.02 * scale  # the bound is informative, not vacuous
    else:
        eigenvalues = torch.linalg.eigvalsh(gram)
        kappa = float(eigenvalues[-1] / eigenvalues[0])
        tolerance = 100 * kappa * torch.finfo(torch.float64).eps * scale
        assert_relative(weights, result.weights, tolerance / scale)
    error = float((grads_of(model.shared()) - our_trunk).norm())
    assert error <= tolerance, f"trunk differs by {error:.3e} > {tolerance:.3e}"
    for task in range(NUM_TASKS):
        assert_relative(grads_of(model.head(task)), our_heads[task], RELATIVE)


# --- errors -----------------------------------------------------------------------------


def test_errors_are_clear_and_write_nothing() -> None:
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    cases = [
        (([*losses[:2], torch.stack(losses)], features), ValueError, "loss 2 has shape \\(3,\\)"),
        (([], features), ValueError, "no losses"),
        ((losses, features.detach()), ValueError, "features 0 do not require grad"),
        (
            ([*losses, model.heads[0].weight.square().sum()], features),
            ValueError,
            "loss 3 does not depend on the features",
        ),
        (([torch.tensor(1.0)], features), ValueError, "loss 0 does not require grad"),
    ]
    for (bad_losses, bad_features), error, message in cases:
        with pytest.raises(error, match=message):
            mtl_backward(bad_losses, bad_features, mg.harmonizers.UPGrad())
    options = [
        ({"mode": "representation"}, "unknown mode"),
        ({"method": "parallel"}, "unknown gradient method"),
        ({"chunk_size": 0}, "chunk_size must be >= 1"),
        ({"head_parameters": [model.head(0), model.head(1)]}, "2 heads but 3 losses"),
        (
            {"head_parameters": [model.head(0), model.head(0), model.head(2)]},
            "parameter 0 of head 1 .* is also in head 0",
        ),
        (
            {
                "shared_parameters": model.shared(),
                "head_parameters": [model.head(0), model.head(1), model.shared()],
            },
            "is also in the shared parameters",
        ),
        (
            {"head_parameters": [model.head(1), model.head(0), model.head(2)]},
            "not reached by loss 0 outside the features",
        ),
    ]
    for keywords, message in options:
        with pytest.raises(ValueError, match=message):
            mtl_backward(losses, features, mg.harmonizers.UPGrad(), **keywords)
    stray = nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(UnusedParameterError, match=r"shared parameter 4 .* not in the graph"):
        mtl_backward(
            losses, features, mg.harmonizers.UPGrad(), shared_parameters=[*model.shared(), stray]
        )
    with pytest.raises(TypeError, match="must be a mogradient Harmonizer"):
        mtl_backward(losses, features, lambda jacobian: jacobian.mean(0))
    assert all(parameter.grad is None for parameter in model.parameters())


@pytest.mark.parametrize(
    "harmonizer", [mg.harmonizers.TrimmedMean(), mg.harmonizers.GradDrop(seed=0)]
)
def test_features_mode_refuses_coordinatewise_methods(harmonizer) -> None:
    """Their weights are stand-ins that do not give their direction, and features mode
    applies weights to the trunk; nothing is written."""
    model, batch = Net(), make_batch()
    features, losses = forward(model, batch)
    with pytest.raises(ValueError, match="mode='trunk'"):
        mtl_backward(losses, features, harmonizer, mode="features")
    assert all(parameter.grad is None for parameter in model.parameters())
