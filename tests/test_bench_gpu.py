"""The GPU benchmark's CPU smoke run: end to end through the real trainer, schema, labels.

No GPU is needed: ``--shape small`` runs every stage (matmul peak, FLOP counts, rollout,
the three strategies with and without checkpointing, the one-process torchrun check) on a
tiny model, so that a session with an H100/H200 only has to run ``--shape sd35m``; the
FLUX.1-dev and Qwen-Image shapes' tiny twins run ``--quick`` (seconds each). What a short
lease relies on is checked here too: ``benchmarks/gpu_lease.sh --smoke`` end to end within
the returned-file limit, a failing row that costs no other row, results on disk after every
epoch of a killed run, the time budget, and the size of what a device call carries.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "bench_gpu.py"
LEASE = BENCHMARKS / "gpu_lease.sh"
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
# Our MARBLE rows twice (per-row engine, K backward passes), MARBLE as released once.
STRATEGIES = (
    "weighted_sum",
    "marble_amortized",
    "marble_every_step",
    "marble_released",
    "marble_amortized_k_backward",
    "marble_every_step_k_backward",
)
AMORTIZED = ("marble_amortized", "marble_amortized_k_backward", "marble_released")
MODES = ("checkpointing_off", "checkpointing_on")


def _run(out: Path, *extra: str, shape: str = "small") -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), f"--shape={shape}", "--device=cpu", f"--out={out}"]
    return subprocess.run(
        [*command, "--rounds=1", "--repeats=1", *extra],
        env=ENVIRONMENT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run_patched(out: Path, patch: str, *extra: str) -> subprocess.CompletedProcess:
    """``bench_gpu.main`` of a ``--quick`` small-shape run after ``patch`` (Python run with
    ``bench_gpu`` imported): a planted failure or kill, which the script has no flag for."""
    argv = ["--shape=small", "--device=cpu", f"--out={out}", "--quick", *extra]
    code = f"import sys, bench_gpu\n{textwrap.dedent(patch)}\nsys.exit(bench_gpu.main({argv!r}))"
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=BENCHMARKS,
        env=ENVIRONMENT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_small_shape_cpu_smoke_run_writes_the_full_schema(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu_cpu.json").read_text())
    markdown = (tmp_path / "gpu_cpu.md").read_text()

    assert payload["smoke_run"] is True and payload["device"]["type"] == "cpu"
    assert payload["finished"] is True and payload["stopped_early"] is None
    assert payload["failures"] == {} and payload["stage"].startswith("done")
    assert "CPU smoke run, not a result" in markdown and "Unfinished" not in markdown
    assert {"torch", "diffusers", "peft", "transformers"} <= set(payload["versions"])
    assert payload["shape"]["name"] == "small"
    assert "precomputed random embeddings" in payload["setup"]["text_embeddings"]
    assert "stand-in" in payload["setup"]["rewards"]
    assert payload["setup"]["lora"]["rank"] == 32  # the recipe's LoRA
    assert payload["peak_matmul"]["tflops"] > 0
    assert (
        payload["flops"]["per_objective_per_sample_timestep"]
        > (payload["flops"]["combined_per_sample_timestep"])
    )
    # On the CPU these backward kernels have no vmap batching rule (measured).
    assert "aten::gelu_backward" in payload["flops"]["k_backward_vmap_fallbacks"]
    for steps in ("10", "25"):
        rollout = payload["rollout"]["steps"][steps]
        assert rollout["images_per_s"] > 0 and 0 < rollout["mfu"] < 1

    for mode in MODES:
        summary = payload["training"][mode]["summary"]
        assert set(summary) == set(STRATEGIES)
        for name in STRATEGIES:
            item = summary[name]
            assert "error" not in item, item
            assert item["s_per_optimizer_step"] > 0 and item["peak_memory_gib"] > 0
            assert item["sample_timesteps_per_step"] == 9 * 9  # batch 9 x int(0.99 x 10)
            assert 0 < item["training_mfu"] < 1
            assert item["optimizer_steps"] == 1  # one per epoch, one measured round
        # The real code paths ran: one combined backward vs K per-reward gradients.
        assert summary["weighted_sum"]["solved_steps"] == 0
        for every_step in ("marble_every_step", "marble_every_step_k_backward"):
            assert summary[every_step]["solved_steps"] == summary[every_step]["optimizer_steps"]
            assert summary[every_step]["throughput_basis"] == "window mean"
        assert summary["marble_every_step"]["engines"] == ["rows"]
        assert summary["marble_every_step_k_backward"]["engines"] == ["batched"]
        ratios = payload["training"][mode]["ratios"]
        assert set(ratios) == set(STRATEGIES) - {"weighted_sum"}
        # The amortized rows' cache is emptied at the first measured round, so their one
        # measured step is a solve (round 0 filled the cache: it would be a cached step);
        # with no cached step there is no N-step cycle and no speed ratio, only memory.
        for name, ratio in ratios.items():
            if name in AMORTIZED:
                assert summary[name]["solved_steps"] == 1
                assert summary[name]["throughput_basis"] == "no cycle: no cached step"
                assert ratio["train_throughput"] is None and ratio["epoch_throughput"] is None
                assert ratio["peak_memory"] > 0
            else:
                assert all(value > 0 for value in ratio.values())

    ddp = payload["ddp"]
    assert ddp["ok"] and ddp["backend"] == "gloo" and ddp["world_size"] == 1
    assert ddp["collectives"]["all_reduce"] > 0 and ddp["parameters_finite"]
    assert ddp["epochs"]["marble_every_step"]["solved_steps"] == 1

    assert payload["targets"] and all(
        row["status"] == "not assessed: CPU smoke run" for row in payload["targets"]
    )


def test_small_shape_runs_in_bfloat16(tmp_path: Path) -> None:
    """The recipe's dtype: the GPU run needs the training path to work in bf16."""
    result = _run(tmp_path, "--dtype=bfloat16", "--skip-ddp", "--checkpointing=on")
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.mark.parametrize(
    ("shape", "family", "stem", "transformer"),
    [
        ("flux1dev_small", "flux", "gpu_flux1dev_cpu", "FluxTransformer2DModel"),
        ("qwen_image_small", "qwen_image", "gpu_qwen_image_cpu", "QwenImageTransformer2DModel"),
    ],
)
def test_family_shapes_quick_smoke_run(
    tmp_path: Path, shape: str, family: str, stem: str, transformer: str
) -> None:
    """The FLUX.1-dev and Qwen-Image shapes' tiny twins through every strategy, quickly."""
    from mogradient_diffusion.model.families import family_named

    result = _run(tmp_path, "--quick", shape=shape)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / f"{stem}.json").read_text())
    assert "CPU smoke run, not a result" in (tmp_path / f"{stem}.md").read_text()
    assert payload["smoke_run"] is True and payload["ddp"] == {"skipped": "--skip-ddp"}
    assert payload["shape"]["name"] == shape and payload["shape"]["family"] == family
    setup = payload["setup"]
    assert setup["transformer_class"] == transformer
    # The family recipe's LoRA: rank 64, alpha 128, the family's own targets.
    assert (setup["lora"]["rank"], setup["lora"]["alpha"]) == (64, 128.0)
    assert setup["lora"]["targets"] == list(family_named(family).lora_targets)
    assert (
        f"configs/{stem.removeprefix('gpu_').removesuffix('_cpu')}_marble.yaml"
        in (setup["lora"]["source"])
    )
    assert list(payload["rollout"]["steps"]) == ["2"]
    summary = payload["training"]["checkpointing_on"]["summary"]
    assert set(summary) == set(STRATEGIES) and set(payload["training"]) == {"checkpointing_on"}
    for name in STRATEGIES:
        assert "error" not in summary[name], summary[name]
        assert summary[name]["sample_timesteps_per_step"] == 2 * 1  # batch 2 x int(0.99 x 2)
    assert summary["marble_every_step"]["engines"] == ["rows"]
    assert summary["marble_every_step_k_backward"]["engines"] == ["batched"]
    assert summary["weighted_sum"]["solved_steps"] == 0


