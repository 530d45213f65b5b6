"""Ours vs TorchJD's and LibMTL's loss-based methods (scalarizations) on identical losses.

One fixed sequence of loss vectors, the same for every implementation, fed as
L_k = <g_k, p> + l_k with known rows g_k, so the gradient of the scalarized loss in p gives
its effective task weights w (J^T w = grad_p). Rendered by ``compare.comparison_markdown``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

import mogradient as mg
from benchmarks.common import default_dtype, markdown_table
from benchmarks.mtl.compare_tools import implied_weights, libmtl_weighting
from benchmarks.mtl.methods import STCH_MU, libmtl_installed

LOSS_TASKS = 3
LOSS_STEPS = 8
STEPS_PER_EPOCH = 2  # DWA's epochs: four of two steps
LOG_SCALES = (-0.5, 0.25, 1.0)  # UW's log-variances, IMTL-L's and IMTL's log-scales, held fixed
STCH_PREFERENCES = (0.5, 0.3, 0.2)
PBI_THETA = 5.0
PBI_PREFERENCES = (1.0, 2.0, 2.0)
COSMOS_LAMBDA = 2.0
COSMOS_SEED = 0
GRADNORM_ALPHA = 1.5  # ours' and LibMTL's default
GRADNORM_LR = 0.025  # ours' default rate for the weights


def loss_sequence(seed: int = 0) -> np.ndarray:
    """LOSS_STEPS + 1 loss vectors of a synthetic descent, the last one FAMO's losses after
    the last step: tasks of scale 0.05, 1 and 20, each decaying at its own rate towards a
    floor, times 1 + 5% seeded noise."""
    rng = np.random.default_rng(seed)
    steps = np.arange(LOSS_STEPS + 1)[:, None]
    scales, rates, floors = np.array([0.05, 1.0, 20.0]), np.array([0.4, 0.15, 0.3]), 0.3
    descent = scales * (floors + (1 - floors) * np.exp(-rates * steps))
    return descent * (1 + 0.05 * rng.standard_normal(descent.shape))


def task_gradients(seed: int = 0) -> torch.Tensor:
    """The known task gradients g_k (K x 6, float64): seeded directions, norms 0.5, 2 and 8."""
    generator = torch.Generator().manual_seed(seed)
    rows = torch.randn(LOSS_TASKS, 6, generator=generator, dtype=torch.float64)
    norms = torch.tensor([[0.5], [2.0], [8.0]], dtype=torch.float64)
    return rows / rows.norm(dim=1, keepdim=True) * norms


@dataclass
class LossDriver:
    """One implementation over the loss sequence: ``backward`` fills the parameter's gradient
    from the scalarized loss; ``after_step`` gets the losses after the step (FAMO learns
    from them); ``end_epoch`` closes an epoch (DWA averages over epochs)."""

    backward: Callable[[torch.Tensor], None]
    after_step: Callable[[torch.Tensor], None] = field(default=lambda losses: None)
    end_epoch: Callable[[], None] = field(default=lambda: None)


DriverFactory = Callable[[torch.Tensor], LossDriver]  # the shared parameter -> a driver


def _fixed_log_scales(module: torch.nn.Module, attribute: str) -> torch.nn.Module:
    """Set a learned scale vector (UW, IMTL-L, IMTL) to LOG_SCALES; nothing steps it."""
    parameter = module.get_parameter(attribute)
    with torch.no_grad():
        parameter.copy_(torch.tensor(LOG_SCALES))
    return module


def ours_loss(build: Callable[[torch.Tensor], mg.Scalarization]) -> DriverFactory:
    def driver(parameter: torch.Tensor) -> LossDriver:
        method = build(parameter).double()
        return LossDriver(
            lambda losses: method(losses).loss.backward(),
            method.update if method.needs_losses_after_step else lambda losses: None,
            method.end_epoch,
        )

    return driver


def ours_cosmos(parameter: torch.Tensor) -> LossDriver:
    """COSMOS with a preference drawn (seeded) before every step."""
    method = mg.scalarizations.COSMOS(LOSS_TASKS, COSMOS_LAMBDA, seed=COSMOS_SEED)

    def backward(losses: torch.Tensor) -> None:
        method.next_preference()
        method(losses).loss.backward()

    return LossDriver(backward)


def torchjd_scalarizer(name: str, *args, **options) -> torch.nn.Module:
    import torchjd.scalarization as scalarization

    return getattr(scalarization, name)(*args, **options).double()


def torchjd_loss(
    build: Callable[[], torch.nn.Module],
    after_step: str | None = None,
    end_epoch: str | None = None,
) -> DriverFactory:
    """A TorchJD scalarizer; ``after_step`` / ``end_epoch`` name its methods for those events."""

    def driver(parameter: torch.Tensor) -> LossDriver:
        scalarizer = build()
        return LossDriver(
            lambda losses: scalarizer(losses).backward(),
            getattr(scalarizer, after_step) if after_step else lambda losses: None,
            getattr(scalarizer, end_epoch) if end_epoch else lambda: None,
        )

    return driver


def torchjd_cosmos(parameter: torch.Tensor) -> LossDriver:
    """TorchJD's COSMOS given, each step, the preference our seeded COSMOS draws."""
    draws = mg.scalarizations.COSMOS(LOSS_TASKS, COSMOS_LAMBDA, seed=COSMOS_SEED)

    def backward(losses: torch.Tensor) -> None:
        preference = draws.next_preference().to(losses.dtype)
        torchjd_scalarizer("COSMOS", COSMOS_LAMBDA, weights=preference)(losses).backward()

    return LossDriver(backward)


