"""The head-to-head's rows and runs as data.

``benchmark`` makes them and ``report`` reads them; they live apart from both so the
report needs nothing from the runner (no import circle, lazy or not).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Method:
    """One row of the head-to-head: a name, a label and its config overrides."""

    key: str
    label: str
    overrides: tuple[str, ...] = ()
    table: str = "main"  # "main", "ablations" or "objectives" (the last two: ablation seeds)
    # Log cos(update, g_k) on every step of seed 0 (the conflict table): the probe's K
    # extra backward passes per step triple a run's cost, and one seed gives every step.
    probe: bool = False
    trains: bool = True

    @property
    def ablation(self) -> bool:
        """Rows outside the main table run on the budget's ablation seeds."""
        return self.table != "main"


@dataclass
class RunResult:
    """Where one (method, seed) trained and was evaluated, and what training cost."""

    method: Method
    seed: int
    run_dir: Path | None
    eval_dir: Path
    train_seconds: float = 0.0
    peak_rss_mib: float = 0.0
    log: list[str] = field(default_factory=list)