@pytest.mark.parametrize("shape", ["sd35m", "flux1dev", "qwen_image"])
def test_released_shapes_need_an_accelerator(tmp_path: Path, shape: str) -> None:
    result = _run(tmp_path, shape=shape)
    assert result.returncode == 2 and "needs a CUDA device" in result.stderr
    assert "_small" in result.stderr or "--shape small" in result.stderr


def test_released_shapes_build_their_pipelines_on_the_meta_device() -> None:
    """What a GPU run builds first, checked without one: each family's pipeline at the
    released sizes, created in bf16, and text embeddings of the real shapes."""
    code = """
import json, torch, bench_gpu as b
report = {}
for name in ("sd35m", "flux1dev", "qwen_image"):
    shape = b.SHAPES[name]
    pipeline = b.build_pipeline(shape, torch.device("meta"), torch.bfloat16)
    parameters = list(pipeline.transformer.parameters())
    embeds = b.RandomTextEmbeddings(shape, torch.device("cpu"), torch.bfloat16)(
        ["a", "b"], shape.text_tokens
    )
    report[name] = {
        "pipeline": type(pipeline).__name__,
        "billions": sum(p.numel() for p in parameters) / 1e9,
        "dtypes": sorted({str(p.dtype) for p in parameters}),
        "embeds": list(embeds.prompt_embeds.shape),
        "pooled": None if embeds.pooled is None else list(embeds.pooled.shape),
        "mask": embeds.mask is not None,
    }
print(json.dumps(report))
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=BENCHMARKS,
        env=ENVIRONMENT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "sd35m": ("StableDiffusion3Pipeline", 2.24, [2, 205, 4096], [2, 2048], False),
        "flux1dev": ("FluxPipeline", 11.90, [2, 128, 4096], [2, 768], False),
        "qwen_image": ("QwenImagePipeline", 20.43, [2, 256, 3584], None, True),
    }
    for name, (pipeline, billions, embeds, pooled, mask) in expected.items():
        item = report[name]
        assert item["pipeline"] == pipeline and item["dtypes"] == ["torch.bfloat16"]
        assert abs(item["billions"] - billions) < 0.01, item
        assert (item["embeds"], item["pooled"], item["mask"]) == (embeds, pooled, mask)


def test_a_failing_row_costs_no_other_row(tmp_path: Path) -> None:
    """An OOM in one row and another exception in a second are theirs alone: the other rows
    are measured, each failure keeps its type and first line, ``--strict`` exits 1."""
    planted = """
    import torch
    real_run_epoch = bench_gpu.run_epoch

    def run_epoch(trainer, timer, strategy, gradients=None):
        if strategy.amortizer.period == 1 and not strategy.gradient_free:  # every step
            if gradients.name == "rows":
                raise torch.OutOfMemoryError("planted out of memory\\nsecond line")
            raise ValueError("planted failure")
        return real_run_epoch(trainer, timer, strategy, gradients)

    bench_gpu.run_epoch = run_epoch
    """
    result = _run_patched(tmp_path, planted, "--strict")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu_cpu.json").read_text())
    assert payload["finished"] is True and payload["failures"] == {}
    summary = payload["training"]["checkpointing_on"]["summary"]
    assert summary["marble_every_step"] == {"error": "OutOfMemoryError: planted out of memory"}
    assert summary["marble_every_step_k_backward"] == {"error": "ValueError: planted failure"}
    for name in ("weighted_sum", "marble_amortized", "marble_amortized_k_backward"):
        assert summary[name]["optimizer_steps"] == 1, summary[name]
    assert "FAILED checkpointing_on marble_every_step: OutOfMemoryError" in result.stdout
    markdown = (tmp_path / "gpu_cpu.md").read_text()
    assert "| MARBLE every step (N=1) | OutOfMemoryError: planted out of memory |" in markdown


def test_a_killed_run_leaves_every_finished_epoch_on_disk(tmp_path: Path) -> None:
    """The results are rewritten after every epoch: a process killed in its 7th training
    epoch (as a lease's time limit kills it) leaves the first 6, marked unfinished."""
    kill = """
    import os
    real_run_epoch, calls = bench_gpu.run_epoch, []

    def run_epoch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 7:
            os._exit(9)
        return real_run_epoch(*args, **kwargs)

    bench_gpu.run_epoch = run_epoch
    """
    result = _run_patched(tmp_path, kill)
    assert result.returncode == 9, result.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu_cpu.json").read_text())
    assert payload["finished"] is False and payload["stage"] == "training"
    assert payload["peak_matmul"]["tflops"] > 0 and payload["rollout"]["steps"]["2"]
    epochs = payload["training"]["checkpointing_on"]["epochs"]
    assert len(epochs) == 6 and all(epoch["steps"] for epoch in epochs)
    assert "**Unfinished run.** Last written during the stage `training`" in (
        (tmp_path / "gpu_cpu.md").read_text()
    )
    assert not list(tmp_path.glob(".*.partial"))


def test_the_budget_stops_new_rounds_and_says_why(tmp_path: Path) -> None:
    """No round starts that would overrun ``--budget``: here the time kept for the torchrun
    check outgrows it once an epoch has been timed, so round 1 is left out."""
    reserve = """
    bench_gpu.ddp_reserve = lambda args, build_s, longest_epoch_s: 1e9 if longest_epoch_s else 0.0
    """
    result = _run_patched(tmp_path, reserve, "--budget=3600")
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "gpu_cpu.json").read_text())
    assert payload["finished"] is True and payload["budget_s"] == 3600
    assert payload["stopped_early"].startswith("training round 1 not started")
    training = payload["training"]["checkpointing_on"]
    assert {epoch["round"] for epoch in training["epochs"]} == {0}
    assert all(
        item == {"error": "no measured optimizer step"} for item in training["summary"].values()
    )
    assert "**Stopped early by the time budget** (3600 s): training round 1" in (
        (tmp_path / "gpu_cpu.md").read_text()
    )


