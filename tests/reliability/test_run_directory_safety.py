"""A run directory is data, never code, and a finished run always ends with its LoRA.

Resuming reads ``state.pt`` with the weights-only unpickler: a crafted one (its manifest's
size and SHA-256 rewritten to match) is refused in one line and nothing in it runs. A run
stopped between its last checkpoint and its export is finished by the same command.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mogradient_diffusion.cli import main
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.runs.checkpoint import (
    EXPORT_RECORD,
    UnsafeCheckpointError,
    export_is_current,
    load_newest_intact,
    save_checkpoint,
    write_export,
)
from mogradient_diffusion.runs.metrics_log import read_metrics

from .conftest import train_arguments

LORA_FILE = "pytorch_lora_weights.safetensors"
CALLS: list[str] = []  # what _mark was asked to do: must stay empty


def _mark(note: str) -> str:
    """Stands in for ``os.system``: a poisoned checkpoint asks the unpickler to call it."""
    CALLS.append(note)
    return note


class _Poison:
    def __reduce__(self):
        return (_mark, ("code from state.pt ran",))


def _rewrite(checkpoint: Path, change) -> None:
    """Apply ``change`` to ``checkpoint``'s state and make its manifest match again (what a
    writer can do: the SHA-256 protects against damage, not against a writer)."""
    state_file = checkpoint / "state.pt"
    state = torch.load(state_file, weights_only=False)  # our own trusted file
    change(state)
    torch.save(state, state_file)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"]["state.pt"] = state_file.stat().st_size
    manifest["sha256"]["state.pt"] = hashlib.sha256(state_file.read_bytes()).hexdigest()
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _one_line(error: str) -> str:
    lines = [line for line in error.splitlines() if line.strip()]
    assert "Traceback" not in error and len(lines) == 1, lines
    return lines[0]


def _last_line(error: str) -> str:
    """After the pipeline's loading bars: the error, in one line."""
    assert "Traceback" not in error
    return error.strip().splitlines()[-1]


# ------------------------------------------------------------ no code runs on resume
def test_a_poisoned_state_is_refused_in_one_line_and_nothing_in_it_runs(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model: None
) -> None:
    CALLS.clear()
    latest = run_copy / "checkpoints" / "step_00000002"
    _rewrite(latest, lambda state: state["objective"].update(hook=_Poison()))
    metrics = (run_copy / "metrics.jsonl").read_text()
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")) == 2
    line = _one_line(capsys.readouterr().err)
    assert str(latest / "state.pt") in line and "refused" in line and "_mark" in line
    assert CALLS == []
    # Refused outright, not passed over: the older intact checkpoint was not resumed.
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == [
        "step_00000001",
        "step_00000002",
    ]
    assert (run_copy / "metrics.jsonl").read_text() == metrics


def test_an_unsafe_checkpoint_is_never_passed_over(tmp_path: Path) -> None:
    CALLS.clear()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, {"step": step, "weights": torch.ones(3)})
    _rewrite(tmp_path / "checkpoints" / "step_00000002", lambda s: s.update(x=_Poison()))
    with pytest.raises(UnsafeCheckpointError, match=r"step_00000002.*_mark"):
        load_newest_intact(tmp_path)
    assert CALLS == []


def test_a_state_missing_a_key_is_one_line_naming_it(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model: None
) -> None:
    for checkpoint in (run_copy / "checkpoints").iterdir():
        _rewrite(checkpoint, lambda state: state.pop("sampler"))
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")) == 1
    line = _one_line(capsys.readouterr().err)
    assert "no intact checkpoint" in line and "no 'sampler' entry" in line


