"""Atomic checkpoints survive crashes mid-write, and restored RNG states replay draws."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mogradient_diffusion.runs import checkpoint
from mogradient_diffusion.runs.checkpoint import (
    CorruptCheckpointError,
    keep_last,
    latest_checkpoint,
    load_checkpoint,
    load_newest_intact,
    save_checkpoint,
)


def _state(step: int) -> dict:
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return {
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "nested": {"weights": torch.arange(5.0), "counts": [1, 2, {"deep": torch.ones(2)}]},
    }


def test_round_trip_of_nested_state(tmp_path: Path) -> None:
    state = _state(7)
    path = save_checkpoint(tmp_path, 7, state)
    assert path == tmp_path / "checkpoints" / "step_00000007"
    assert latest_checkpoint(tmp_path) == path
    loaded = load_checkpoint(path)
    assert loaded["step"] == 7 and loaded["nested"]["counts"][:2] == [1, 2]
    torch.testing.assert_close(loaded["nested"]["counts"][2]["deep"], torch.ones(2))
    torch.testing.assert_close(loaded["model"], state["model"])
    torch.testing.assert_close(loaded["optimizer"]["state"], state["optimizer"]["state"])
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]


def test_exception_inside_the_write_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    previous = save_checkpoint(tmp_path, 100, _state(100))

    def crash(obj, handle) -> None:
        handle.write(b"half a checkpoint")
        raise RuntimeError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(tmp_path, 200, _state(200))
    assert latest_checkpoint(tmp_path) == previous
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000100"]


def test_leftovers_of_a_hard_crash_are_ignored_then_pruned(tmp_path: Path) -> None:
    previous = save_checkpoint(tmp_path, 100, _state(100))
    checkpoints = tmp_path / "checkpoints"
    leftover = checkpoints / ".tmp-step_00000200-1234-abcd"  # killed before the rename
    leftover.mkdir()
    (leftover / "state.pt").write_bytes(b"partial")
    (checkpoints / "step_00000300").mkdir()  # no manifest: e.g. a partial copy by hand
    (checkpoints / "step_00000400").mkdir()
    (checkpoints / "step_00000400" / "manifest.json").write_text('{"step": 4')  # truncated
    assert latest_checkpoint(tmp_path) == previous
    with pytest.raises(CorruptCheckpointError, match=r"manifest\.json is missing or damaged"):
        load_checkpoint(checkpoints / "step_00000300")
    assert load_newest_intact(tmp_path).passed_over[:2] == [
        f"{name}: {checkpoints / name / 'manifest.json'} is missing or damaged"
        for name in ("step_00000400", "step_00000300")
    ]
    assert keep_last(tmp_path, 1) == [leftover]
    assert not leftover.exists() and latest_checkpoint(tmp_path) == previous


def test_truncated_state_file_is_detected(tmp_path: Path) -> None:
    path = save_checkpoint(tmp_path, 5, _state(5))
    data = (path / "state.pt").read_bytes()
    (path / "state.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(OSError, match="missing or truncated"):
        load_checkpoint(path)


def test_resaving_a_step_replaces_it(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 10, {"value": 1})
    path = save_checkpoint(tmp_path, 10, {"value": 2})
    assert load_checkpoint(path) == {"value": 2}
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000010"]


def test_keep_last_prunes_the_oldest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path) is None and keep_last(tmp_path, 2) == []
    paths = [save_checkpoint(tmp_path, step, {"step": step}) for step in (5, 50, 500, 5000)]
    assert keep_last(tmp_path, 2) == paths[:2]
    assert sorted((tmp_path / "checkpoints").iterdir()) == paths[2:]
    assert latest_checkpoint(tmp_path) == paths[-1]
    assert load_checkpoint(paths[-1]) == {"step": 5000}


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda d: save_checkpoint(d, -1, {}), ValueError, "step must be a non-negative int"),
        (lambda d: save_checkpoint(d, 1, [1]), TypeError, "state must be a dict"),
        (lambda d: keep_last(d, 0), ValueError, "n must be an int >= 1"),
    ],
)
def test_validation(tmp_path: Path, call, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        call(tmp_path)