def _probe_wheel(folder: Path) -> Path:
    """A pure-Python wheel of one empty package: what the lease installs from ``.whl/``."""
    folder.mkdir()
    wheel = folder / "lease_probe-0.1-py3-none-any.whl"
    info = "lease_probe-0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("lease_probe/__init__.py", "")
        archive.writestr(
            f"{info}/METADATA", "Metadata-Version: 2.1\nName: lease_probe\nVersion: 0.1\n"
        )
        archive.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        archive.writestr(f"{info}/RECORD", "")
    return wheel


def test_lease_smoke_run_returns_results_within_the_file_limit(tmp_path: Path) -> None:
    """``gpu_lease.sh --smoke``: the lease's whole path on a CPU. The carried wheels are
    installed and imported from their temporary target, env.txt comes first, and what comes
    back fits a lease's 8 files."""
    out = tmp_path / "out"
    wheels = _probe_wheel(tmp_path / "wheels").parent
    environment = {**ENVIRONMENT, "OUT": str(out), "PYTHON": sys.executable, "WHEELS": str(wheels)}
    result = subprocess.run(
        ["bash", str(LEASE), "--smoke"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    files = sorted(path.relative_to(out).as_posix() for path in out.rglob("*") if path.is_file())
    assert files == ["bench.log", "env.txt", "gpu_cpu.json", "gpu_cpu.md", "quick.log"]
    assert len(files) <= 8
    environment_report = (out / "env.txt").read_text()
    assert environment_report.startswith("# gpu_lease.sh: CPU smoke run, not a result")
    assert "wheels: installed 1 from" in environment_report
    assert "lease_probe: 0.1 (" in environment_report and "gpu_lease_site." in environment_report
    assert (
        "SDPA flash enabled:" in environment_report and "TF32 matmul allowed:" in environment_report
    )
    payload = json.loads((out / "gpu_cpu.json").read_text())
    assert payload["smoke_run"] is True and payload["finished"] is True
    assert payload["budget_s"] is not None and payload["ddp"]["ok"]
    summary = payload["training"]["checkpointing_on"]["summary"]
    assert set(summary) == set(STRATEGIES)
    assert all(item["optimizer_steps"] == 2 for item in summary.values()), summary
    # Two measured rounds: an amortized row's window is its solve and one cached step, and
    # its step time is the N = 10 cycle of the two, not their mean.
    for name in AMORTIZED:
        item = summary[name]
        assert item["solved_steps"] == 1 and item["throughput_basis"] == "10-step cycle"
        solve, cached = item["mean_solved_step_s"], item["mean_cached_step_s"]
        assert item["s_per_optimizer_step"] == pytest.approx((solve + 9 * cached) / 10, rel=1e-5)
        assert item["window_s_per_optimizer_step"] == pytest.approx((solve + cached) / 2, rel=1e-5)
        assert payload["training"]["checkpointing_on"]["ratios"][name]["train_throughput"] > 0
    assert "done in" in result.stdout.splitlines()[-1]


def test_lease_quick_pass_failure_ends_with_one_line(tmp_path: Path) -> None:
    """Without a GPU the released shape's quick pass fails: one line says so and where the
    log is, and the measurement does not start."""
    out = tmp_path / "out"
    environment = {**ENVIRONMENT, "OUT": str(out), "PYTHON": sys.executable}
    environment["WHEELS"] = str(tmp_path / "none")
    result = subprocess.run(
        ["bash", str(LEASE), "--shape", "flux1dev"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "gpu_lease: quick pass FAILED, exit 2: bench_gpu.py: error: --shape flux1dev has the "
        "released model's sizes and needs a CUDA device; --shape flux1dev_small is its CPU "
        f"smoke run (log: {out}/quick.log)"
    ]
    assert sorted(path.name for path in out.iterdir()) == ["env.txt", "quick.log"]


def test_lease_skip_quick_goes_straight_to_the_measurement(tmp_path: Path) -> None:
    """``--skip-quick`` (a second call at a commit whose quick pass passed): no quick pass,
    env.txt says so, and the measurement runs; here it fails, as the released shape needs
    a GPU, and says so in its one line."""
    out = tmp_path / "out"
    environment = {**ENVIRONMENT, "OUT": str(out), "PYTHON": sys.executable}
    environment["WHEELS"] = str(tmp_path / "none")
    result = subprocess.run(
        ["bash", str(LEASE), "--shape", "flux1dev", "--skip-quick"],
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 1
    assert "quick pass" not in result.stdout
    assert result.stderr.strip().startswith("gpu_lease: measurement FAILED, exit 2: bench_gpu.py")
    assert sorted(path.name for path in out.iterdir()) == ["bench.log", "env.txt"]
    assert "quick pass: skipped (--skip-quick)" in (out / "env.txt").read_text()


@pytest.mark.skipif(
    not (BENCHMARKS.parent / ".git").exists(), reason="what travels is what git lists"
)
def test_lease_size_check_reports_the_figures_and_refuses_too_much() -> None:
    """What a device call carries: this repository fits the lease's 64 MiB, and a limit it
    exceeds fails with the figures."""
    command = [sys.executable, str(BENCHMARKS / "gpu_lease.py"), "size", "--carry", ".whl"]
    fits = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert fits.returncode == 0, fits.stderr
    assert "travels to the lease: tracked " in fits.stdout and "of 64 MiB: fits" in fits.stdout
    over = subprocess.run([*command, "--limit-mib=1"], capture_output=True, text=True, timeout=120)
    assert over.returncode == 1 and "of 1 MiB: TOO LARGE by " in over.stdout


def test_a_per_row_row_that_fell_back_says_so() -> None:
    """On the H100 the per-row engine was refused (a float32 tolerance on bfloat16 round-off)
    and its rows ran with K backward passes under their per-row labels; the report now says
    which engine a row's solve steps used when it is not the row's own."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import bench_gpu
    finally:
        sys.path.remove(str(BENCHMARKS))
    summary = {
        "marble_every_step": {"engines": ["batched"]},
        "marble_amortized": {"engines": ["rows"]},
        "marble_every_step_k_backward": {"engines": ["batched"]},
        "weighted_sum": {"engines": []},
    }
    (line, blank) = bench_gpu._engine_lines(summary)
    assert line.startswith("**MARBLE every step (N=1): the per-row engine was refused")
    assert "ran with the batched engine" in line and blank == ""
    assert bench_gpu._engine_lines({"marble_amortized": {"engines": ["rows"]}}) == []