def test_a_state_missing_a_nested_key_is_one_line_naming_it(
    run_copy: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    for checkpoint in (run_copy / "checkpoints").iterdir():
        _rewrite(checkpoint, lambda state: state["strategy"].clear())
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")) == 1
    line = _last_line(capsys.readouterr().err)
    assert "step_00000002" in line and "no 'amortizer' entry" in line


# ------------------------------------------------- the export is part of the run
def _interrupt_export(monkeypatch: pytest.MonkeyPatch, after_bytes: int | None) -> None:
    """The next LoRA export dies: before writing (None) or after ``after_bytes`` bytes."""
    original = Policy.save_lora

    def dying(self, directory, adapter="default"):
        if after_bytes is not None:
            original(self, directory, adapter)
            weights = Path(directory) / LORA_FILE
            weights.write_bytes(weights.read_bytes()[:after_bytes])
        raise KeyboardInterrupt

    monkeypatch.setattr(Policy, "save_lora", dying)


def _assert_exported(run_dir: Path, reference: Path) -> None:
    for name in ("lora", "lora_ema"):
        assert export_is_current(run_dir / name, 2)
        ours, theirs = (load_file(d / name / LORA_FILE) for d in (run_dir, reference))
        assert ours.keys() == theirs.keys()
        assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    assert not [path for path in run_dir.iterdir() if path.name.startswith(".tmp-")]


@pytest.mark.parametrize("after_bytes", [None, 100])
def test_a_run_stopped_while_exporting_is_finished_by_the_same_command(
    tmp_path: Path,
    tiny_pipeline_dir: Path,
    trained_run: Path,
    capsys,
    monkeypatch: pytest.MonkeyPatch,
    after_bytes: int | None,
) -> None:
    arguments = train_arguments(tmp_path, tiny_pipeline_dir, "run.keep_checkpoints=2")
    _interrupt_export(monkeypatch, after_bytes)
    assert main(arguments) == 130
    assert not (tmp_path / "lora").exists()  # a half-written lora/ never takes the name
    monkeypatch.undo()
    capsys.readouterr()
    assert main(arguments) == 0
    error = capsys.readouterr().err
    assert "exported again from checkpoint step_00000002" in error and "Traceback" not in error
    assert [record["step"] for record in read_metrics(tmp_path)] == [0, 1]
    _assert_exported(tmp_path, trained_run)
    assert not list(tmp_path.glob("resume-*.yaml"))  # nothing was resumed
    assert main(arguments) == 0
    assert "nothing to train, nothing written" in capsys.readouterr().err


def test_an_export_from_an_earlier_epoch_is_redone(
    run_copy: Path, tiny_pipeline_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    before = load_file(run_copy / "lora" / LORA_FILE)
    arguments = train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3")
    _interrupt_export(monkeypatch, None)
    assert main(arguments) == 130
    monkeypatch.undo()
    assert not export_is_current(run_copy / "lora", 3)  # lora/ is epoch 2's
    assert main(arguments) == 0
    assert "exported again from checkpoint step_00000003" in capsys.readouterr().err
    after = load_file(run_copy / "lora" / LORA_FILE)
    assert export_is_current(run_copy / "lora", 3) and export_is_current(run_copy / "lora_ema", 3)
    assert any(not torch.equal(before[key], after[key]) for key in before)


def test_a_complete_run_with_its_exports_loads_no_model(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model: None
) -> None:
    assert main(train_arguments(run_copy, tiny_pipeline_dir)) == 0
    assert "nothing to train, nothing written" in capsys.readouterr().err


def test_write_export_replaces_atomically_and_records_its_step(tmp_path: Path) -> None:
    def fill(text: str):
        def write(folder: Path) -> None:
            folder.mkdir()
            (folder / "weights.bin").write_text(text)

        return write

    final = write_export(tmp_path / "lora", 1, fill("one"))
    assert json.loads((final / EXPORT_RECORD).read_text())["step"] == 1

    def interrupted(folder: Path) -> None:
        fill("two")(folder)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_export(final, 2, interrupted)
    assert (final / "weights.bin").read_text() == "one" and export_is_current(final, 1)
    write_export(final, 2, fill("two!"))
    assert export_is_current(final, 2) and not export_is_current(final, 1)
    (final / "weights.bin").write_text("tw")  # truncated after the fact
    assert not export_is_current(final, 2)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["lora"]
