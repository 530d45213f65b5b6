"""Our DB-MTL and MoCo against LibMTL's GitHub main, step by step; writes a markdown report.

DB-MTL and MoCo are not in LibMTL 1.1.5 (the PyPI release the tests compare with), and CI
cannot reach GitHub, so this is run by hand on a LibMTL checkout and its report committed:

    git clone https://github.com/median-research-group/LibMTL /tmp/LibMTL
    .venv/bin/python tools/libmtl_main_parity.py --libmtl /tmp/LibMTL

The checkout's ``LibMTL/weighting`` modules are imported standalone (its package
``__init__`` files, which import torchvision and every method, are not run), with the
checkout's own ``abstract_weighting``. Nothing of LibMTL is copied here.

Both sides get two copies of one seeded model (a Linear + tanh trunk, one linear head per
task, MSE losses on targets of scales 1, 3 and 10, a fresh batch every step) and take the
same SGD steps. A quantity agrees "to rounding" when its largest difference is within
64 (step + 1) ulps of its scale, the budget of tests/scalarizations/ (libmtl.py).
"""

from __future__ import annotations

import argparse
import importlib
import platform
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.nn import functional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; run as a script, it is not found
    sys.path.insert(0, str(ROOT))

from benchmarks.common import default_dtype  # noqa: E402
from benchmarks.mtl.parity_model import TASKS, Model, batches  # noqa: E402
from mogradient.scalarizations import DBMTL, MoCo  # noqa: E402

OUT = ROOT / "benchmarks" / "results" / "mtl" / "libmtl_main_parity.md"
STEPS = 10
LR = 0.05
ULPS_PER_STEP = 64
DTYPES = (torch.float64, torch.float32)
DB_MTL = {"DB_beta": 0.9, "DB_beta_sigma": 0.0}
MOCO = {
    "MoCo_beta": 0.5,
    "MoCo_beta_sigma": 0.5,
    "MoCo_gamma": 0.1,
    "MoCo_gamma_sigma": 0.5,
    "MoCo_rho": 0.0,
}
SOURCES = ("abstract_weighting.py", "DB_MTL.py", "MoCo.py")


def load_weightings(checkout: Path) -> dict[str, type]:
    """DB_MTL and MoCo from ``checkout``, with stub packages instead of its ``__init__`` files."""
    if "LibMTL" in sys.modules:
        raise RuntimeError("another LibMTL is already imported in this process")
    for name, path in (
        ("LibMTL", checkout / "LibMTL"),
        ("LibMTL.weighting", checkout / "LibMTL" / "weighting"),
    ):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package
    return {
        name: getattr(importlib.import_module(f"LibMTL.weighting.{name}"), name)
        for name in ("DB_MTL", "MoCo")
    }


def bind(weighting_class: type, model: Model, dtype: torch.dtype) -> Any:
    """The attributes LibMTL's model mixin gives a weighting (as benchmarks/mtl does)."""
    weighting = weighting_class()
    weighting.task_num = TASKS
    weighting.device = torch.device("cpu")
    weighting.rep_grad = False
    weighting.get_share_params = model.shared_parameters
    # LibMTL's zero_grad_share_params sets .grad to None (torch >= 2), which its
    # _reset_grad then skips: zero in place instead, as the benchmark's driver does.
    weighting.zero_grad_share_params = lambda: model.trunk.zero_grad(set_to_none=False)
    with default_dtype(dtype):
        weighting.init_param()
    return weighting


def run_libmtl(weighting: Any, model: Model, losses: torch.Tensor, options: dict) -> Any:
    for parameter in model.shared_parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    with default_dtype(losses.dtype):
        return weighting.backward(losses, **options)


