"""Ours vs TorchJD's and LibMTL's implementation of the same method, on identical inputs.

    python -m benchmarks.mtl.compare     # prints comparison.md's two tables

Gradient methods: TorchJD's regression matrix, and the trunk gradients of each problem
on the first batch with conflicting tasks from initialization and after 200 steps of
equal weighting (plus that stack x 1e-3, to expose absolute thresholds). LibMTL's
weightings compute gradients themselves, so they get losses L_k = <g_k, p> whose gradient
in p is exactly row k. For every pair we report cos(d_ours, d_lib), ||d_ours - d_lib|| /
||d_ours||, and a check of the method's defining property for both directions. Stateful
methods start from the same state; their first update is compared.

Loss-based methods (scalarizations) are compared by ``compare_losses``; this module's
``comparison_markdown`` renders both.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable, Collection

import numpy as np
import torch

import mogradient as mg
from benchmarks.common import default_dtype, markdown_table
from benchmarks.mtl import compare_losses
from benchmarks.mtl.compare_tools import implied_weights, libmtl_weighting
from benchmarks.mtl.data import PROBLEMS
from benchmarks.mtl.methods import (
    CAGRAD_C,
    FAIRGRAD_ALPHA,
    GRADVAC_BETA,
    libmtl_installed,
    libmtl_weighting_module,
)
from benchmarks.mtl.model import MultiTaskNet, batch_losses
from benchmarks.mtl.train import seed_everything

STACK_SIZES = (1024, 8, 8)
TRAINED_STEPS = 200
BATCH = 256
MAX_SEARCH = 300


def trunk_stack(problem_name: str, steps: int, seed: int) -> torch.Tensor:
    """The first trunk gradient stack with two conflicting tasks after ``steps`` EW steps.

    Without a conflict most methods return the mean and every implementation agrees.
    """
    problem = PROBLEMS[problem_name](STACK_SIZES)
    seed_everything(seed)
    model = MultiTaskNet(problem.tasks)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    generator = torch.Generator().manual_seed(seed)
    for step in range(steps + MAX_SEARCH):
        rows = torch.randint(len(problem.train.images), (BATCH,), generator=generator)
        optimizer.zero_grad()
        _, losses = batch_losses(model, problem.train, rows)
        if step >= steps:
            jacobian = mg.engines.objective_gradients(
                losses, model.shared_parameters(), retain_graph=True
            )
            if _worst_pairwise_cosine(jacobian) < 0:
                return jacobian
        torch.stack(losses).mean().backward()
        optimizer.step()
    raise RuntimeError(f"no conflicting batch within {MAX_SEARCH} steps after step {steps}")


def _worst_pairwise_cosine(jacobian: torch.Tensor) -> float:
    units = torch.nn.functional.normalize(jacobian.double(), dim=1)
    cosines = units @ units.T
    return float(cosines[~torch.eye(len(units), dtype=torch.bool)].min())


Direction = Callable[[torch.Tensor], torch.Tensor]


def libmtl_direction(name: str, jacobian: torch.Tensor, **options) -> torch.Tensor:
    """LibMTL's own ``backward`` on losses whose gradients are exactly the rows of ``jacobian``."""
    parameter = torch.zeros(jacobian.shape[1], requires_grad=True)
    losses = jacobian.detach().float() @ parameter
    weighting = libmtl_weighting(name, parameter, len(jacobian))
    weighting.backward(losses, **options)
    return parameter.grad.detach().clone()


GRADDROP_SEED = 0


def libmtl_graddrop(jacobian: torch.Tensor) -> torch.Tensor:
    """LibMTL's GradDrop, which only works on a representation's gradients.

    The representation is a (1, D) row of ones and task k's loss is <g_k, rep>, so its
    per-task gradients are the rows (the ones' signs change nothing). In float64 its
    draws are torch.rand's float64 draws after ``manual_seed(GRADDROP_SEED)``: ours.
    """
    count, width = jacobian.shape
    rows = jacobian.detach().double()
    with default_dtype(torch.float64):
        weighting = libmtl_weighting_module().GradDrop()
        weighting.task_num = count
        weighting.task_name = list(range(count))
        weighting.device = torch.device("cpu")
        weighting.rep_grad = True
        weighting.rep = torch.ones(1, width, requires_grad=True)
        weighting.rep_tasks = [torch.ones(1, width, requires_grad=True) for _ in range(count)]
        losses = [(weighting.rep_tasks[k][0] * rows[k]).sum() for k in range(count)]
        torch.manual_seed(GRADDROP_SEED)
        weighting.backward(losses, leak=0.0)
    return weighting.rep.grad[0].float()


