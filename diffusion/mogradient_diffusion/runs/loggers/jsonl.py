"""metrics.jsonl: one JSON object per epoch, its optimizer steps nested. Always on: resume,
plots, ``compare`` and the benchmarks read it."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.loggers.base import EpochLog, Logger, LogTarget

FILE_NAME = "metrics.jsonl"


class JsonlLogger(Logger):
    """Appends each epoch's record to ``metrics.jsonl``. A resumed run first drops the
    records at or after the resume epoch, so a crash between a log line and its
    checkpoint never duplicates an epoch."""

    name = "jsonl"

    def __init__(self, target: LogTarget) -> None:
        super().__init__(target)
        self.path = target.directory / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._truncate_from(target.resume_epoch)

    def log(self, epoch: EpochLog) -> None:
        record = {keys.STEP: epoch.epoch, **epoch.record}
        try:
            with self.path.open("a") as handle:
                handle.write(json.dumps(_jsonable(record)) + "\n")
        except OSError as error:  # a full disk says nothing of which file it hit
            raise OSError(error.errno, error.strerror, str(self.path)) from error

    def _truncate_from(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [
            line
            for line in read_lines(self.path)
            if line is not None and step_of(line) is not None and step_of(line) < step
        ]
        # Written aside and renamed over: a full disk mid-write must not cut the record.
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        try:
            temporary.write_text("".join(line + "\n" for line in kept))
            os.replace(temporary, self.path)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            raise OSError(error.errno, error.strerror, str(self.path)) from error


def read_lines(path: Path) -> list[str | None]:
    """The lines of ``path``, None for one that is not UTF-8 text: a crash mid-write (or a
    disk that lost a block) can leave binary bytes where a record was cut."""
    lines: list[str | None] = []
    for raw in path.read_bytes().splitlines():
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            lines.append(None)
    return lines


def step_of(line: str) -> int | None:
    """The step of a JSONL line, None for a blank or torn line (a crash mid-write)."""
    try:
        return int(json.loads(line)[keys.STEP])
    except (ValueError, KeyError, TypeError):
        return None


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
