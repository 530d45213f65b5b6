"""Every benchmark script's ``--quick`` mode, end to end: a script nobody runs rots.

bench_trainer.py did: its wrapper pinned an old ``Trainer.optimizer_step_on`` signature and
crashed on the first step. bench_gpu.py (tests/test_bench_gpu.py, ``--shape small``) and
benchmarks/mtl (tests/test_mtl_benchmark.py) have their own smoke runs.

A ``--quick`` run writes results only where ``--out`` says (here ``tmp_path``): a smoke
run never replaces the committed results.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"


def _run_quick(script: Path, *options: str) -> subprocess.CompletedProcess[str]:
    """``python <script> --quick`` in a fresh process, as a user would run it; must exit 0."""
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, str(script), "--quick", *options],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result


def _results_state() -> dict[str, int]:
    """Modification times of the committed results, to check a run left them alone."""
    return {str(path): path.stat().st_mtime_ns for path in RESULTS.rglob("*") if path.is_file()}


def _load(folder: Path, name: str) -> dict[str, Any]:
    assert (folder / f"{name}.md").stat().st_size > 0
    return json.loads((folder / f"{name}.json").read_text())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("tesseract") is None, reason="the ocr reward needs tesseract")
def test_trainer_benchmark_quick_times_every_strategy_and_writes_nothing() -> None:
    """Three real training runs through the --child wrapper; the report comes out on stdout."""
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    before = _results_state()
    result = _run_quick(BENCHMARKS / "bench_trainer.py")
    out = result.stdout

    assert "# Training loop: weighted sum vs MARBLE (tiny preset, CPU)" in out
    for strategy in ("weighted_sum", "marble_amortized", "marble_every_step"):
        assert f"] {strategy}_r0: train " in out
    assert "solved 8/8" in out.split("marble_every_step_r0:")[1].splitlines()[0]
    # The wrapper timed optimizer_step_on (where the old signature crashed).
    step_row = re.search(r"\| MARBLE every step \(N=1\) \| (\d+\.\d+) \| n/a \|", out)
    assert step_row is not None and float(step_row.group(1)) > 0
    assert "## Against the paper's targets" in out
    assert "wrote " not in out
    assert _results_state() == before


@pytest.mark.slow
def test_gradient_engines_quick_writes_every_engine(tmp_path: Path) -> None:
    """Every engine timed, measured for memory in its own process, and agreeing."""
    result = _run_quick(BENCHMARKS / "bench_gradient_engines.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "gradient_engines")

    assert payload["mode"] == "quick" and payload["repeats"] == 3
    engines = payload["engines"]
    assert "single backward (sum of losses)" in engines and len(engines) >= 4
    for name, entry in engines.items():
        assert len(entry["times_ms"]) == 3 and entry["median_ms"] > 0, name
        assert entry["peak_mib"] > 0, name
        assert entry["max_rel_diff"] < 1e-4, name
        assert f"| {name} |" in result.stdout
    assert "| engine | wall ms |" in result.stdout


def test_representation_quick_times_every_mode_against_torchjd(tmp_path: Path) -> None:
    """Our trunk and MGDA-UB backward beside TorchJD's mtl_backward, timed and measured."""
    pytest.importorskip("torchjd", reason="the benchmark compares against TorchJD")
    result = _run_quick(BENCHMARKS / "bench_representation.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "representation")

    assert payload["mode"] == "quick" and payload["rows"]
    for row in payload["rows"]:
        assert len(row["median_ms"]) >= 3 and all(v > 0 for v in row["median_ms"].values())
        assert all(value >= 0 for value in row["peak_mib"].values())
        assert row["trunk_vs_torchjd_max_rel_diff"] < 1e-4
    assert "| K |" in result.stdout + (tmp_path / "representation.md").read_text()


def test_mgda_exactness_quick_writes_cases_and_stress(tmp_path: Path) -> None:
    """The two quick cases and the stress stacks, with all three printed tables."""
    pytest.importorskip("torchjd", reason="the benchmark compares against TorchJD")
    result = _run_quick(BENCHMARKS / "bench_mgda_exactness.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "mgda_exactness")

    assert payload["mode"] == "quick"
    cases = [(case["num_objectives"], case["dim"]) for case in payload["cases"]]
    assert cases == [(2, 1_000_000), (5, 1_000_000)]
    assert all(case["methods"] for case in payload["cases"])
    assert payload["stress"]
    for heading in ("Speed", "MGDA", "UPGrad", "Stress stacks"):
        assert f"\n{heading}\n" in result.stdout
    assert "| K | D |" in result.stdout


@pytest.mark.slow
def test_engine_cost_quick_times_both_engines(tmp_path: Path) -> None:
    """The weighted sum and every-step MARBLE with each engine on the mini recipe."""
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    _run_quick(BENCHMARKS / "bench_engine_cost.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "engine_cost")
    rows = {(r["row"]["strategy"], r["row"]["engine"]): r for r in payload["rows"]}
    assert set(rows) == {
        ("weighted_sum", "auto"),
        ("marble_every_step", "auto"),
        ("marble_every_step", "batched"),
    }
    assert rows[("marble_every_step", "auto")]["engines"] == ["rows"]
    assert rows[("marble_every_step", "batched")]["engines"] == ["batched"]
    every = rows[("marble_every_step", "auto")]
    assert every["solved"] == every["steps"] > 0 and every["train_throughput"] > 0
    assert rows[("weighted_sum", "auto")]["skipped"] < rows[("weighted_sum", "auto")]["steps"]


@pytest.mark.slow
def test_remote_overlap_quick_times_sequential_and_overlapped_scoring(tmp_path: Path) -> None:
    """The miniature recipe with its rewards served at 0.5 s a request, scored after
    sampling and overlapped with it (the in-process rows only in the full run)."""
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    before = _results_state()
    result = _run_quick(BENCHMARKS / "bench_remote_overlap.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "remote_overlap")
    rows = {row["row"]: row for row in payload["rows"]}
    assert set(rows) == {"remote_sequential", "remote_overlap"}
    # Overlapped, most of the servers' 2 s an epoch hides behind sampling.
    assert rows["remote_overlap"]["reward_s"] < rows["remote_sequential"]["reward_s"] - 0.5
    assert all(row["epoch_s"] > 0 and row["speedup"] > 0 for row in rows.values())
    assert rows["remote_sequential"]["max_mean_difference"] == 0  # the reference
    assert rows["remote_overlap"]["max_mean_difference"] < 1e-3  # the same run, in chunks
    assert "| remote_overlap |" in result.stdout
    assert _results_state() == before


def test_instance_gram_quick_compares_with_torchjd(tmp_path: Path) -> None:
    """Both models, both methods: times, memory, and errors at float32 round-off."""
    pytest.importorskip("torchjd", reason="the benchmark compares against TorchJD")
    _run_quick(BENCHMARKS / "bench_instance_gram.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "instance_gram")
    assert [case["model"] for case in payload["cases"]] == ["mlp", "transformer"]
    for case in payload["cases"]:
        assert set(case["median_ms"]) == {"mogradient", "torchjd", "forward + backward"}
        assert all(error < 1e-5 for error in case["relative_error"].values())
        assert all(value >= 0 for value in case["peak_growth_mib"].values())


def test_memory_estimate_benchmark_quick_checks_each_family_and_writes_only_out(
    tmp_path: Path,
) -> None:
    """One scaled-down case per family measured on CPU, every recipe tabulated (FSDP2 rows
    included), results only under --out."""
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    before = _results_state()
    _run_quick(BENCHMARKS / "bench_memory_estimate.py", "--out", str(tmp_path))
    payload = _load(tmp_path, "memory_estimate")
    assert sorted({case["family"] for case in payload["validation"]}) == [
        "flux",
        "qwen_image",
        "sd3",
    ]
    for case in payload["validation"]:  # a profiled peak moves ~1% between runs
        for mode in case["modes"].values():
            assert mode["estimated_bytes"] >= 0.95 * mode["measured_bytes"] > 0
    for recipe in payload["recipes"].values():
        assert any(setting.startswith("FSDP2 over 8 GPUs") for setting in recipe["totals"])
    assert _results_state() == before


@pytest.mark.slow
def test_engine_cost_quick_times_the_solve_scope_settings(tmp_path: Path) -> None:
    """The weighted sum and a one-micro-step solve on the 16-micro-step variant."""
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    _run_quick(BENCHMARKS / "bench_engine_cost.py", "--solve-scope", "--out", str(tmp_path))
    payload = _load(tmp_path, "solve_scope_cost")
    rows = {r["row"]["strategy"]: r for r in payload["rows"]}
    assert set(rows) == {"weighted_sum", "micro_step_every"}
    assert all(r["row"]["recipe"] == "mini_many" for r in rows.values())
    solve = rows["micro_step_every"]
    assert solve["solved"] == solve["steps"] > 0 and solve["engines"] == ["rows"]
    assert solve["train_throughput"] > 0