def torchjd(name: str, **options) -> Direction:
    """One instance of TorchJD's aggregator ``name`` (a stateful one keeps its state)."""
    import torchjd.aggregation as aggregation

    return getattr(aggregation, name)(**options)


def torchjd_weighting(name: str, **options) -> Direction:
    """TorchJD's Gram weighting ``name`` on the stack (MoDo and SDMGrad have no aggregator)."""
    import torchjd.aggregation as aggregation

    return aggregation.GramianWeightedAggregator(getattr(aggregation, name)(**options))


CR_MOGM_ALPHA = 0.9


def ours_cr_mogm() -> Direction:
    """From uniform weights: the first step then shows the average, not the inner MGDA alone."""

    def direction(jacobian: torch.Tensor) -> torch.Tensor:
        uniform = [1.0 / len(jacobian)] * len(jacobian)
        return mg.harmonizers.CRMOGM(alpha=CR_MOGM_ALPHA, initial_weights=uniform)(
            jacobian
        ).direction

    return direction


def torchjd_cr_mogm(**mgda_options) -> Direction:
    """TorchJD's CR-MOGM average of its MGDA weighting, from uniform weights as ours."""
    import torchjd.aggregation as aggregation

    def direction(jacobian: torch.Tensor) -> torch.Tensor:
        uniform = torch.full((len(jacobian),), 1.0 / len(jacobian))
        weighting = aggregation.CRMOGMWeighting(
            aggregation.MGDAWeighting(**mgda_options), alpha=CR_MOGM_ALPHA, initial_weights=uniform
        )
        return aggregation.GramianWeightedAggregator(weighting)(jacobian)

    return direction


def exact_projector():
    """TorchJD's own dual-cone projector with its two thresholds switched off."""
    from torchjd._linalg._dual_cone import QuadprogProjector

    return QuadprogProjector(norm_eps=0.0, reg_eps=0.0)


def ours(harmonizer: mg.Harmonizer) -> Direction:
    return lambda jacobian: harmonizer(jacobian).direction


def libmtl(name: str, **options) -> Direction:
    return lambda jacobian: libmtl_direction(name, jacobian, **options)


def after_warmup(direction: Direction) -> Direction:
    """Two calls of one stateful instance, returning the second direction: a warm-up call on
    J with row k scaled by k + 1 (so the objectives' excess estimates move apart), then J."""

    def second(jacobian: torch.Tensor) -> torch.Tensor:
        scales = torch.arange(1, len(jacobian) + 1, dtype=jacobian.dtype)[:, None]
        direction(jacobian * scales)
        return direction(jacobian)

    return second


def rescaled_float64(direction: Direction, factor: Callable[[torch.Tensor], float]) -> Direction:
    """``direction`` on the float64 stack times c = factor(row norms), divided back by c.

    A scale-invariant method gives the same weights at any c; at a c where TorchJD's
    absolute guards are negligible, this is TorchJD without them.
    """

    def rescaled(jacobian: torch.Tensor) -> torch.Tensor:
        wide = jacobian.double()
        scale = factor(wide.norm(dim=1))
        return (direction(wide * scale) / scale).float()

    return rescaled


