"""benchmarks/profile_gpu_step.py's CPU smoke run: the script a GPU lease runs once, with
no second chance, must work end to end here first.

``--quick`` profiles the tiny twin of the SD3.5-M shape on the CPU (seconds): every
stage, both output files, tables whose shares add up; and a budget too short to profile
anything says so and exits 1. The GPU side of the event analysis (kernels charged to the
ops that launched them, busy time, launches) is checked on synthetic events.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from torch.autograd import DeviceType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPT = BENCHMARKS / "profile_gpu_step.py"
ENVIRONMENT = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
PROFILED = ("rollout", "training_weighted_sum", "training_marble")


def _run(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out), *extra],
        env=ENVIRONMENT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _check_profile(profile: dict[str, Any]) -> None:
    assert profile["calls"] >= 1 and profile["cpu_ops_per_call"] > 0
    top = profile["top_ops"]
    assert 0 < len(top) <= 25
    assert all(op["self_ms"] > 0 and op["calls"] > 0 for op in top)
    assert [op["self_ms"] for op in top] == sorted((op["self_ms"] for op in top), reverse=True)
    shares = [group["percent"] for group in profile["categories"]]
    assert sum(shares) == pytest.approx(100.0, abs=0.01)
    names = {group["category"] for group in profile["categories"]}
    assert {"matmul/GEMM", "attention", "elementwise/normalization", "optimizer"} <= names


def test_quick_profiles_every_stage_into_two_files(tmp_path: Path) -> None:
    result = _run(tmp_path)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        "profile_cpu.json",
        "profile_cpu.md",
    ]
    payload = json.loads((tmp_path / "profile_cpu.json").read_text())
    markdown = (tmp_path / "profile_cpu.md").read_text()

    assert payload["smoke_run"] and payload["finished"]
    assert payload["shape"]["name"] == "small"
    assert all(entry["status"] == "ok" for entry in payload["stages"].values())
    for key in PROFILED:
        _check_profile(payload["stages"][key]["profile"])
    training = payload["stages"]["training_weighted_sum"]
    assert training["profile"]["calls"] == 2 and training["step"]["solved"] == 0
    marble = payload["stages"]["training_marble"]
    assert marble["step"] == {"solved": 1, "engine": "rows", "skipped": None}
    # The optimizer's ops are found by their annotation: AdamW runs on every step.
    categories = {group["category"]: group for group in training["profile"]["categories"]}
    assert categories["optimizer"]["self_ms"] > 0

    assert "CPU smoke run, not a result" in markdown and "## Reading" in markdown
    assert "Top 25 ops by self CPU time" in markdown
    assert "training step: MARBLE every step, per-row engine" in markdown


def test_a_budget_too_short_skips_and_exits_1(tmp_path: Path) -> None:
    result = _run(tmp_path, "--budget", "0")
    assert result.returncode == 1, result.stdout[-2000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "profile_cpu.json").read_text())
    for key in PROFILED:
        status = payload["stages"][key]["status"]
        assert status.startswith("skipped: ") and "of the 0 s budget" in status, status
    assert "Failed or skipped stages" in (tmp_path / "profile_cpu.md").read_text()


def _script() -> ModuleType:
    pytest.importorskip("diffusers", reason="the diffusion extra is not installed")
    sys.path.insert(0, str(BENCHMARKS))
    try:
        import profile_gpu_step
    finally:
        sys.path.remove(str(BENCHMARKS))
    return profile_gpu_step


@dataclass
class Event:
    """The part of a raw profiler (kineto) event that the analysis reads."""

    label: str
    start: int
    end: int
    correlation: int = 0  # its own: an op's, or a launch call's and its kernel's
    linked: int = 0  # the op a launch call or a device record was made for
    device: DeviceType = DeviceType.CPU
    annotation: bool = False
    work: int = 0

    def name(self) -> str:
        return self.label

    def device_type(self) -> DeviceType:
        return self.device

    def start_ns(self) -> int:
        return self.start

    def end_ns(self) -> int:
        return self.end

    def correlation_id(self) -> int:
        return self.correlation

    def linked_correlation_id(self) -> int:
        return self.linked

    def is_user_annotation(self) -> bool:
        return self.annotation

    def is_async(self) -> bool:
        return False

    def start_thread_id(self) -> int:
        return 1

    def flops(self) -> int:
        return self.work


def _kernel(name: str, start: int, end: int, op: int, launch: int = 0, **extra: Any) -> Event:
    """A device record launched by op ``op`` through the launch call ``launch``."""
    return Event(name, start, end, launch, op, DeviceType.CUDA, **extra)


def test_device_time_goes_to_the_op_that_launched_it() -> None:
    """A GEMM under ``aten::linear`` with its launch call and a copy; AdamW's ops under its
    annotation (an elementwise op there counts as optimizer work); a kernel overlapping
    another on a second stream; one whose op was not recorded; a launch call whose kernel
    record is missing; records that are no work."""
    script = _script()
    events = [
        Event("aten::linear", 0, 100, correlation=1),
        Event("aten::addmm", 10, 90, correlation=2, work=6_000),
        Event("cudaLaunchKernel", 20, 25, correlation=7, linked=2),
        _kernel("sm90_gemm", 30, 80, op=2, launch=7),
        _kernel("Memcpy HtoD (Pageable -> Device)", 600, 610, op=2),
        Event("Optimizer.step#AdamW.step", 200, 300, correlation=3),
        Event("aten::_foreach_mul_", 210, 220, correlation=4),
        Event("aten::add_", 230, 240, correlation=5),
        Event("cudaLaunchKernel", 232, 234, correlation=9, linked=5),
        _kernel("foreach_kernel", 240, 260, op=4),
        _kernel("add_kernel", 250, 270, op=5),
        _kernel("Optimizer.step#AdamW.step", 240, 400, op=3, annotation=True),
        _kernel("Stream Sync", 700, 900, op=0),
        _kernel("orphan_kernel", 500, 510, op=99),
        Event("cudaDeviceSynchronize", 620, 640),
        Event("[memory]", 5, 5),
    ]
    found = script.analyse(events, on_device=True, calls=1)

    assert found["device_busy_ms"] * 1e6 == pytest.approx(50 + 30 + 10 + 10)
    assert (found["kernels_per_call"], found["copies_per_call"]) == (4, 1)
    assert found["kernel_launches_per_call"] == 2 and found["cpu_ops_per_call"] == 6
    assert found["mean_kernel_us"] * 1e3 == pytest.approx((50 + 20 + 20 + 10) / 4)
    assert found["launches_without_kernel_record"] == 1
    assert found["device_records_cover"] == pytest.approx(610 / 640)
    top = {(op["name"], op["category"]): op["self_ms"] * 1e6 for op in found["top_ops"]}
    assert top == pytest.approx(
        {
            ("aten::addmm", "matmul/GEMM"): 60,
            ("aten::_foreach_mul_", "optimizer"): 20,
            ("aten::add_", "optimizer"): 20,
            ("(device work outside any profiled op)", "other"): 10,
            ("aten::linear", "matmul/GEMM"): 0,
            ("Optimizer.step#AdamW.step", "optimizer"): 0,
            ("cudaDeviceSynchronize", "other"): 0,
        }
    )
    groups = {group["category"]: group for group in found["categories"]}
    assert groups["matmul/GEMM"]["percent"] == pytest.approx(100 * 60 / 110)
    assert groups["optimizer"]["percent"] == pytest.approx(100 * 40 / 110)
    assert groups["matmul/GEMM"]["tflops"] == pytest.approx(6_000 / 60e-9 / 1e12)
    assert found["total_self_ms"] * 1e6 == pytest.approx(110)

    # One launch in two without its kernel: the records are not whole; nor are they when
    # the device records stop early.
    assert not script.complete(found)
    whole = found | {"launches_without_kernel_record": 0}
    assert script.complete(whole)
    assert not script.complete(whole | {"device_records_cover": 0.5})


def test_cpu_self_time_excludes_the_children() -> None:
    events = [Event("aten::linear", 0, 100, correlation=1), Event("aten::addmm", 10, 90)]
    found = _script().analyse(events, on_device=False, calls=2)
    top = {op["name"]: op["self_ms"] * 1e6 for op in found["top_ops"]}
    assert top == pytest.approx({"aten::addmm": 40, "aten::linear": 10})  # per call of 2


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("aten::mm", "matmul/GEMM"),
        ("aten::_addmm_activation", "matmul/GEMM"),
        ("aten::_scaled_dot_product_flash_attention", "attention"),
        ("aten::_efficient_attention_backward", "attention"),
        ("aten::cudnn_convolution", "convolution"),
        ("aten::convolution_backward", "convolution"),
        ("aten::native_layer_norm_backward", "elementwise/normalization"),
        ("aten::gelu_backward", "elementwise/normalization"),
        ("aten::_to_copy", "elementwise/normalization"),
        ("aten::copy_", "elementwise/normalization"),
        ("aten::_foreach_lerp_", "optimizer"),
        ("aten::_fused_adamw_", "optimizer"),
        ("aten::index", "other"),
        ("MmBackward0", "other"),
    ],
)
def test_categories_by_op_name(name: str, expected: str) -> None:
    assert _script().category(name) == expected
