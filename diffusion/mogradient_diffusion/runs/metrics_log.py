"""Run directory logging: per-step metrics as JSONL (for people and scripts) and TensorBoard."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mogradient_diffusion.runs import metric_keys as keys


class RunLog:
    """Appends one JSON object per step to ``metrics.jsonl`` and mirrors scalars to TensorBoard.

    Only rank 0 should hold one; resumed runs append, and records at or after the resume
    step are dropped first so a crash between a log line and its checkpoint never
    duplicates a step.
    """

    def __init__(self, run_dir: Path, resume_from_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_from(resume_from_step)
        self._writer = SummaryWriter(
            log_dir=str(Path(run_dir) / "tensorboard"), purge_step=resume_from_step or None
        )

    def log(self, step: int, record: dict[str, Any]) -> None:
        record = {keys.STEP: step, **record}
        try:
            with self.path.open("a") as handle:
                handle.write(json.dumps(_jsonable(record)) + "\n")
        except OSError as error:  # a full disk says nothing of which file it hit
            raise OSError(error.errno, error.strerror, str(self.path)) from error
        for key, value in record.items():
            numeric = isinstance(value, int | float) and not isinstance(value, bool)
            if numeric and math.isfinite(value) and key != keys.STEP:
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()

    def _truncate_from(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in _lines(self.path)
            if line is not None and _step_of(line) is not None and _step_of(line) < step
        ]
        # Written aside and renamed over: a full disk mid-write must not cut the record.
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            temporary.write_text("".join(line + "\n" for line in kept))
            os.replace(temporary, self.path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise OSError(error.errno, error.strerror, str(self.path)) from error


def _lines(path: Path) -> list[str | None]:
    """The lines of ``path``, None for one that is not UTF-8 text: a crash mid-write (or a
    disk that lost a block) can leave binary bytes where a record was cut."""
    lines: list[str | None] = []
    for raw in path.read_bytes().splitlines():
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(None)
    return lines


def _step_of(line: str) -> int | None:
    """The step of a JSONL line, None for a blank or torn line (a crash mid-write)."""
    try:
        return int(json.loads(line)[keys.STEP])
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run, in order. A torn last line (a run killed mid-write)
    is left out, as a resume would drop it; a damaged line elsewhere is a ValueError."""
    path = Path(run_dir) / "metrics.jsonl"
    lines = [(n, line) for n, line in enumerate(_lines(path), 1) if line is None or line.strip()]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line or ""))
        except ValueError:
            if index < len(lines) - 1:
                raise ValueError(f"{path}:{number} is not a JSON record") from None
    return records


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(key): _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return _jsonable(value.item())
    return value