def libmtl_loss(name: str, fixed_scales: bool = False, **options) -> DriverFactory:
    """LibMTL's weighting in float64 with the bookkeeping its trainer does for it: ``epoch``
    (epochs completed) and ``train_loss_buffer`` (each epoch's mean losses, which DWA reads)."""

    def driver(parameter: torch.Tensor) -> LossDriver:
        with default_dtype(torch.float64):
            weighting = libmtl_weighting(name, parameter, LOSS_TASKS)
        if fixed_scales:
            _fixed_log_scales(weighting, "loss_scale")
        weighting.epoch = 0
        weighting.train_loss_buffer = np.zeros((LOSS_TASKS, LOSS_STEPS))
        this_epoch: list[np.ndarray] = []

        def backward(losses: torch.Tensor) -> None:
            this_epoch.append(losses.detach().numpy().copy())
            with default_dtype(torch.float64):
                weighting.backward(losses, **options)

        def end_epoch() -> None:
            weighting.train_loss_buffer[:, weighting.epoch] = np.mean(this_epoch, axis=0)
            weighting.epoch += 1
            this_epoch.clear()

        return LossDriver(backward, end_epoch=end_epoch)

    return driver


def libmtl_gradnorm(parameter: torch.Tensor) -> LossDriver:
    """LibMTL's GradNorm, adapting from the first step with L(0) = the first step's losses, as
    ours. (Its trainer returns ones for all of epoch 0 and takes that epoch's mean as L(0).)
    Its weights are K softmax(s); s is stepped by SGD at ours' rate for the weights."""
    with default_dtype(torch.float64):
        weighting = libmtl_weighting("GradNorm", parameter, LOSS_TASKS)
    weighting.epoch = 1
    optimizer = torch.optim.SGD([weighting.loss_scale], lr=GRADNORM_LR)

    def backward(losses: torch.Tensor) -> None:
        if not hasattr(weighting, "train_loss_buffer"):
            weighting.train_loss_buffer = losses.detach().numpy()[:, None].copy()
        optimizer.zero_grad()
        with default_dtype(torch.float64):
            weighting.backward(losses, alpha=GRADNORM_ALPHA)
        optimizer.step()

    return LossDriver(backward)


def _stch(parameter: torch.Tensor) -> mg.Scalarization:
    return mg.scalarizations.STCH(
        mu=STCH_MU, preferences=STCH_PREFERENCES, reference=[0.0] * LOSS_TASKS
    )


def _pbi(parameter: torch.Tensor) -> mg.Scalarization:
    return mg.scalarizations.PBI(
        theta=PBI_THETA, preferences=PBI_PREFERENCES, reference=[0.0] * LOSS_TASKS
    )


