"""The GPU benchmark's CPU smoke run: end to end through the real trainer, schema, labels.

No GPU is needed: ``--shape small`` runs every stage (matmul peak, FLOP counts, rollout,
the three strategies with and without checkpointing, the one-process torchrun check) on a
tiny model, so that a session with an H100/H200 only has to run ``--shape sd35m``; the
FLUX.1-dev and Qwen-Image shapes' tiny twins run ``--quick`` (seconds each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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


def _run(out: Path, *extra: str, shape: str = "small") -> subprocess.CompletedProcess:
    command = [sys.executable, str(SCRIPT), f"--shape={shape}", "--device=cpu", f"--out={out}"]
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
    assert payload["smoke_run"] is True and payload["ddp"] is None
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
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=SCRIPT.parent,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "sd35m": ("StableDiffusion3Pipeline", 2.24, [2, 333, 4096], [2, 2048], False),
        "flux1dev": ("FluxPipeline", 11.90, [2, 128, 4096], [2, 768], False),
        "qwen_image": ("QwenImagePipeline", 20.43, [2, 256, 3584], None, True),
    }
    for name, (pipeline, billions, embeds, pooled, mask) in expected.items():
        item = report[name]
        assert item["pipeline"] == pipeline and item["dtypes"] == ["torch.bfloat16"]
        assert abs(item["billions"] - billions) < 0.01, item
        assert (item["embeds"], item["pooled"], item["mask"]) == (embeds, pooled, mask)
