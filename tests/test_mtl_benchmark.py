"""The multi-task head-to-head (benchmarks/mtl): quick mode end to end, and its parts."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from tolerances import chain_atol, reduction_atol

pytest.importorskip("sklearn", reason="the mtl benchmark needs the 'mtl' extra (scikit-learn)")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.mtl import compare, data  # noqa: E402
from benchmarks.mtl.methods import (  # noqa: E402
    METHODS,
    applicable,
    bind,
    extra_parameters,
    libmtl_installed,
    preference_size,
)
from benchmarks.mtl.metrics import delta_m  # noqa: E402
from benchmarks.mtl.model import MultiTaskNet  # noqa: E402
from benchmarks.mtl.train import Budget, seed_everything, task_losses, train  # noqa: E402


def test_quick_mode_runs_every_method_and_writes_its_results(tmp_path: Path) -> None:
    out = tmp_path / "mtl"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.mtl.run",
            "--quick",
            "--workers",
            "2",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        check=True,
        timeout=600,
        capture_output=True,
    )
    results = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()
    assert results["mode"] == "quick"
    for name, summary in results["problems"].items():
        expected = {
            label for label, spec in METHODS.items() if applicable(spec, len(summary["tasks"]))
        }
        assert set(summary["methods"]) == expected | {"single-task"}
        assert set(summary["timing"]) == expected
        # One seed: the single-task row is its own baseline, exactly.
        assert summary["methods"]["single-task"]["delta_m"] == [0.0, 0.0]
        for label, entry in summary["methods"].items():
            assert math.isfinite(entry["delta_m"][0]), label
            assert f"| {label} |" in table
        for png in ("curves", "cosines", "weights"):
            assert (out / f"{png}_{name}.png").stat().st_size > 0
    assert (out / "pareto_multi-digits.png").stat().st_size > 0
    assert "| MGDA-NR | (0.2, 0.8) |" in table
    assert "TorchJD UPGrad (norm_eps 0, reg_eps 0)" in (out / "comparison.md").read_text()


def test_delta_m_is_the_signed_mean_relative_change() -> None:
    tasks = (data.Task("a", "ce", 10, "accuracy", True), data.Task("b", "mse", 1, "MAE", False))
    # accuracy 0.8 -> 0.9 is 12.5% better (counts negative), MAE 10 -> 12 is 20% worse.
    assert delta_m(tasks, [0.9, 12.0], [0.8, 10.0]) == pytest.approx((-12.5 + 20.0) / 2)
    with pytest.raises(ValueError, match="2 tasks but 1 metrics"):
        delta_m(tasks, [0.9], [0.8, 10.0])


def test_problems_are_deterministic_and_their_targets_are_what_they_claim() -> None:
    first, again = data.scaled_tasks((32, 8, 8), seed=3), data.scaled_tasks((32, 8, 8), seed=3)
    assert torch.equal(first.train.images, again.train.images)
    assert not torch.equal(first.train.images, data.scaled_tasks((32, 8, 8), seed=4).train.images)
    digit, parity, ink = first.test.targets
    assert torch.equal(parity, (digit % 2).float())
    # One digit pasted on an empty canvas: the canvas holds all of its ink, in [0, 1] units.
    canvas_ink = first.test.images.sum(dim=(1, 2, 3)) * data.INK_SCALE
    atol = reduction_atol(torch.float32, data.CANVAS**2, float(canvas_ink.max()))
    torch.testing.assert_close(canvas_ink, ink, rtol=0, atol=atol)
    pools = data._digit_pools()
    assert sum(len(labels) for _, labels in pools) == 1797
    pair = data.multi_digits((16, 4, 4), seed=0)
    assert pair.train.images.shape == (16, 1, data.CANVAS, data.CANVAS)
    assert all(int(target.max()) <= 9 for target in pair.train.targets)


def test_many_tasks_targets_follow_from_the_two_digits() -> None:
    problem = data.many_tasks((64, 16, 16), seed=1)
    assert len(problem.tasks) == len(problem.test.targets) == 12
    upper, lower, *rest = problem.test.targets
    upper_parity, lower_parity, upper_high, lower_high, greater, same, total, product = rest[:8]
    assert torch.equal(upper_parity, (upper % 2).float())
    assert torch.equal(lower_parity, (lower % 2).float())
    assert torch.equal(upper_high, (upper >= 5).float())
    assert torch.equal(lower_high, (lower >= 5).float())
    assert torch.equal(greater, (upper > lower).float())
    assert torch.equal(same, (upper_parity == lower_parity).float())
    assert torch.equal(total, (upper + lower).float())
    assert torch.equal(product, (upper * lower).float() / 81.0)
    # The pair shares multi_digits' construction: the same seed draws the same canvases.
    pair = data.multi_digits((64, 16, 16), seed=1)
    assert torch.equal(pair.test.images, problem.test.images)
    assert torch.equal(pair.test.targets[0], upper)


@pytest.mark.parametrize("label", ["RLW", "UPGrad", "TorchJD UPGrad", "LibMTL PCGrad"])
def test_training_is_deterministic(label: str) -> None:
    spec = METHODS[label]
    if not applicable(spec, 2):
        pytest.skip(f"{label} needs LibMTL (the Makefile installs it)")
    problem = data.multi_digits((96, 32, 32), seed=0)
    budget = Budget(epochs=1, batch=32, learning_rate=3e-3, diagnostics_every=1)
    runs = [train(problem, spec.build(2, 5), 5, budget) for _ in range(2)]
    assert runs[0]["losses"] == runs[1]["losses"]
    assert runs[0]["test"] == runs[1]["test"]


def test_only_cosmos_rows_condition_the_model_and_the_default_model_is_unchanged() -> None:
    """The preference input is opt-in: every other row trains the model built before it."""
    conditioned = {label for label, spec in METHODS.items() if preference_size(spec.build(2, 0), 2)}
    assert conditioned == {"COSMOS", "TorchJD COSMOS"}
    tasks = data.multi_digits((8, 4, 4), seed=0).tasks
    seed_everything(3)
    model = MultiTaskNet(tasks)
    # The network as it was before the option, built from the same seed.
    seed_everything(3)
    trunk = torch.nn.Sequential(
        torch.nn.Conv2d(1, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(16, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Flatten(),
        torch.nn.Linear(32 * 3 * 3, 64),
        torch.nn.ReLU(),
    )
    heads = torch.nn.ModuleList(torch.nn.Linear(64, task.outputs) for task in tasks)
    reference = {**{f"trunk.{k}": v for k, v in trunk.state_dict().items()},
                 **{f"heads.{k}": v for k, v in heads.state_dict().items()}}  # fmt: skip
    assert model.state_dict().keys() == reference.keys()
    assert all(torch.equal(model.state_dict()[key], reference[key]) for key in reference)
    images = torch.rand(5, 1, data.CANVAS, data.CANVAS, generator=torch.Generator().manual_seed(0))
    features, outputs = model(images)
    assert torch.equal(features, trunk(images))
    assert all(torch.equal(out, head(features)) for out, head in zip(outputs, heads, strict=True))
    with pytest.raises(ValueError, match="takes 0 preference entries with its input, got 2"):
        model(images, torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="takes 2 preference entries with its input, got 0"):
        MultiTaskNet(tasks, preference_size=2)(images)


# Rows of one method in two libraries; their gradients must agree on the same model and
# batches. Three single-batch "epochs" on a fixed model: DWA's weights leave 1 in the third.
SAME_METHOD = [
    ("UW", "TorchJD UW"),
    ("DWA", "TorchJD DWA"),
    ("GLS", "TorchJD GLS"),
    ("IMTL-L", "TorchJD IMTL-L"),
    ("FAMO", "TorchJD FAMO"),
    ("STCH", "TorchJD STCH"),
    ("PBI", "TorchJD PBI"),
    ("COSMOS", "TorchJD COSMOS"),
    ("DWA", "LibMTL DWA"),
    ("GLS", "LibMTL GLS"),
]
EPOCHS = 3


def _row_gradients(label: str, problem: data.Problem) -> list[list[torch.Tensor]]:
    """Per epoch: the gradients of the model's and the method's own parameters."""
    num_tasks = len(problem.tasks)
    method = METHODS[label].build(num_tasks, 5)
    seed_everything(5)
    model = MultiTaskNet(problem.tasks, preference_size(method, num_tasks))
    bind(method, model)
    learned = [*model.parameters(), *extra_parameters(method)]
    gradients = []
    for epoch in range(EPOCHS):
        for parameter in learned:
            parameter.grad = None
        preference = method.next_preference() if model.preference_size else None
        rows = torch.arange(16 * epoch, 16 * (epoch + 1))
        features, losses = task_losses(
            model, problem.train, rows, list(range(num_tasks)), preference
        )
        method.backward(model, losses, features)
        gradients.append([parameter.grad.clone() for parameter in learned])
        method.end_epoch()
    return gradients


@pytest.mark.parametrize(("ours", "theirs"), SAME_METHOD)
def test_library_rows_of_one_method_give_the_same_gradients(ours: str, theirs: str) -> None:
    if not applicable(METHODS[theirs], 2):
        pytest.skip(f"{theirs} needs LibMTL (make mtl installs it)")
    problem = data.multi_digits((16 * EPOCHS, 4, 4), seed=0)
    expected, actual = _row_gradients(ours, problem), _row_gradients(theirs, problem)
    for mine, others in zip(expected, actual, strict=True):
        assert len(mine) == len(others)
        for gradient, other in zip(mine, others, strict=True):
            # The task weights differ by rounding in a few operations, and the backward is
            # linear in them: the gradients differ by some ulps of their scale.
            atol = chain_atol(torch.float32, float(gradient.abs().max()), 16)
            torch.testing.assert_close(other, gradient, rtol=0, atol=atol)


@pytest.mark.skipif(not libmtl_installed(), reason="LibMTL is installed by the Makefile")
def test_libmtl_driver_feeds_the_exact_rows() -> None:
    """LibMTL's EW sums its gradients, and PCGrad leaves orthogonal rows alone: both = J.sum(0)."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.linalg.qr(torch.randn(50, 3, generator=generator))[0].T * torch.tensor(
        [[1.0], [3.0], [0.5]]
    )
    expected = rows.sum(dim=0)
    atol = reduction_atol(torch.float32, 3, float(rows.abs().sum(dim=0).max()))
    for name in ("EW", "PCGrad"):
        direction = compare.libmtl_direction(name, rows)
        torch.testing.assert_close(direction, expected, rtol=0, atol=atol)


def test_docs_example_is_the_tested_one_and_it_trains() -> None:
    source = (ROOT / "examples" / "mtl_quickstart.py").read_text()
    snippet = source.split("# snippet start\n")[1].split("# snippet end")[0]
    snippet = textwrap.dedent(snippet).strip()
    assert len(snippet.splitlines()) <= 15
    # The multi-task page shows it (marked not-run there: tests/test_docs_code.py skips it).
    assert f"```python\n{snippet}\n```" in (ROOT / "docs" / "mtl.md").read_text()

    spec = importlib.util.spec_from_file_location("quickstart", ROOT / "examples/mtl_quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    history = module.train(steps=120)
    start, end = history[:10].mean(dim=0), history[-10:].mean(dim=0)
    assert (end < 0.5 * start).all(), (start, end)
