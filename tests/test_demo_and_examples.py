"""The demo and the examples run end to end at a tiny size and write what they promise."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path
from types import ModuleType

import pytest
import torch

from benchmarks.toys import demo
from mogradient import HARMONIZERS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def numbers(value: object) -> list[float]:
    if isinstance(value, dict):
        return [number for item in value.values() for number in numbers(item)]
    if isinstance(value, list):
        return [number for item in value for number in numbers(item)]
    return [float(value)] if isinstance(value, int | float) and not isinstance(value, bool) else []


def test_demo_writes_tables_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = demo.main(["--out", str(tmp_path / "demo"), "--steps", "3", "--workers", "2"])
    assert str(out.resolve()) in capsys.readouterr().out
    summary = json.loads((out / "results.json").read_text())
    methods = [name for name in HARMONIZERS if name not in demo.SKIPPED]
    for problem in ("cagrad_toy", "triangle_quadratics"):
        rows = summary["problems"][problem]
        assert list(rows) == methods
        assert all("error" not in row for row in rows.values()), rows
        values = numbers(rows)
        assert values and all(math.isfinite(value) for value in values)
        for suffix in ("parameter_space", "cosines", "weights", "losses"):
            assert (out / f"{problem}_{suffix}.png").stat().st_size > 1000
    assert (out / "cagrad_toy_objective_space.png").stat().st_size > 1000
    markdown = (out / "results.md").read_text()
    assert "| mgda |" in markdown and "Literature" in markdown


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--steps", "0"], "positive integer"),
        (["--steps", "many"], "positive integer"),
        (["--lr", "-1"], "positive number"),
        (["--methods", "mgda,nope"], "unknown harmonizer"),
        (["--methods", "fixed"], "unknown harmonizer"),
    ],
)
def test_demo_rejects_bad_arguments(
    arguments: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        demo.main(arguments)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_rejects_a_file_as_output_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    taken = tmp_path / "taken"
    taken.write_text("")
    with pytest.raises(SystemExit):
        demo.main(["--out", str(taken)])
    assert "not a folder" in capsys.readouterr().err


def test_toy_trajectories_example(tmp_path: Path) -> None:
    out = load_example("toy_trajectories").main(
        ["--out", str(tmp_path), "--steps", "3", "--starts", "2"]
    )
    assert (out / "parameter_space.png").stat().st_size > 1000
    assert (out / "objective_space.png").stat().st_size > 1000


def test_multitask_mlp_example(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = load_example("multitask_mlp").main(
        ["--out", str(tmp_path), "--steps", "5", "--batch", "16", "--harmonizers", "mgda,mean"]
    )
    printed = capsys.readouterr().out
    assert "classification" in printed and "mean" in printed
    assert (out / "losses.png").stat().st_size > 1000


def test_instance_wise_gram_example_learns_and_its_gram_is_the_per_sample_one() -> None:
    """The example's Gram equals per-sample gradients formed one by one, and it trains."""
    pytest.importorskip("sklearn")
    example = load_example("instance_wise_gram")
    history = example.main(["--steps", "60"])
    assert float(history[-10:].mean()) < 0.5 * float(history[:10].mean())

    from torch import nn
    from torch.nn import functional

    from mogradient.combinable import CombinableLoss
    from mogradient.engines import RowGradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).double()
    images, labels = next(example.digit_batches(1, batch=12))
    parameters = list(model.parameters())
    engine = RowGradients(model, parameters)
    with engine.recording():
        losses = functional.cross_entropy(model(images.double()), labels, reduction="none")
    gram = engine.gram(CombinableLoss.instance_wise(losses), retain_graph=True)
    rows = [
        torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, parameters, retain_graph=True)])
        for loss in losses
    ]
    jacobian = torch.stack(rows)
    torch.testing.assert_close(gram, jacobian @ jacobian.T, rtol=1e-12, atol=0)