def flat(parameters: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([parameter.grad.reshape(-1) for parameter in parameters]).double()


def heads(model: Model) -> torch.Tensor:
    """K x (head size): head k's gradient, which only loss k reaches."""
    return torch.stack([flat(list(head.parameters())) for head in model.heads])


@dataclass
class Comparison:
    """The largest difference of each quantity over the steps, absolute and in ulps."""

    dtype: torch.dtype
    worst: dict[str, tuple[float, float, bool]] = field(default_factory=dict)
    by_design: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def add(
        self,
        what: str,
        actual: torch.Tensor,
        expected: torch.Tensor,
        step: int,
        by_design: bool = False,
    ) -> None:
        actual = torch.as_tensor(actual, dtype=torch.float64).detach()
        expected = torch.as_tensor(expected, dtype=torch.float64).detach()
        difference = float((actual - expected).abs().max())
        ulps = difference / (torch.finfo(self.dtype).eps * max(1.0, float(expected.abs().max())))
        within = ulps <= ULPS_PER_STEP * (step + 1)
        old = self.worst.get(what, (0.0, 0.0, True))
        self.worst[what] = (max(old[0], difference), max(old[1], ulps), old[2] and within)
        if by_design:
            self.by_design.add(what)

    def failures(self) -> list[str]:
        return [
            what
            for what, (_, _, within) in self.worst.items()
            if not within and what not in self.by_design
        ]


def compare_db_mtl(weighting_class: type, dtype: torch.dtype, beta_sigma: float) -> Comparison:
    """Independent runs: LibMTL's and ours should be the same method to rounding."""
    options = {**DB_MTL, "DB_beta_sigma": beta_sigma}
    ours, theirs = Model(dtype), Model(dtype)
    method = DBMTL(TASKS, ours.shared_parameters(), beta=options["DB_beta"], beta_sigma=beta_sigma)
    weighting = bind(weighting_class, theirs, dtype)
    ours_optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    comparison = Comparison(dtype)
    for step, batch in enumerate(batches(dtype, STEPS)):
        ours_optimizer.zero_grad()
        their_optimizer.zero_grad()
        run_libmtl(weighting, theirs, theirs.losses(batch), options)
        method(ours.losses(batch)).loss.backward()
        comparison.add(
            "shared gradient",
            flat(ours.shared_parameters()),
            flat(theirs.shared_parameters()),
            step,
        )
        comparison.add("head gradients", heads(ours), heads(theirs), step)
        comparison.add("averages h_k", method.averages, weighting.grad_buffer, step)
        ours_optimizer.step()
        their_optimizer.step()
    return comparison


def compare_moco(weighting_class: type, dtype: torch.dtype) -> Comparison:
    """Ours with normalize=True, the copies resynced to ours each step (the heads differ).

    LibMTL renormalizes lambda by a softmax where ours (the paper) projects onto the
    simplex, so the lambdas part ways; the tracked gradients do not depend on lambda. Each
    step checks: Y; LibMTL's lambda against the softmax rule applied to our Y and its
    previous lambda; LibMTL's shared gradient against our Y^T times its lambda; ours
    against our Y^T times our lambda; ours on the heads against our lambda times LibMTL's
    (which backpropagates each loss alone, unweighted).
    """
    ours, theirs = Model(dtype), Model(dtype)
    method = MoCo(
        TASKS,
        ours.shared_parameters(),
        beta=MOCO["MoCo_beta"],
        beta_sigma=MOCO["MoCo_beta_sigma"],
        gamma=MOCO["MoCo_gamma"],
        gamma_sigma=MOCO["MoCo_gamma_sigma"],
        rho=MOCO["MoCo_rho"],
        normalize=True,
    )
    weighting = bind(weighting_class, theirs, dtype)
    optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    comparison = Comparison(dtype)
    for step, batch in enumerate(batches(dtype, STEPS)):
        theirs.load_state_dict(ours.state_dict())
        theirs.zero_grad()
        optimizer.zero_grad()
        previous = weighting.lambd.double().clone()
        their_lambda = torch.as_tensor(run_libmtl(weighting, theirs, theirs.losses(batch), MOCO))
        result = method(ours.losses(batch))
        result.loss.backward()
        tracked = method.tracked.double()
        rate = MOCO["MoCo_gamma"] / (step + 1) ** MOCO["MoCo_gamma_sigma"]
        matrix = tracked @ tracked.T + MOCO["MoCo_rho"] * torch.eye(TASKS, dtype=torch.float64)
        softmax_rule = functional.softmax(previous - rate * matrix @ previous, dim=0)
        comparison.add("tracked Y", tracked, weighting.y, step)
        comparison.add("LibMTL lambda vs softmax rule on our Y", their_lambda, softmax_rule, step)
        comparison.add(
            "LibMTL shared gradient vs our Y^T lambda_LibMTL",
            flat(theirs.shared_parameters()),
            tracked.T @ their_lambda.double(),
            step,
        )
        comparison.add(
            "our shared gradient vs our Y^T lambda",
            flat(ours.shared_parameters()),
            tracked.T @ result.weights.double(),
            step,
        )
        comparison.add(
            "heads: ours vs lambda_k times LibMTL's",
            heads(ours),
            result.weights.double()[:, None] * heads(theirs),
            step,
        )
        comparison.add(
            "lambda: ours vs LibMTL's", result.weights, their_lambda, step, by_design=True
        )
        optimizer.step()
    comparison.notes.append(
        f"MoCo, {str(dtype).removeprefix('torch.')}, lambda after step {STEPS}: ours "
        f"{[round(value, 4) for value in result.weights.tolist()]}, LibMTL's "
        f"{[round(value, 4) for value in their_lambda.tolist()]}"
    )
    return comparison


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, capture_output=True, text=True, check=True
    ).stdout.strip()


