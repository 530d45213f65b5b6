"""The miniature world's prompts and the head-to-head runner at its minimal budget: the
shipped base model loads, every method trains and evaluates, the report files are written
with finite metrics. Who wins is not asserted."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # benchmarks/ is not installed; `python -m pytest` adds it too
    sys.path.insert(0, str(ROOT))

from benchmarks.mini import benchmark  # noqa: E402
from benchmarks.mini.benchmark import (  # noqa: E402
    COST_EPOCHS,
    MODES,
    cost_methods,
    jobs_of,
    main,
    methods,
    objective_methods,
    run_one,
)
from benchmarks.mini.report import (  # noqa: E402
    _conflict_rows,
    _control_rows,
    _rising_rows,
    _staleness_rows,
    rising_table,
)
from benchmarks.mini.runs import Method, RunResult  # noqa: E402
from miniature.recipe import (  # noqa: E402
    BASE_MODEL,
    CONFIG,
    HELD_OUT,
    TRAIN_REWARDS,
    write_prompt_files,
)
from miniature.world import all_prompts, split_prompts, vocabulary  # noqa: E402
from mogradient_diffusion.prompts.sources import load_prompt_file  # noqa: E402


def test_prompt_split_is_fixed_disjoint_and_covers_every_source():
    train, held_out = split_prompts(seed=0)
    again, _ = split_prompts(seed=0)
    assert train == again
    for source, prompts in all_prompts().items():
        texts = {p.text for p in prompts}
        assert {p.text for p in train[source]} | {p.text for p in held_out[source]} == texts
        assert not {p.text for p in train[source]} & {p.text for p in held_out[source]}
    assert {"sign", "circle", "left", "of"} <= set(vocabulary())


def test_report_and_package_import_nothing_of_the_runner():
    """No import circle: report reads runs and the recipe, never the runner that calls it;
    the installed package needs nothing from benchmarks/."""
    code = (
        "import sys\n"
        "import miniature, miniature.recipe\n"
        "assert not [m for m in sys.modules if m.startswith('benchmarks')]\n"
        "import benchmarks.mini.report\n"
        "assert 'benchmarks.mini.benchmark' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_prompt_files_keep_metadata_and_mix_sources_in_every_prefix(tmp_path):
    directory = write_prompt_files(tmp_path)
    held_out = load_prompt_file(directory / "heldout.jsonl")
    tags = [meta["tag"] for meta in held_out.metadata]
    first = {"general" if t == "general" else "text" if t == "text" else "comp" for t in tags[:3]}
    assert first == {"general", "text", "comp"}
    for source in ("counting", "binding"):
        compositional = load_prompt_file(directory / f"{source}.jsonl")
        assert all("include" in meta for meta in compositional.metadata)


def test_full_mode_has_every_row_the_issue_names():
    keys = [m.key for m in methods(MODES["full"])]
    for key in ("base", "weighted_sum", "sequential", "reward_dropout", "pcgrad", "marble",
                "marble_no_norm", "marble_fixed_alpha", "marble_every_step", "noise_control",
                "marble_smoothed", "marble_released", "gdpo"):  # fmt: skip
        assert key in keys
    assert sum(k.startswith("single_") for k in keys) == len(TRAIN_REWARDS)
    assert sum(k.startswith("marble_rho") for k in keys) == 4
    seeds = {}
    for method, seed in jobs_of(MODES["full"]):
        seeds.setdefault(method.key, set()).add(seed)
    assert seeds["marble"] == seeds["noise_control"] == {0, 1, 2}  # main rows: 3 seeds
    assert seeds["marble_every_step"] == seeds["marble_released"] == seeds["gdpo"] == {0, 1, 2}
    assert seeds["marble_rho0.1"] == seeds["marble_smoothed"] == {0, 1}  # ablations: 2
    assert seeds["base"] == {0}
    assert not any(key.startswith(("flow_grpo", "sdpo")) for key in seeds)  # their own mode
    objective_seeds = {}
    for method, seed in jobs_of(MODES["objectives"]):
        objective_seeds.setdefault(method.key, set()).add(seed)
    assert objective_seeds["flow_grpo_marble"] == objective_seeds["sdpo_weighted_sum"] == {0, 1}
    assert objective_seeds["marble"] == seeds["marble"]  # the NFT rows, reused from full's work
    assert MODES["objectives"].epochs == MODES["full"].epochs


def test_cost_runs_train_fewer_epochs_than_the_budget(tmp_path):
    from mogradient_diffusion.training_config import load_config

    for method in cost_methods():
        config = load_config(
            CONFIG, overrides=[f"model.path={BASE_MODEL}", f"prompts.directory={tmp_path}",
                               f"run.directory={tmp_path / 'run'}",
                               f"train.epochs={MODES['full'].epochs}", *method.overrides],
        )  # fmt: skip
        assert config.train.epochs == COST_EPOCHS < MODES["full"].epochs


@pytest.mark.parametrize("reward", TRAIN_REWARDS)
def test_specialists_train_on_every_prompt_their_reward_scores_and_no_other(tmp_path, reward):
    import miniature  # noqa: F401
    from mogradient_diffusion.rewards.registry import make_reward
    from mogradient_diffusion.training_config import load_config

    method = next(m for m in methods(MODES["full"]) if m.key == f"single_{reward}")
    config = load_config(
        CONFIG, overrides=[f"model.path={BASE_MODEL}", f"prompts.directory={tmp_path}",
                           f"run.directory={tmp_path / 'run'}", *method.overrides],
    )  # fmt: skip
    kept = {source.name for source in config.prompts.sources}
    train, _ = split_prompts(seed=0)
    scorer = make_reward(reward)
    for source, prompts in train.items():
        scores = scorer(
            torch.zeros(len(prompts), 3, 8, 8),
            [p.text for p in prompts],
            [p.metadata for p in prompts],
        )
        assert (source in kept) == bool((~torch.isnan(scores)).any()), source
        if source in kept:
            assert not torch.isnan(scores).any(), f"{reward} skips some {source} prompts"


@pytest.mark.parametrize(
    ("objective", "strategy"), [("flow_grpo", "weighted_sum"), ("sdpo", "marble")]
)
def test_objective_rows_are_valid_recipes(tmp_path, objective, strategy):
    from mogradient_diffusion.training_config import load_config

    method = next(m for m in objective_methods() if m.key == f"{objective}_{strategy}")
    config = load_config(
        CONFIG, overrides=[f"model.path={BASE_MODEL}", f"prompts.directory={tmp_path}",
                           f"run.directory={tmp_path / 'run'}", *method.overrides],
    )  # fmt: skip
    assert (config.objective.name, config.strategy.name) == (objective, strategy)
    assert config.rollout.sampler == "sde"


def test_methods_are_compared_with_the_noise_control_in_pooled_seed_std():
    def row(key, mean, std):
        return {"key": key, "label": key, "mean": {"r": mean}, "std": {"r": std}}

    rows = [row("base", 0.1, math.nan), row("noise_control", 0.2, 0.03), row("m", 0.5, 0.04)]
    (compared,) = _control_rows(rows, ["r"])
    assert compared["key"] == "m"
    assert compared["rewards"]["r"]["difference"] == pytest.approx(0.3)
    assert compared["rewards"]["r"]["separation"] == pytest.approx(0.3 / math.sqrt(0.00125))
    assert _control_rows([row("m", 0.5, 0.04)], ["r"]) == []  # no control row: no table


def test_staleness_groups_cached_steps_by_steps_since_their_solve(tmp_path):
    steps = [
        {"solved": 1, "harmonize/cos_min": 0.2},
        {"solved": 0, "harmonize/cos_min": 0.1, "stale/steps_since_solve": 1.0,
         "stale/cos_to_fresh": 0.9, "stale/fresh_cos_min": 0.3},
        {"solved": 0, "harmonize/cos_min": -0.1, "stale/steps_since_solve": 2.0,
         "stale/cos_to_fresh": 0.5, "stale/fresh_cos_min": 0.2},
        {"solved": 0, "harmonize/cos_min": 0.3, "stale/steps_since_solve": 2.0,
         "stale/cos_to_fresh": 0.7, "stale/fresh_cos_min": 0.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"optimizer_steps": steps}) + "\n")
    marble = RunResult(Method("marble", "MARBLE"), 0, tmp_path, tmp_path / "eval")
    rows = _staleness_rows([marble, RunResult(Method("weighted_sum", "ws"), 0, None, tmp_path)])
    assert [(r["steps_since_solve"], r["steps"]) for r in rows] == [(1, 1), (2, 2)]
    assert rows[1]["mean_cos_to_fresh"] == pytest.approx(0.6)
    assert rows[1]["min_cos_to_fresh"] == pytest.approx(0.5)
    assert rows[1]["applied_negative_fraction"] == pytest.approx(0.5)
    assert rows[1]["fresh_mean_min_cos"] == pytest.approx(0.1)


def test_rising_rows_compare_the_first_and_last_third_of_the_training_curve(tmp_path):
    def run(key, seed, values, table="main"):
        directory = tmp_path / f"{key}_{seed}"
        directory.mkdir()
        records = [{"optimizer_steps": [], "reward/r/mean": v, "reward/o/mean": v} for v in values]
        (directory / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
        strategy = {"name": "single", "reward": "r"} if key.startswith("single") else {}
        (directory / "config.yaml").write_text(json.dumps({"strategy": strategy}))
        return RunResult(Method(key, key, table=table), seed, directory, directory / "eval")

    results = [
        run("m", 0, [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]),
        run("m", 1, [0.3, None, 0.3, 0.5, 0.5, 0.7, 0.7]),  # no score that epoch: skipped
        run("short", 0, [0.1, 0.9]),  # too short to have thirds
        run("ablation", 0, [0.1, 0.2, 0.3], table="ablations"),
        run("single_r", 0, [0.1, 0.2, 0.3]),  # logs "o" too, but trains only on "r"
    ]
    row, single = _rising_rows(results, ["r", "o", "other"])
    assert row["key"] == "m" and set(row["rewards"]) == {"r", "o"}
    assert single["key"] == "single_r" and set(single["rewards"]) == {"r"}
    assert row["rewards"]["r"]["first"] == pytest.approx((0.15 + 0.3) / 2)
    assert row["rewards"]["r"]["last"] == pytest.approx((0.55 + 0.7) / 2)
    assert "| m | 0.225 -> 0.625 |  |" in rising_table([row], ["r", "other"])


def test_conflict_rows_count_a_run_only_where_it_logged_every_step(tmp_path):
    def run(seed, steps):
        directory = tmp_path / f"s{seed}"
        directory.mkdir()
        (directory / "metrics.jsonl").write_text(json.dumps({"optimizer_steps": steps}) + "\n")
        return RunResult(Method("marble", "MARBLE"), seed, directory, directory / "eval")

    def solve(cos):
        return {"solved": 1, "harmonize/cos_min": cos, "harmonize/cos_var": 0.01}

    cached = {"solved": 0, "harmonize/cos_min": -0.2, "harmonize/cos_var": 0.1}
    stationary = {"solved": 0, "harmonize/stationary": 1.0}
    probed = run(0, [solve(0.3), cached, stationary])
    unprobed = run(1, [solve(0.1), {"solved": 0}])  # cached steps log no cosines unprobed
    rows = {row["label"]: row for row in _conflict_rows([probed, unprobed])}
    every = rows["MARBLE (N=10, rho 0.7), all steps"]
    assert (every["seeds"], every["steps"], every["negative_fraction"]) == (1, 2, 0.5)
    solves = rows["MARBLE: its full-solve steps"]
    assert (solves["seeds"], solves["steps"]) == (2, 2)
    assert solves["mean_min_cos"] == pytest.approx(0.2)
    assert rows["MARBLE: its cached-weight steps"]["seeds"] == 1


def test_only_seed_zero_runs_the_conflict_probe(tmp_path, monkeypatch):
    commands = []

    def child(command, log):
        commands.append(command)
        raise StopIteration  # the training command is all this test needs

    monkeypatch.setattr(benchmark, "_child", child)
    marble = next(m for m in methods(MODES["full"]) if m.key == "marble")
    for seed in (0, 1):
        with pytest.raises(StopIteration):
            run_one(marble, seed, MODES["full"], tmp_path, tmp_path, BASE_MODEL)
    probes = [next(a for a in c if a.startswith("run.conflict_probe=")) for c in commands]
    assert probes == ["run.conflict_probe=true", "run.conflict_probe=false"]


@pytest.mark.slow
def test_minimal_head_to_head_writes_tables_plots_and_grids(tmp_path):
    assert (BASE_MODEL / "model_index.json").is_file()
    out = tmp_path / "mini"
    assert main(["--mode", "test", "--out", str(out), "--workers", "2"]) == 0
    report = json.loads((out / "results.json").read_text())
    keys = ["base", "single_mini_sign", "weighted_sum", "marble"]
    assert [row["key"] for row in report["rows"]] == keys
    for row in report["rows"]:
        for name in (*TRAIN_REWARDS, *HELD_OUT):
            assert math.isfinite(row["mean"][name]), (row["key"], name)
    assert [row["key"] for row in report["conflict"]][:2] == ["weighted_sum", "marble"]
    assert all(row["steps"] > 0 for row in report["conflict"])
    for name in ("table.md", "conflict.md", "curves.png", "weights.png"):
        assert (out / name).stat().st_size > 0
    assert {p.name for p in (out / "grids").iterdir()} == {f"{key}.png" for key in keys}
    rebuilt = tmp_path / "rebuilt"  # --report-only into a folder that does not exist yet
    argv = ["--mode", "test", "--out", str(rebuilt), "--work", str(out / "work"), "--report-only"]
    assert main(argv) == 0
    tables = [(d / "table.md").read_text().split("\n")[4:] for d in (out, rebuilt)]
    assert tables[0] == tables[1]  # all but the title and the run's wall time


def test_resumed_head_to_head_redoes_no_finished_work(tmp_path, monkeypatch):
    calls = []

    def child(command, log):  # records which CLI command would have run
        calls.append(command[3])
        return 1.0, 1.0

    monkeypatch.setattr(benchmark, "_child", child)
    method = Method("marble", "MARBLE")
    evaluated = tmp_path / "evals" / "marble" / "s0"
    evaluated.mkdir(parents=True)
    (evaluated / "summary.json").write_text("{}")
    run_dir = tmp_path / "runs" / "marble" / "s0"
    run_dir.mkdir(parents=True)
    (run_dir / "process.json").write_text(json.dumps({"seconds": 12.5, "peak_rss_mib": 300}))
    result = benchmark.run_one(method, 0, MODES["test"], tmp_path, tmp_path, tmp_path)
    assert calls == [] and result.train_seconds == 12.5
    (tmp_path / "runs" / "marble" / "s1" / "lora").mkdir(parents=True)  # trained, not evaluated
    benchmark.run_one(method, 1, MODES["test"], tmp_path, tmp_path, tmp_path)
    assert calls == ["eval"]
    benchmark.run_one(method, 2, MODES["test"], tmp_path, tmp_path, tmp_path)  # nothing yet
    assert calls == ["eval", "train", "eval"]


def test_only_runs_the_named_rows_and_refuses_unknown_ones(tmp_path, monkeypatch):
    """--only: the named methods' (method, seed) jobs and no other; a typo is one line."""
    ran = []

    def run(method, seed, budget, work, prompts, model):
        ran.append((method.key, seed))
        raise StopIteration  # the job list is all this test needs

    monkeypatch.setattr(benchmark, "run_one", run)
    with pytest.raises(StopIteration):
        benchmark.run_benchmark(
            "full", tmp_path / "out", tmp_path / "work", 1, only=("marble_every_step",)
        )
    assert sorted(ran) == [("marble_every_step", seed) for seed in (0, 1, 2)]
    assert main(["--mode", "full", "--out", str(tmp_path), "--only", "marble_evry_step"]) == 2