def _vector(values: tuple[float, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


# (method, ours, [(implementation, its driver)])
LOSS_PAIRS: list[tuple[str, DriverFactory, list[tuple[str, DriverFactory]]]] = [
    ("UW (log-variances fixed at -0.5, 0.25, 1)",
     ours_loss(lambda p: _fixed_log_scales(mg.scalarizations.UW(LOSS_TASKS), "log_variances")), [
        ("TorchJD UW", torchjd_loss(
            lambda: _fixed_log_scales(torchjd_scalarizer("UW", LOSS_TASKS), "log_var"))),
        ("LibMTL UW", libmtl_loss("UW", fixed_scales=True)),
    ]),
    ("DWA T=2 (four epochs of two steps)", ours_loss(lambda p: mg.scalarizations.DWA(LOSS_TASKS)), [
        ("TorchJD DWA (step() after each epoch)",
         torchjd_loss(lambda: torchjd_scalarizer("DWA", 2.0), end_epoch="step")),
        ("LibMTL DWA (epoch means in train_loss_buffer)", libmtl_loss("DWA", T=2.0)),
    ]),
    ("GLS (geometric mean)", ours_loss(lambda p: mg.scalarizations.GLS()), [
        ("TorchJD GeometricMean", torchjd_loss(lambda: torchjd_scalarizer("GeometricMean"))),
        ("LibMTL GLS", libmtl_loss("GLS")),
    ]),
    ("IMTL-L (log-scales fixed at -0.5, 0.25, 1)",
     ours_loss(lambda p: _fixed_log_scales(mg.scalarizations.IMTLL(LOSS_TASKS), "log_scales")), [
        ("TorchJD IMTLL", torchjd_loss(
            lambda: _fixed_log_scales(torchjd_scalarizer("IMTLL", LOSS_TASKS), "log_scale"))),
    ]),
    ("STCH mu=1, preferences (0.5, 0.3, 0.2)", ours_loss(_stch), [
        ("TorchJD STCH", torchjd_loss(lambda: torchjd_scalarizer(
            "STCH", STCH_MU, weights=_vector(STCH_PREFERENCES),
            reference=torch.zeros(LOSS_TASKS, dtype=torch.float64)))),
    ]),
    ("PBI theta=5, preferences (1, 2, 2)", ours_loss(_pbi), [
        ("TorchJD PBI (off-ray distance smoothed: sqrt(d^2 + 1e-12))",
         torchjd_loss(lambda: torchjd_scalarizer(
             "PBI", PBI_THETA, weights=_vector(PBI_PREFERENCES),
             reference=torch.zeros(LOSS_TASKS, dtype=torch.float64)))),
    ]),
    ("FAMO (lr 0.025, weight decay 1e-3), updated after each step",
     ours_loss(lambda p: mg.scalarizations.FAMO(LOSS_TASKS)), [
        ("TorchJD FAMO (update() after each step)",
         torchjd_loss(lambda: torchjd_scalarizer("FAMO", LOSS_TASKS), after_step="update")),
    ]),
    ("COSMOS lambda=2, seeded preference draws", ours_cosmos, [
        ("TorchJD COSMOS (given our draws)", torchjd_cosmos),
    ]),
    ("GradNorm alpha=1.5 (weights stepped at rate 0.025)",
     ours_loss(lambda p: mg.scalarizations.GradNorm(
         LOSS_TASKS, [p], alpha=GRADNORM_ALPHA, lr=GRADNORM_LR)), [
        ("LibMTL GradNorm (weights K softmax(s), s stepped by SGD, L(0) = first losses)",
         libmtl_gradnorm),
    ]),
    ("IMTL (log-scales fixed at -0.5, 0.25, 1)",
     ours_loss(lambda p: _fixed_log_scales(
         mg.scalarizations.IMTL(LOSS_TASKS, [p]), "loss_scales.log_scales")), [
        ("LibMTL IMTL (log-scales fixed alike)", libmtl_loss("IMTL", fixed_scales=True)),
    ]),
]  # fmt: skip


def effective_weights(
    make_driver: DriverFactory, gradients: torch.Tensor, sequence: np.ndarray
) -> np.ndarray:
    """Per step, the w with J^T w = the scalarized loss's gradient in p, for L = J p + l_t."""
    parameter = torch.zeros(gradients.shape[1], dtype=torch.float64, requires_grad=True)
    driver = make_driver(parameter)
    weights = []
    for step in range(LOSS_STEPS):
        parameter.grad = torch.zeros_like(parameter)
        driver.backward(gradients @ parameter + torch.from_numpy(sequence[step]))
        weights.append(implied_weights(gradients, parameter.grad).numpy())
        driver.after_step(torch.from_numpy(sequence[step + 1]))
        if (step + 1) % STEPS_PER_EPOCH == 0:
            driver.end_epoch()
    return np.stack(weights)


def compare_losses(seed: int = 0) -> list[dict]:
    """One row per (loss-based method, implementation): effective weights over the sequence."""
    sequence, gradients = loss_sequence(seed), task_gradients(seed)
    rows = []
    for method, make_ours, others in LOSS_PAIRS:
        reference = effective_weights(make_ours, gradients, sequence)
        for implementation, make_theirs in others:
            if implementation.startswith("LibMTL") and not libmtl_installed():
                continue
            row = {"method": method, "implementation": implementation, "error": None}
            try:
                theirs = effective_weights(make_theirs, gradients, sequence)
            except Exception as error:  # a library failing is a finding
                rows.append({**row, "error": f"{type(error).__name__}: {error}"[:160]})
                continue
            gap = np.abs(theirs - reference) / np.maximum(np.abs(reference), 1e-300)
            norm_gap = np.linalg.norm(theirs - reference, axis=1) / np.linalg.norm(
                reference, axis=1
            )
            rows.append({**row, "first_step": float(gap[0].max()), "worst": float(gap.max()),
                         "worst_step": int(gap.max(axis=1).argmax()) + 1,
                         "norm_gap": float(norm_gap.max()),
                         "last_weights": reference[-1].tolist()})  # fmt: skip
    return rows


def loss_table(rows: list[dict]) -> str:
    header = ["method", "other implementation", "step 1: max_k |Δw_k| / |w_k|",
              "all steps: max_t max_k |Δw_k| / |w_k| (at t)", "max_t ‖Δw_t‖ / ‖w_t‖",
              "ours: w at the last step"]  # fmt: skip
    table = []
    for row in rows:
        if row["error"] is not None:
            values = [f"raised {row['error']}", "–", "–", "–"]
        else:
            weights = ", ".join(f"{w:.4g}" for w in row["last_weights"])
            values = [f"{row['first_step']:.2e}", f"{row['worst']:.2e} (t = {row['worst_step']})",
                      f"{row['norm_gap']:.2e}", weights]  # fmt: skip
        table.append([row["method"], row["implementation"], *values])
    return markdown_table(header, table)


LOSS_NOTES = """\
Known differences above float round-off:

- GradNorm: ours steps the weights as the paper does (a gradient step on
  sum_k |G_k - target_k| in w, clipped at 0, renormalized to sum K); LibMTL's weights are
  K softmax(s) with s stepped by the optimizer. Both start at ones: only step 1 agrees.
- PBI: TorchJD takes the off-ray distance as sqrt(d^2 + 1e-12), which moves the gradient by
  at most theta 1e-12 / (2 d^2), below round-off here (tests/scalarizations/,
  test_same_as_torchjd_pbi_up_to_its_smoothing_constant).
"""


def loss_markdown(rows: list[dict]) -> str:
    """comparison.md's section on the loss-based methods."""
    return (
        "## Loss-based methods: effective task weights on identical loss sequences\n\n"
        f"{LOSS_STEPS} steps of a seeded synthetic descent of {LOSS_TASKS} losses of scales "
        "0.05, 1 and 20 (`loss_sequence`), each fed as L_k = <g_k, p> + l_k with known "
        "float64 rows g_k, so J^T w = grad_p gives the scalarized loss's gradient in the "
        "losses, w, the effective task weights. Every implementation is driven alike, "
        "LibMTL's in float64: the learned scales of UW, IMTL-L and IMTL held at one fixed "
        f"value, DWA's epochs closed after every {STEPS_PER_EPOCH} steps, FAMO updated with "
        "the next step's losses, GradNorm's weights stepped by each one's rule. Columns: the "
        "largest relative weight difference at step 1 and over all steps, the largest "
        "norm-wise difference, and ours' weights at the last step.\n\n"
        + LOSS_NOTES
        + "\n"
        + loss_table(rows)
        + "\n"
    )
