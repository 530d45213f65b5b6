"""The GPU benchmark's CPU smoke run: end to end through the real trainer, schema, labels.

No GPU is needed: ``--shape small`` runs every stage (matmul peak, FLOP counts, rollout,
the three strategies with and without checkpointing, the one-process torchrun check) on a
tiny model, so that a session with an H100/H200 only has to run ``--shape sd35m``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpu.py"
# Every MARBLE row twice: with the per-row engine and with K backward passes.
STRATEGIES = (
    "weighted_sum",
    "marble_amortized",
    "marble_every_step",
    "marble_amortized_k_backward",
    "marble_every_step_k_backward",
)
MODES = ("checkpointing_off", "checkpointing_on")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), "--shape=small", "--device=cpu", f"--out={out}"]
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.run(
        [*command, "--rounds=1", "--repeats=1", *extra],
        env=environment,
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
    assert "CPU smoke run, not a result" in markdown
    assert {"torch", "diffusers", "peft"} <= set(payload["versions"])
    assert payload["shape"]["name"] == "small"
    assert "precomputed random embeddings" in payload["setup"]["text_embeddings"]
    assert "stand-in" in payload["setup"]["rewards"]
    assert payload["setup"]["lora"]["rank"] == 32  # the recipe's LoRA
    assert payload["peak_matmul"]["tflops"] > 0
    assert (
        payload["flops"]["per_objective_per_sample_timestep"]
        > (payload["flops"]["combined_per_sample_timestep"])
    )
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
        # The real code paths ran: one combined backward vs K per-reward gradients.
        assert summary["weighted_sum"]["solved_steps"] == 0
        for every_step in ("marble_every_step", "marble_every_step_k_backward"):
            assert summary[every_step]["solved_steps"] == summary[every_step]["optimizer_steps"]
        assert summary["marble_every_step"]["engines"] == ["rows"]
        assert summary["marble_every_step_k_backward"]["engines"] == ["batched"]
        ratios = payload["training"][mode]["ratios"]
        assert set(ratios) == set(STRATEGIES) - {"weighted_sum"}
        assert all(v > 0 for r in ratios.values() for v in r.values())

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