def seeded_float64(direction: Direction) -> Direction:
    """TorchJD's GradDrop draws U from the global generator in the stack's dtype: seeded so,
    on the float64 stack, it draws our float64 U (ours rounds its sum to float32 once)."""

    def seeded(jacobian: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(GRADDROP_SEED)
        return direction(jacobian.double()).float()

    return seeded


def _excess_scale(norms: torch.Tensor) -> float:
    """Entries then dwarf the 1e-7 under TorchJD's root (ours is invariant to each row's scale)."""
    return 1e6 / float(norms.min())


def _mean_norm_one(norms: torch.Tensor) -> float:
    """(mean norm)^2 = 1 then dwarfs TorchJD's 1e-8 (ours is invariant to the stack's scale)."""
    return 1.0 / float(norms.mean())


Tasks = Collection[int] | None  # the K an implementation runs at; None: any
EVERY_K_FROM_3 = range(3, 1 << 16)

# (method, ours, [(implementation, its direction, the K it runs at)])
PAIRS: list[tuple[str, Callable[[], Direction], list[tuple[str, Callable[[], Direction], Tasks]]]]
PAIRS = [
    ("MGDA (plain)", lambda: ours(mg.harmonizers.MGDA(normalize=False)), [
        ("TorchJD MGDA (defaults: epsilon 1e-3, 100 iters)", lambda: torchjd("MGDA"), None),
        ("TorchJD MGDA (epsilon 1e-12, 1e5 iters)",
         lambda: torchjd("MGDA", epsilon=1e-12, max_iters=100_000), None),
        ("LibMTL MGDA (mgda_gn='none')", lambda: libmtl("MGDA", mgda_gn="none"), None),
    ]),
    ("MGDA-NR (unit gradients, rescaled)", lambda: ours(mg.harmonizers.MGDA()), [
        ("LibMTL MGDA (mgda_gn='l2'), x mean norm",
         lambda: _rescaled(libmtl("MGDA", mgda_gn="l2")), None),
    ]),
    ("UPGrad", lambda: ours(mg.harmonizers.UPGrad()), [
        ("TorchJD UPGrad (defaults: norm_eps 1e-4, reg_eps 1e-4)", lambda: torchjd("UPGrad"), None),
        ("TorchJD UPGrad (norm_eps 0, reg_eps 0)",
         lambda: torchjd("UPGrad", projector=exact_projector()), None),
    ]),
    ("DualProj", lambda: ours(mg.harmonizers.DualProj()), [
        ("TorchJD DualProj (defaults)", lambda: torchjd("DualProj"), None),
        ("TorchJD DualProj (norm_eps 0, reg_eps 0)",
         lambda: torchjd("DualProj", projector=exact_projector()), None),
    ]),
    ("PCGrad (K = 2: order-free)", lambda: ours(mg.harmonizers.PCGrad(seed=0)), [
        ("TorchJD PCGrad", lambda: torchjd("PCGrad"), {2}),
        ("LibMTL PCGrad", lambda: libmtl("PCGrad"), {2}),
    ]),
    ("IMTL-G", lambda: ours(mg.harmonizers.IMTLG()), [
        ("TorchJD IMTLG", lambda: torchjd("IMTLG"), None),
        ("TorchJD IMTLG on the float64 stack", lambda: _in_float64(torchjd("IMTLG")), None),
        ("LibMTL IMTL (loss scales frozen at 0)", lambda: libmtl("IMTL"), None),
    ]),
    ("CAGrad c=0.5", lambda: ours(mg.harmonizers.CAGrad(c=CAGRAD_C)), [
        ("TorchJD CAGrad (norm_eps 1e-4)", lambda: torchjd("CAGrad", c=CAGRAD_C), None),
    ]),
    ("CAGrad c=0.5, rescaled by 1/(1+c^2)",
     lambda: ours(mg.harmonizers.CAGrad(c=CAGRAD_C, rescale=True)), [
        ("LibMTL CAGrad (rescale=1)", lambda: libmtl("CAGrad", calpha=CAGRAD_C, rescale=1), {3}),
    ]),
    ("Nash-MTL", lambda: ours(mg.harmonizers.NashMTL()), [
        ("TorchJD NashMTL (optim_niter 20)", lambda: _nash(20), None),
        ("TorchJD NashMTL (optim_niter 500)", lambda: _nash(500), None),
    ]),
    ("Aligned-MTL", lambda: ours(mg.harmonizers.AlignedMTL()), [
        ("TorchJD AlignedMTL", lambda: torchjd("AlignedMTL"), None),
        ("TorchJD AlignedMTL on the float64 stack", lambda: _in_float64(torchjd("AlignedMTL")),
         None),
    ]),
    ("GradVac, first step (K = 2)",
     lambda: ours(mg.harmonizers.GradVac(beta=GRADVAC_BETA, seed=0)), [
        ("TorchJD GradVac", lambda: torchjd("GradVac", beta=GRADVAC_BETA), {2}),
        ("LibMTL GradVac", lambda: libmtl("GradVac", beta=GRADVAC_BETA), {2}),
    ]),
    ("ConFIG", lambda: ours(mg.harmonizers.ConFIG()), [
        ("TorchJD ConFIG", lambda: torchjd("ConFIG"), None),
        ("TorchJD ConFIG on the float64 stack", lambda: _in_float64(torchjd("ConFIG")), None),
    ]),
    ("FairGrad alpha=1", lambda: ours(mg.harmonizers.FairGrad(alpha=FAIRGRAD_ALPHA)), [
        ("TorchJD FairGrad (SciPy least squares, xtol 1e-8)",
         lambda: torchjd("FairGrad", alpha=FAIRGRAD_ALPHA), None),
        ("TorchJD FairGrad on the float64 stack",
         lambda: _in_float64(torchjd("FairGrad", alpha=FAIRGRAD_ALPHA)), None),
    ]),
    ("ExcessMTL (warm-up 1), first update",
     lambda: after_warmup(ours(mg.harmonizers.ExcessMTL())), [
        ("TorchJD ExcessMTL (defaults: n_warmup_steps 0, guard 1e-7)",
         lambda: after_warmup(torchjd("ExcessMTL")), None),
        ("TorchJD ExcessMTL (n_warmup_steps 1, guard 1e-7)",
         lambda: after_warmup(torchjd("ExcessMTL", n_warmup_steps=1)), None),
        ("TorchJD ExcessMTL (n_warmup_steps 1) on the float64 stack x 1e6 / min ‖g_k‖",
         lambda: rescaled_float64(after_warmup(torchjd("ExcessMTL", n_warmup_steps=1)),
                                  _excess_scale), None),
    ]),
    ("Krum f=0 (squared distances, the paper's)", lambda: ours(mg.harmonizers.Krum()), [
        ("TorchJD Krum (n_byzantine 0: plain distances)", lambda: torchjd("Krum", n_byzantine=0),
         EVERY_K_FROM_3),
    ]),
    ("Krum f=0, plain distances", lambda: ours(mg.harmonizers.Krum(squared=False)), [
        ("TorchJD Krum (n_byzantine 0)", lambda: torchjd("Krum", n_byzantine=0), EVERY_K_FROM_3),
    ]),
    ("TrimmedMean (trim 1)", lambda: ours(mg.harmonizers.TrimmedMean(1)), [
        ("TorchJD TrimmedMean (trim_number 1)", lambda: torchjd("TrimmedMean", trim_number=1),
         EVERY_K_FROM_3),
    ]),
    ("GradDrop (seeded: same draws)", lambda: ours(mg.harmonizers.GradDrop(seed=GRADDROP_SEED)), [
        ("TorchJD GradDrop on the float64 stack", lambda: seeded_float64(torchjd("GradDrop")),
         None),
        ("LibMTL GradDrop (leak 0), float64 representation", lambda: libmtl_graddrop, None),
    ]),
    ("PCD tau=0.02, first step", lambda: ours(mg.harmonizers.PCD()), [
        ("TorchJD PCD (defaults: tau 0.02, beta 0.999, eps 1e-8)", lambda: torchjd("PCD"), None),
        ("TorchJD PCD on the float64 stack", lambda: _in_float64(torchjd("PCD")), None),
    ]),
    ("CR-MOGM alpha=0.9 over MGDA, first step from uniform weights", ours_cr_mogm, [
        ("TorchJD CRMOGMWeighting(MGDAWeighting()) (epsilon 1e-3, 100 iters)",
         lambda: torchjd_cr_mogm(), None),
        ("TorchJD CRMOGMWeighting(MGDAWeighting(epsilon 1e-12, 1e5 iters))",
         lambda: torchjd_cr_mogm(epsilon=1e-12, max_iters=100_000), None),
    ]),
    ("MoDo (gamma 0.1, rho 0.1), first step", lambda: ours(mg.harmonizers.MoDo()), [
        ("TorchJD MoDoWeighting", lambda: torchjd_weighting("MoDoWeighting"), None),
        ("TorchJD MoDoWeighting on the float64 stack",
         lambda: _in_float64(torchjd_weighting("MoDoWeighting")), None),
    ]),
    ("SDMGrad (defaults), first step", lambda: ours(mg.harmonizers.SDMGrad()), [
        ("TorchJD SDMGradWeighting (defaults: guard 1e-8 on the mean squared norm)",
         lambda: torchjd_weighting("SDMGradWeighting"), None),
        ("TorchJD SDMGradWeighting on the float64 stack / mean ‖g_k‖",
         lambda: rescaled_float64(torchjd_weighting("SDMGradWeighting"), _mean_norm_one), None),
    ]),
]  # fmt: skip


def _rescaled(inner: Direction) -> Direction:
    """LibMTL's 'l2' MGDA returns sum alpha_k u_k; MARBLE's rescale multiplies by mean ||g_k||."""
    return lambda jacobian: inner(jacobian) * jacobian.double().norm(dim=1).mean().float()


def _nash(iterations: int) -> Direction:
    import torchjd.aggregation as aggregation

    return lambda jacobian: aggregation.NashMTL(n_tasks=len(jacobian), optim_niter=iterations)(
        jacobian
    )


def _in_float64(inner: Direction) -> Direction:
    return lambda jacobian: inner(jacobian.double()).float()


def _relative_spread(values: torch.Tensor) -> float:
    return float((values.max() - values.min()) / values.mean().abs())


def method_check(method: str, jacobian: torch.Tensor, direction: torch.Tensor) -> float | None:
    """A number that says how well a direction meets its method's defining property.

    MGDA: ||d||^2 (lower is better). IMTL-G: relative spread (max - min) / mean of the
    projections d . u_k, zero by definition. CAGrad: the worst improvement min_k g_k . d
    divided by ||d|| (higher is better, at equal scale). Nash-MTL: relative spread of
    w_k (g_k . d), equal for every k at the bargaining solution (any rescaling keeps it).
    ConFIG: relative spread of the cosines between d and each g_k, equal by definition.
    FairGrad: the worst relative residual of its system g_k . d = w_k^(-1/alpha),
    max_k |g_k . d - w_k^(-1/alpha)| / (w_k^(-1/alpha) + sum_j |g_k . g_j| w_j).
    """
    jacobian, direction = jacobian.double(), direction.double()
    if method == "Nash-MTL":
        return _relative_spread(implied_weights(jacobian, direction) * (jacobian @ direction))
    if method.startswith("MGDA (plain)"):
        return float(direction @ direction)
    if method == "IMTL-G":
        return _relative_spread(torch.nn.functional.normalize(jacobian, dim=1) @ direction)
    if method.startswith("CAGrad"):
        return float((jacobian @ direction).min() / direction.norm())
    if method.startswith("ConFIG"):
        units = torch.nn.functional.normalize(jacobian, dim=1)
        return _relative_spread(units @ direction / direction.norm())
    if method.startswith("FairGrad"):
        weights = implied_weights(jacobian, direction)
        demand = weights ** (-1.0 / FAIRGRAD_ALPHA)
        scale = demand + (jacobian @ jacobian.T).abs() @ weights.abs()
        return float(((jacobian @ direction - demand).abs() / scale).max())
    return None


def stacks(seed: int, trained_steps: int | None) -> dict[str, torch.Tensor]:
    """TorchJD's regression matrix, and real trunk stacks unless ``trained_steps`` is None."""
    regression = torch.tensor([[-4.0, 1.0, 1.0], [6.0, 1.0, 1.0]])
    found = {"TorchJD's J = [[-4, 1, 1], [6, 1, 1]]": regression}
    for name in PROBLEMS if trained_steps is not None else ():
        found[f"{name}, first conflict"] = trunk_stack(name, 0, seed)
        trained = trunk_stack(name, trained_steps, seed)
        found[f"{name}, first conflict after {trained_steps} EW steps"] = trained
        found[f"{name}, same x 1e-3"] = trained * 1e-3
    return found


def _difference(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    reference, other = reference.double(), other.double()
    size = float(reference.norm())
    cosine = float(reference @ other / (size * float(other.norm()))) if other.norm() > 0 else 0.0
    return cosine, float((reference - other).norm()) / size if size > 0 else math.nan


def _weight_gap(ours_w: torch.Tensor, theirs_w: torch.Tensor, resolution: float) -> float:
    """max_k |Δw_k| / max(|w_k|, resolution * ||w||).

    A direction known to a relative eps (its dtype's) gives weights known to about
    eps kappa(J) ||w|| through the least-squares recovery: below that, a weight that is
    zero by the method (Krum's unselected rows, PCD's inactive constraints) is round-off,
    different for two equal directions.
    """
    floor = resolution * float(ours_w.norm())
    return float(((ours_w - theirs_w).abs() / ours_w.abs().clamp_min(floor)).max())


def _runs_here(implementation: str, tasks: Tasks, count: int) -> bool:
    if implementation.startswith("LibMTL") and not libmtl_installed():
        return False
    return tasks is None or count in tasks


def compare_stack(stack_name: str, jacobian: torch.Tensor, seed: int = 0) -> list[dict]:
    """One row per (method, implementation) that runs at this stack's K."""
    rows = []
    norms = jacobian.double().norm(dim=1)
    singular = torch.linalg.svdvals(jacobian.double())
    resolution = torch.finfo(jacobian.dtype).eps * float(singular[0] / singular[-1])
    for method, make_ours, others in PAIRS:
        others = [other for other in others if _runs_here(other[0], other[2], len(jacobian))]
        if not others:
            continue
        reference = make_ours()(jacobian)
        for implementation, make_theirs, _ in others:
            seed_everything(seed)
            try:
                theirs = make_theirs()(jacobian)
            except Exception as error:  # a library failing on a stack is a finding
                rows.append(_row(stack_name, norms, method, implementation, error=error))
                continue
            cosine, relative = _difference(reference, theirs)
            ours_w, theirs_w = implied_weights(jacobian, torch.stack([reference, theirs], dim=1)).T
            weight_gap = _weight_gap(ours_w, theirs_w, resolution)
            rows.append(_row(stack_name, norms, method, implementation, cosine=cosine,
                             relative=relative, weight_gap=weight_gap,
                             check_ours=method_check(method, jacobian, reference),
                             check_theirs=method_check(method, jacobian, theirs)))  # fmt: skip
    return rows


def compare_all(seed: int = 0, trained_steps: int | None = TRAINED_STEPS) -> list[dict]:
    """One row per (method, implementation, stack); ``trained_steps=None``: TorchJD's J only."""
    rows = []
    for stack_name, jacobian in stacks(seed, trained_steps).items():
        rows += compare_stack(stack_name, jacobian, seed)
    return rows


def _row(stack, norms, method, implementation, **values) -> dict:
    error = values.pop("error", None)
    return {
        "stack": stack,
        "norms": [float(n) for n in norms],
        "method": method,
        "implementation": implementation,
        "error": None if error is None else f"{type(error).__name__}: {error}"[:160],
        **values,
    }


def library_versions() -> dict[str, str]:
    versions = {}
    for name in ("LibMTL", "scikit-learn", "quadprog"):
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _check(value: float | None) -> str:
    return "–" if value is None else f"{value:.6g}"


def _direction_table(rows: list[dict]) -> str:
    header = ["stack (task gradient norms)", "method", "other implementation",
              "cos(ours, theirs)", "‖ours − theirs‖ / ‖ours‖", "max_k |Δw_k| / |w_k|",
              "check: ours", "check: theirs"]  # fmt: skip
    table = []
    for row in rows:
        norms = ", ".join(f"{n:.2g}" for n in row["norms"])
        if row["error"] is not None:
            values = [f"raised {row['error']}", "–", "–", "–", "–"]
        else:
            values = [f"{row['cosine']:.6f}", f"{row['relative']:.2e}", f"{row['weight_gap']:.2e}",
                      _check(row["check_ours"]), _check(row["check_theirs"])]  # fmt: skip
        table.append([f"{row['stack']} ({norms})", row["method"], row["implementation"], *values])
    return markdown_table(header, table)


DIRECTION_NOTES = """\
Known differences above float round-off, new gradient methods (those of the first thirteen
are explained in docs/mtl.md, "Same method, different library"):

- ConFIG, FairGrad, MoDo, PCD: TorchJD solves on the float32 stack or its float32 Gram;
  on the float64 stack it agrees with ours to float32 round-off
  (tests/harmonizers/: each method's file, e.g. test_pcd.py).
- FairGrad on small gradients: TorchJD's SciPy least_squares starts at w = 1/K and
  stops on its gradient tolerance (gtol 1e-8) while the absolute residual
  G w - w^(-1/alpha) is small only because both terms are. On the multi-digits stack
  x 1e-3 (norms 8e-4, 1.5e-3) its weights are 696 and 555 where the system's solution is
  1287 and 680: its residual check is 0.53, ours 9e-8. The parity tests use O(1) stacks.
- ExcessMTL: TorchJD's default n_warmup_steps=0 first steps with the raw excess estimate
  (in units of |g|), and it adds 1e-7 under the root of its AdaGrad diagonal and to the
  baseline, which outweighs the squares of entries below 3e-4. With the warm-up
  matched and the stack scaled so that the guard is negligible (ours is invariant to each
  objective's scale) it agrees (tests/harmonizers/test_state.py:
  test_excess_mtl_matches_its_definition_and_torchjd,
  test_torchjd_default_excess_mtl_saturates_at_large_scale).
- SDMGrad: TorchJD divides the Gram by (mean norm)^2 + 1e-8, which matters at mean norms
  of 1e-4 and below (test_sdmgrad_weights_are_scale_invariant_where_torchjds_are_not);
  on these stacks both rows agree.
- Krum: the paper scores squared distances (ours by default), TorchJD plain ones, so the
  rows selected may differ once a score sums two or more distances (K >= 4 at f = 0: the
  many-tasks stacks); with plain distances ours selects TorchJD's rows
  (test_krum_scores_squared_distances_unlike_torchjd).
- CR-MOGM: TorchJD's inner MGDA stops at epsilon 1e-3, as in the MGDA rows.
- GradDrop: seeded alike, all three draw the same U. LibMTL adds 1e-7 to the purity's
  denominator sum_k |g_kj|, which moves P where that sum is small and flips the sign kept
  where |P - U| is below the shift (its rule with the 1e-7 reproduces its result exactly).

The weight column divides |Δw_k| by max(|w_k|, eps kappa(J) ||w||), eps that of the stack's
dtype: a direction rounded to it resolves its weights only to that (zero weights, such as
Krum's unselected rows or PCD's inactive constraints, come back as round-off).
"""


def comparison_markdown(rows: list[dict], loss_rows: list[dict]) -> str:
    """comparison.md: ``rows`` from :func:`compare_all`, ``loss_rows`` from
    :func:`compare_losses.compare_losses`."""
    versions = library_versions()
    return (
        "# Same method, different implementation\n\n"
        f"LibMTL {versions['LibMTL']}, TorchJD {importlib.metadata.version('torchjd')}. "
        "Generated by `python -m benchmarks.mtl.compare` (also run by `make mtl`).\n\n"
        "## Gradient methods: directions on identical gradient stacks\n\n"
        "cos and ‖ours − theirs‖ / ‖ours‖ compare the two directions; the weights w are "
        "recovered from each direction by least squares (J^T w = d), which exposes a wrong "
        "weight on a small task that the direction hides. Stateful methods start from the "
        "same state and their first update is compared (ExcessMTL's after a warm-up call on "
        "the stack with row k scaled by k + 1). Checks (see `method_check`): MGDA "
        "||d||^2 (lower is better); IMTL-G relative spread of the projections d . u_k (0 by "
        "definition); CAGrad min_k g_k . d / ||d|| (higher is better); Nash-MTL relative "
        "spread of w_k g_k . d (0 at the bargaining solution); ConFIG relative spread of "
        "cos(d, g_k) (0 by definition); FairGrad worst relative residual of "
        "g_k . d = w_k^(-1/alpha) (0 by definition).\n\n"
        + DIRECTION_NOTES
        + "\n"
        + _direction_table(rows)
        + "\n\n"
        + compare_losses.loss_markdown(loss_rows)
    )


def main() -> None:
    torch.set_num_threads(1)
    np.set_printoptions(precision=4)
    print(comparison_markdown(compare_all(), compare_losses.compare_losses()))


if __name__ == "__main__":
    main()
