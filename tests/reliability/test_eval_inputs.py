"""``eval`` input errors: one line, exit 2, before the pipeline loads where the files
tell; a LoRA that only the model can refuse (another model's) is one line too."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mogradient_diffusion.cli import main
from mogradient_diffusion.evaluation.inputs import LORA_FILE, resolve_device


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _eval(out: Path, *extra: str) -> int:
    return main(
        ["eval", "--prompts", "general", "--metrics", "jpeg_incompressibility", "--quiet",
         "--max-prompts", "1", "--steps", "1", "--out", str(out), *extra]
    )  # fmt: skip


@pytest.fixture
def no_pipeline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Loading the pipeline fails the test: the error must have come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("the pipeline was loaded before the error was reported")

    monkeypatch.setattr("mogradient_diffusion.evaluation.evaluate.load_pipeline", refuse)


def _lora_copy(trained_run: Path, target: Path, change=None) -> Path:
    """The run's LoRA folder copied to ``target``, its tensors passed through ``change``."""
    target.mkdir(parents=True)
    tensors = load_file(trained_run / "lora" / LORA_FILE)
    save_file(change(tensors) if change else tensors, target / LORA_FILE)
    return target


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing", "is not a directory"),
        ("empty", f"has no {LORA_FILE}"),
        ("run directory", "it looks like a run directory: use"),
        ("truncated", "may be truncated"),
        ("another model type", "holds no SD3 transformer LoRA weights"),
        ("out is a file", "is an existing file"),
        ("out under a file", "is not a folder this user can write to"),
        ("bad device", "is not a device"),
        ("bad resolution", "--resolution must be a positive multiple of 16"),
        ("zero steps", "--steps must be >= 1, got 0"),
        ("nan guidance scale", "--guidance-scale must be a finite number >= 0, got nan"),
        ("bad metric option", "bad --metric-option"),
        ("no model", "--model is required"),
    ],
)
def test_eval_input_errors_are_one_line_before_the_pipeline_loads(
    trained_run, tiny_pipeline_dir, tmp_path, capsys, no_pipeline, case, message
):
    out = tmp_path / "out"
    model = ["--model", str(tiny_pipeline_dir)]
    lora = tmp_path / "lora"
    extra = {
        "missing": [*model, "--lora", str(tmp_path / "nowhere")],
        "run directory": [*model, "--lora", str(trained_run)],
        "out is a file": model,
        "out under a file": model,
        "bad device": [*model, "--device", "gpu0"],
        "bad resolution": [*model, "--resolution", "100"],
        "zero steps": [*model, "--steps", "0"],
        "nan guidance scale": [*model, "--guidance-scale", "nan"],
        "bad metric option": [*model, "--metric-option", "jpeg_incompressibility.quality=["],
        "no model": [],
    }.get(case, [*model, "--lora", str(lora)])
    if case == "empty":
        lora.mkdir()
    elif case == "truncated":
        _lora_copy(trained_run, lora)
        data = (lora / LORA_FILE).read_bytes()
        (lora / LORA_FILE).write_bytes(data[: len(data) - 100])
    elif case == "another model type":
        _lora_copy(trained_run, lora, lambda t: {"unet." + k: v for k, v in t.items()})
    elif case == "out is a file":
        out.write_text("my notes")
    elif case == "out under a file":
        (tmp_path / "a_file").write_text("x")
        out = tmp_path / "a_file" / "out"
    assert _eval(out, *extra) == 2  # a second --steps replaces _eval's
    assert message in _one_line(capsys.readouterr().err)
    if case == "out is a file":
        assert out.read_text() == "my notes"
    else:
        assert not out.exists()


def test_a_cuda_device_without_cuda_is_one_line(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _eval(tmp_path / "out", "--model", str(tiny_pipeline_dir), "--device", "cuda") == 2
    assert "CUDA is not available" in _one_line(capsys.readouterr().err)


def test_a_bare_cuda_device_means_the_first_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda") == torch.device("cuda", 0)  # set_device needs an index
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="cuda:0 to cuda:1"):
        resolve_device("cuda:2")


@pytest.mark.parametrize("kind", ["other sizes", "extra layers"])
def test_a_lora_of_another_model_is_one_line(
    trained_run, tiny_pipeline_dir, tmp_path, capsys, kind
):
    def wider(tensors):
        return {k: torch.zeros(v.shape[0] * 2, v.shape[1]) for k, v in tensors.items()}

    def deeper(tensors):
        extra = {k.replace("blocks.1.", "blocks.7."): v.clone() for k, v in tensors.items()}
        return tensors | {k: v for k, v in extra.items() if "blocks.7." in k}

    lora = _lora_copy(trained_run, tmp_path / "lora", wider if kind == "other sizes" else deeper)
    out = tmp_path / "out"
    assert _eval(out, "--model", str(tiny_pipeline_dir), "--lora", str(lora)) == 2
    line = _one_line(capsys.readouterr().err)
    assert "does not fit the model" in line and len(line) < 500
    assert not out.exists()


def test_eval_takes_the_runs_settings_and_a_flag_wins(
    trained_run, tiny_pipeline_dir, tmp_path, capfd
):
    out = tmp_path / "out"
    lora = shutil.copytree(trained_run / "lora", tmp_path / "run" / "lora")
    shutil.copy(trained_run / "config.yaml", tmp_path / "run" / "config.yaml")
    code = main(
        ["eval", "--lora", str(lora), "--prompts", "general", "--metrics",
         "jpeg_incompressibility", "--max-prompts", "2", "--quiet", "--out", str(out),
         "--max-sequence-length", "4"]
    )  # fmt: skip
    assert code == 0
    settings = json.loads((out / "summary.json").read_text())["settings"]
    # The tiny preset's rollout: 4 steps at 64 px; the model the run trained.
    assert settings["steps"] == 4 and settings["resolution"] == 64
    assert settings["max_sequence_length"] == 4  # given: wins over the run's 32
    assert settings["model"] == str(tiny_pipeline_dir)  # the run's model.path
    captured = capfd.readouterr()
    assert "config.yaml: steps=4" in captured.out
    # Library chatter summarised: one note for truncation, no per-encoder LoRA lines.
    assert "No LoRA keys" not in captured.err and "was truncated" not in captured.err
    note = [line for line in captured.err.splitlines() if "note:" in line]
    assert len(note) == 1 and "2 of 2 prompts were cut short" in note[0]


def test_a_sweep_does_not_take_the_runs_steps(trained_run, capsys):
    from mogradient_diffusion.cli import RUN_FLAGS, _run_flags

    args = argparse.Namespace(lora=str(trained_run / "lora"), steps_sweep="1,2")
    vars(args).update(dict.fromkeys(RUN_FLAGS))
    values = _run_flags(args)
    assert "steps" not in values and values["max_sequence_length"] == 32
    assert "steps=" not in capsys.readouterr().out