def report(checkout: Path, results: list[tuple[str, Comparison]]) -> str:
    commit = git("log", "-1", "--format=%H (%cI)", cwd=checkout)
    changed = git(
        "log", "-1", "--format=%H (%cI)", "--", *SOURCES[1:], cwd=checkout / "LibMTL" / "weighting"
    )
    weighting = checkout / "LibMTL" / "weighting"
    blobs = ", ".join(
        f"`{name}` {git('hash-object', str(weighting / name), cwd=checkout)[:12]}"
        for name in SOURCES
    )
    ours = ", ".join(
        f"`{path}` {git('hash-object', path, cwd=ROOT)[:12]}"
        for path in ("mogradient/scalarizations/_db_mtl.py", "mogradient/scalarizations/_moco.py")
    )
    lines = [
        "# DB-MTL and MoCo against LibMTL's GitHub main",
        "",
        "Written by `tools/libmtl_main_parity.py` (see its docstring for the protocol).",
        "",
        f"* LibMTL: github.com/median-research-group/LibMTL at {commit}; blobs {blobs}; "
        f"DB_MTL.py and MoCo.py last changed in {changed}",
        f"* ours: {ours}",
        f"* torch {torch.__version__}, Python {platform.python_version()}, {platform.machine()}",
        f"* model: Linear(3, 5) + tanh trunk, {TASKS} Linear(5, 1) heads (torch.manual_seed(0)); "
        "MSE on targets of scales 1, 3, 10; a fresh batch of 16 per step (Generator seed 1); "
        f"{STEPS} steps of SGD (lr {LR})",
        f"* DB-MTL: DB_beta {DB_MTL['DB_beta']}, DB_beta_sigma 0 and 0.5 (LibMTL's default 0); "
        f"MoCo: LibMTL's defaults {MOCO}, ours with normalize=True",
        "",
        "ulps: the difference in units of the dtype's eps times max(1, |expected|). "
        f"Budget: {ULPS_PER_STEP} (step + 1) ulps.",
        "",
        "| run | dtype | quantity | max abs difference | max ulps | within budget |",
        "|---|---|---|---|---|---|",
    ]
    for run, comparison in results:
        for what, (difference, ulps, within) in comparison.worst.items():
            dtype = str(comparison.dtype).removeprefix("torch.")
            if what in comparison.by_design:
                ulps_cell, verdict = "-", "by design"
            else:
                ulps_cell, verdict = f"{ulps:.3g}", "yes" if within else "**no**"
            lines.append(
                f"| {run} | {dtype} | {what} | {difference:.3g} | {ulps_cell} | {verdict} |"
            )
    lines += ["", *(f"* {note}" for _, comparison in results for note in comparison.notes)]
    lines += [
        "",
        "Differences by design (kept; ours follows the paper where LibMTL deviates):",
        "",
        "* MoCo: LibMTL renormalizes lambda with a softmax; ours projects onto the simplex "
        "(Fernando et al. 2023, Algorithm 1). LibMTL always rescales each gradient to norm "
        "L_k (ours with normalize=True, as run here). LibMTL backpropagates each loss alone, "
        "so its heads get the unweighted sum_k grad L_k; ours get lambda_k grad L_k.",
        "* DB-MTL: LibMTL's backward returns weights of 1; ours reports d loss / d L_k = "
        "1 / (L_k + eps). The gradients are the same.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--libmtl", type=Path, required=True, help="a LibMTL git checkout")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    classes = load_weightings(args.libmtl.resolve())
    results: list[tuple[str, Comparison]] = []
    for dtype in DTYPES:
        for beta_sigma in (0.0, 0.5):
            results.append(
                (
                    f"DB-MTL, beta_sigma {beta_sigma}",
                    compare_db_mtl(classes["DB_MTL"], dtype, beta_sigma),
                )
            )
        results.append(("MoCo", compare_moco(classes["MoCo"], dtype)))
    text = report(args.libmtl.resolve(), results)
    args.out.write_text(text)
    print(text)
    return 1 if any(comparison.failures() for _, comparison in results) else 0


if __name__ == "__main__":
    sys.exit(main())
