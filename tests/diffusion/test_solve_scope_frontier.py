"""The solve-scope frontier's report, on runs written here with known numbers: the
conflict share and its interval, throughput ratios with the probe's time left out,
seed-std separations and the recommended setting's rule; the interval against a brute-force
inversion of the score test."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed
    sys.path.insert(0, str(ROOT))

from benchmarks.mini.runs import Method, RunResult  # noqa: E402
from benchmarks.mini.solve_scope import (  # noqa: E402
    recommended,
    wilson_interval,
    write_frontier,
)
from miniature.recipe import TRAIN_REWARDS  # noqa: E402


@pytest.mark.parametrize(("hits", "total"), [(0, 160), (3, 160), (80, 160), (7, 8), (8, 8)])
def test_the_wilson_interval_is_where_the_score_test_accepts(hits: int, total: int) -> None:
    """Every p in the interval, and none outside, has |share - p| <= z sqrt(p(1-p)/n)."""
    low, high = wilson_interval(hits, total)
    grid = np.linspace(0, 1, 200_001)
    share = hits / total
    accepted = grid[np.abs(share - grid) <= 1.96 * np.sqrt(grid * (1 - grid) / total)]
    assert math.isclose(low, accepted.min(), abs_tol=1e-5)
    assert math.isclose(high, accepted.max(), abs_tol=1e-5)


def _run(tmp: Path, key: str, seed: int, *, lows: list[float], train: float, probe: float,
         solved: list[int], rewards: dict[str, float]) -> RunResult:  # fmt: skip
    """A finished run: one epoch of ``len(lows)`` steps, its times and held-out means."""
    run_dir, eval_dir = tmp / "runs" / key / f"s{seed}", tmp / "evals" / key / f"s{seed}"
    run_dir.mkdir(parents=True)
    eval_dir.mkdir(parents=True)
    steps = [
        {"harmonize/cos_min": low, "harmonize/cos_var": 0.1, "solved": s}
        for low, s in zip(lows, solved, strict=True)
    ]
    record = {"time/train": train + probe, "time/probe": probe, "time/rollout": 1.0,
              "time/reward": 0.0, "optimizer_steps": steps}  # fmt: skip
    (run_dir / "metrics.jsonl").write_text(json.dumps(record) + "\n")
    metrics = {name: {"mean": rewards.get(name, 0.5)} for name in TRAIN_REWARDS}
    (eval_dir / "summary.json").write_text(json.dumps({"metrics": metrics}))
    return RunResult(Method(key, key), seed, run_dir, eval_dir)


def test_the_frontier_reads_conflicts_costs_and_learning_off_the_runs(tmp_path: Path) -> None:
    first, second = TRAIN_REWARDS[0], TRAIN_REWARDS[1]
    results = []
    for seed, shift in enumerate((-0.01, 0.0, 0.01)):
        common = {"solved": [1, 1, 1, 1]}
        results += [
            _run(tmp_path, "weighted_sum", seed, lows=[-0.2, 0.1, -0.1, 0.3], train=4.0,
                 probe=9.0, rewards={first: 0.50 + shift}, **common),
            # exact every step: no conflicts, twice the training time
            _run(tmp_path, "step_every", seed, lows=[0.3] * 4, train=8.0, probe=0.0,
                 rewards={first: 0.60 + shift, second: 0.7 + shift}, **common),
            # cheap and conflict-free, but loses the second reward to the exact solve
            _run(tmp_path, "cheap", seed, lows=[0.2] * 4, train=4.4, probe=5.0,
                 rewards={first: 0.60 + shift, second: 0.5 + shift}, **common),
            _run(tmp_path, "middle", seed, lows=[0.1] * 4, train=5.0, probe=5.0,
                 rewards={first: 0.60 + shift, second: 0.695 + shift}, **common),
            _run(tmp_path, "noise_control", seed, lows=[0.0] * 4, train=4.0, probe=0.0,
                 rewards={first: 0.40 + shift}, **common),
        ]  # fmt: skip
    cost = {"rows": [{"row": {"strategy": "cheap"}, "train_throughput": 0.97,
                      "epoch_throughput": 0.98}]}  # fmt: skip
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    report = write_frontier(results, tmp_path, cost_file=tmp_path / "cost.json")
    rows = {row["key"]: row for row in report["rows"]}
    assert "noise_control" not in rows
    assert rows["weighted_sum"]["conflict_share"] == 0.5
    assert rows["weighted_sum"]["conflict_interval"] == list(wilson_interval(2, 4))
    assert math.isclose(rows["weighted_sum"]["mean_min_cos"], 0.025)
    # the probe's seconds are not the method's: 4 s of training against 8 s and 5 s
    assert math.isclose(rows["step_every"]["train_throughput"][0], 0.5)
    assert math.isclose(rows["middle"]["train_throughput"][0], 0.8)
    assert math.isclose(rows["middle"]["epoch_throughput"][0], 5.0 / 6.0)
    # seed std 0.01 everywhere: 0.1 apart is 10 pooled stds
    assert math.isclose(rows["step_every"]["versus_weighted_sum"][first], 10.0)
    assert math.isclose(rows["step_every"]["versus_control"][first], 20.0)
    assert math.isclose(rows["cheap"]["versus_exact"][second], -20.0)
    # cheapest admissible: "cheap" loses a reward by > 1 sd, so "middle" (-0.5 sd) is chosen
    assert report["recommended"] == "middle"
    text = (tmp_path / "frontier.md").read_text()
    assert "**middle**" in text and (tmp_path / "frontier.png").stat().st_size > 10_000
    # the side-by-side bench's ratio where it timed the row, the runs' own elsewhere
    assert rows["cheap"]["bench_train"] == 0.97 and "bench_train" not in rows["middle"]
    assert "| cheap | 0.0% (0.0-49.0) of 4 | +0.200 | 100% | 0.97x | 0.98x | 0.91x" in text


def test_no_setting_is_recommended_when_every_one_conflicts() -> None:
    row = {"conflict_share": 0.3, "versus_exact": None, "train_throughput": [1.0, 0.0]}
    assert recommended([row]) is None
