"""Ours vs TorchJD's and LibMTL's implementation of the same method, on identical gradient stacks.

    python -m benchmarks.mtl.compare     # prints comparison.md's table

Stacks: TorchJD's regression matrix, and the trunk gradients of both problems on the
first batch with conflicting tasks from initialization and after 200 steps of equal
weighting (plus that stack x 1e-3, to expose absolute thresholds). LibMTL's weightings
compute gradients themselves, so they get losses L_k = <g_k, p> whose gradient in p is
exactly row k. For every pair we report cos(d_ours, d_lib), ||d_ours - d_lib|| /
||d_ours||, and a check of the method's defining property for both directions.
"""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Callable

import numpy as np
import torch

import mogradient as mg
from benchmarks.common import markdown_table
from benchmarks.mtl.data import PROBLEMS
from benchmarks.mtl.methods import (
    CAGRAD_C,
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
            jacobian = mg.objective_gradients(losses, model.shared_parameters(), retain_graph=True)
            if _worst_pairwise_cosine(jacobian) < 0:
                return jacobian
        torch.stack(losses).mean().backward()
        optimizer.step()
    raise RuntimeError(f"no conflicting batch within {MAX_SEARCH} steps after step {steps}")


def _worst_pairwise_cosine(jacobian: torch.Tensor) -> float:
    units = torch.nn.functional.normalize(jacobian.double(), dim=1)
    cosines = units @ units.T
    return float(cosines[~torch.eye(len(units), dtype=torch.bool)].min())


def libmtl_direction(name: str, jacobian: torch.Tensor, **options) -> torch.Tensor:
    """LibMTL's own ``backward`` on losses whose gradients are exactly the rows of ``jacobian``."""
    parameter = torch.zeros(jacobian.shape[1], requires_grad=True)
    losses = jacobian.detach().float() @ parameter
    weighting = getattr(libmtl_weighting_module(), name)()
    weighting.task_num = len(jacobian)
    weighting.device = torch.device("cpu")
    weighting.rep_grad = False
    weighting.get_share_params = lambda: [parameter]
    weighting.zero_grad_share_params = lambda: parameter.grad.zero_()
    weighting.init_param()
    parameter.grad = torch.zeros_like(parameter)
    weighting.backward(losses, **options)
    return parameter.grad.detach().clone()


def torchjd(name: str, **options) -> Callable[[torch.Tensor], torch.Tensor]:
    import torchjd.aggregation as aggregation

    def direction(jacobian: torch.Tensor) -> torch.Tensor:
        return getattr(aggregation, name)(**options)(jacobian)

    return direction


def exact_projector():
    """TorchJD's own dual-cone projector with its two thresholds switched off."""
    from torchjd._linalg._dual_cone import QuadprogProjector

    return QuadprogProjector(norm_eps=0.0, reg_eps=0.0)


def ours(harmonizer: mg.Harmonizer) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda jacobian: harmonizer(jacobian).direction


def libmtl(name: str, **options) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda jacobian: libmtl_direction(name, jacobian, **options)


# (method, ours, [(implementation, its direction, K it supports or None)])
PAIRS = [
    ("MGDA (plain)", lambda: ours(mg.MGDA(normalize=False)), [
        ("TorchJD MGDA (defaults: epsilon 1e-3, 100 iters)", lambda: torchjd("MGDA"), None),
        ("TorchJD MGDA (epsilon 1e-12, 1e5 iters)",
         lambda: torchjd("MGDA", epsilon=1e-12, max_iters=100_000), None),
        ("LibMTL MGDA (mgda_gn='none')", lambda: libmtl("MGDA", mgda_gn="none"), None),
    ]),
    ("MGDA-NR (unit gradients, rescaled)", lambda: ours(mg.MGDA()), [
        ("LibMTL MGDA (mgda_gn='l2'), x mean norm",
         lambda: _rescaled(libmtl("MGDA", mgda_gn="l2")), None),
    ]),
    ("UPGrad", lambda: ours(mg.UPGrad()), [
        ("TorchJD UPGrad (defaults: norm_eps 1e-4, reg_eps 1e-4)", lambda: torchjd("UPGrad"), None),
        ("TorchJD UPGrad (norm_eps 0, reg_eps 0)",
         lambda: torchjd("UPGrad", projector=exact_projector()), None),
    ]),
    ("DualProj", lambda: ours(mg.DualProj()), [
        ("TorchJD DualProj (defaults)", lambda: torchjd("DualProj"), None),
        ("TorchJD DualProj (norm_eps 0, reg_eps 0)",
         lambda: torchjd("DualProj", projector=exact_projector()), None),
    ]),
    ("PCGrad (K = 2: order-free)", lambda: ours(mg.PCGrad(seed=0)), [
        ("TorchJD PCGrad", lambda: torchjd("PCGrad"), 2),
        ("LibMTL PCGrad", lambda: libmtl("PCGrad"), 2),
    ]),
    ("IMTL-G", lambda: ours(mg.IMTLG()), [
        ("TorchJD IMTLG", lambda: torchjd("IMTLG"), None),
        ("TorchJD IMTLG on the float64 stack", lambda: _in_float64(torchjd("IMTLG")), None),
        ("LibMTL IMTL (loss scales frozen at 0)", lambda: libmtl("IMTL"), None),
    ]),
    ("CAGrad c=0.5", lambda: ours(mg.CAGrad(c=CAGRAD_C)), [
        ("TorchJD CAGrad (norm_eps 1e-4)", lambda: torchjd("CAGrad", c=CAGRAD_C), None),
    ]),
    ("CAGrad c=0.5, rescaled by 1/(1+c^2)", lambda: ours(mg.CAGrad(c=CAGRAD_C, rescale=True)), [
        ("LibMTL CAGrad (rescale=1)", lambda: libmtl("CAGrad", calpha=CAGRAD_C, rescale=1), 3),
    ]),
    ("Nash-MTL", lambda: ours(mg.NashMTL()), [
        ("TorchJD NashMTL (optim_niter 20)", lambda: _nash(20), None),
        ("TorchJD NashMTL (optim_niter 500)", lambda: _nash(500), None),
    ]),
    ("Aligned-MTL", lambda: ours(mg.AlignedMTL()), [
        ("TorchJD AlignedMTL", lambda: torchjd("AlignedMTL"), None),
        ("TorchJD AlignedMTL on the float64 stack", lambda: _in_float64(torchjd("AlignedMTL")),
         None),
    ]),
    ("GradVac, first step (K = 2)", lambda: ours(mg.GradVac(beta=GRADVAC_BETA, seed=0)), [
        ("TorchJD GradVac", lambda: torchjd("GradVac", beta=GRADVAC_BETA), 2),
        ("LibMTL GradVac", lambda: libmtl("GradVac", beta=GRADVAC_BETA), 2),
    ]),
]  # fmt: skip


def _rescaled(inner: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """LibMTL's 'l2' MGDA returns sum alpha_k u_k; MARBLE's rescale multiplies by mean ||g_k||."""
    return lambda jacobian: inner(jacobian) * jacobian.double().norm(dim=1).mean().float()


def _nash(iterations: int) -> Callable[[torch.Tensor], torch.Tensor]:
    import torchjd.aggregation as aggregation

    return lambda jacobian: aggregation.NashMTL(n_tasks=len(jacobian), optim_niter=iterations)(
        jacobian
    )


def _in_float64(inner: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    return lambda jacobian: inner(jacobian.double()).float()


def implied_weights(jacobian: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """The w with J^T w = d (least squares in float64; exact for independent task gradients).

    Weights expose what a relative direction difference hides: with task norms 1e-2 and
    1e3, a wrong weight on the small task barely moves d.
    """
    solution = torch.linalg.lstsq(jacobian.double().T, direction.double()[:, None])
    return solution.solution[:, 0]


def method_check(method: str, jacobian: torch.Tensor, direction: torch.Tensor) -> float | None:
    """A number that says how well a direction meets its method's defining property.

    MGDA: ||d||^2 (lower is better). IMTL-G: relative spread (max - min) / mean of the
    projections d . u_k, zero by definition. CAGrad: the worst improvement min_k g_k . d
    divided by ||d|| (higher is better, at equal scale). Nash-MTL: relative spread of
    w_k (g_k . d), equal for every k at the bargaining solution (any rescaling keeps it).
    """
    jacobian, direction = jacobian.double(), direction.double()
    if method == "Nash-MTL":
        products = implied_weights(jacobian, direction) * (jacobian @ direction)
        return float((products.max() - products.min()) / products.mean().abs())
    if method.startswith("MGDA (plain)"):
        return float(direction @ direction)
    if method == "IMTL-G":
        projections = torch.nn.functional.normalize(jacobian, dim=1) @ direction
        return float((projections.max() - projections.min()) / projections.mean().abs())
    if method.startswith("CAGrad"):
        return float((jacobian @ direction).min() / direction.norm())
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


def compare_all(seed: int = 0, trained_steps: int | None = TRAINED_STEPS) -> list[dict]:
    """One row per (method, implementation, stack); ``trained_steps=None``: TorchJD's J only."""
    rows = []
    for stack_name, jacobian in stacks(seed, trained_steps).items():
        norms = jacobian.double().norm(dim=1)
        for method, make_ours, others in PAIRS:
            reference = make_ours()(jacobian)
            for implementation, make_theirs, only_tasks in others:
                if only_tasks is not None and only_tasks != len(jacobian):
                    continue
                if implementation.startswith("LibMTL") and not libmtl_installed():
                    continue
                seed_everything(seed)
                try:
                    theirs = make_theirs()(jacobian)
                except Exception as error:  # a library failing on a stack is a finding
                    rows.append(_row(stack_name, norms, method, implementation, error=error))
                    continue
                cosine, relative = _difference(reference, theirs)
                ours_w = implied_weights(jacobian, reference)
                theirs_w = implied_weights(jacobian, theirs)
                weight_gap = float(
                    ((ours_w - theirs_w).abs() / ours_w.abs().clamp_min(1e-300)).max()
                )
                rows.append(_row(stack_name, norms, method, implementation, cosine=cosine,
                                 relative=relative, weight_gap=weight_gap,
                                 check_ours=method_check(method, jacobian, reference),
                                 check_theirs=method_check(method, jacobian, theirs)))  # fmt: skip
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


def comparison_markdown(rows: list[dict]) -> str:
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
    versions = library_versions()
    return (
        "# Same method, different implementation: directions on identical gradient stacks\n\n"
        f"LibMTL {versions['LibMTL']}, TorchJD {importlib.metadata.version('torchjd')}. "
        "Generated by `python -m benchmarks.mtl.compare` (also run by `make mtl`). "
        "Checks (see `method_check`): MGDA ||d||^2 (lower is better); IMTL-G relative spread "
        "of the projections d . u_k (0 by definition); CAGrad min_k g_k . d / ||d|| "
        "(higher is better); Nash-MTL relative spread of w_k g_k . d (0 at the bargaining "
        "solution). Weights w are recovered from each direction by least squares (J^T w = d).\n\n"
        + markdown_table(header, table)
        + "\n"
    )


def main() -> None:
    torch.set_num_threads(1)
    np.set_printoptions(precision=4)
    print(comparison_markdown(compare_all()))


if __name__ == "__main__":
    main()
