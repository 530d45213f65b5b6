"""The run log: each epoch's record to every logger in ``run.loggers`` (metrics.jsonl
first, always), and reading metrics.jsonl back."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from mogradient_diffusion.config.settings import RunConfig
from mogradient_diffusion.runs.loggers import LOGGERS, EpochLog, Logger, LogTarget
from mogradient_diffusion.runs.loggers.jsonl import FILE_NAME, JsonlLogger, read_lines


class RunLog:
    """Feeds each epoch to the configured loggers; only rank 0 should hold one.

    ``resume_from_step`` (the epoch) and ``resume_from_optimizer_step`` say where a
    resumed run starts: metrics.jsonl drops what was logged at or after it.
    """

    def __init__(
        self,
        run_dir: Path,
        resume_from_step: int = 0,
        *,
        settings: RunConfig | None = None,
        config: dict[str, Any] | None = None,
        resume_from_optimizer_step: int = 0,
    ) -> None:
        settings = settings or RunConfig()
        target = LogTarget(
            Path(run_dir), settings, resume_from_step, resume_from_optimizer_step, config or {}
        )
        self.path = target.directory / FILE_NAME
        names = [LOGGERS.canonical(name) for name in settings.loggers]
        self._loggers: list[Logger] = []
        with contextlib.ExitStack() as opened:  # one failing to open closes the others
            self._loggers.append(JsonlLogger(target))
            for name in dict.fromkeys(names):
                if name != JsonlLogger.name:
                    logger = LOGGERS[name](target)
                    opened.callback(logger.close)
                    self._loggers.append(logger)
            opened.pop_all()

    def log(
        self,
        step: int,
        record: dict[str, Any],
        first_optimizer_step: int = 0,
        samples: np.ndarray | None = None,
    ) -> None:
        """Epoch ``step``'s record; its optimizer steps count from ``first_optimizer_step``."""
        epoch = EpochLog(step, record, first_optimizer_step, samples)
        for logger in self._loggers:
            logger.log(epoch)

    def close(self) -> None:
        with contextlib.ExitStack() as closing:  # every logger closes, even after an error
            for logger in self._loggers:
                closing.callback(logger.close)


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The per-step records of a run, in order. A torn last line (a run killed mid-write)
    is left out, as a resume would drop it; a damaged line elsewhere is a ValueError."""
    path = Path(run_dir) / FILE_NAME
    lines = [
        (n, line) for n, line in enumerate(read_lines(path), 1) if line is None or line.strip()
    ]
    records = []
    for index, (number, line) in enumerate(lines):
        try:
            records.append(json.loads(line or ""))
        except ValueError:
            if index < len(lines) - 1:
                raise ValueError(f"{path}:{number} is not a JSON record") from None
    return records
