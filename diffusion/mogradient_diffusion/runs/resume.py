"""What a resumed run may change, and the record each resume leaves.

A resumed run must be the run it claims to be: the config it was saved with is compared
with the new one, and any difference is refused unless the user asks for it
(``--allow-config-change``). Some settings cannot change even then, because the saved
state only makes sense under them. ``config.yaml`` stays the run's first config; each
resume writes ``resume-<n>.yaml`` with its own config and what changed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from mogradient_diffusion.config.settings import ConfigError

# Never part of the comparison: the length of the run, console noise, the directory
# itself (a run may be moved), the gradient engine and the sharding of the frozen weights
# (the same gradients up to round-off), and the reward watchdog's timeout.
FREE = (
    "train.epochs",
    "run.quiet",
    "run.directory",
    "train.gradient_engine",
    "model.shard",
    "rollout.reward_timeout",
    # where a run logs: switched on or off at any resume (older runs saved none of these)
    "run.loggers",
    "run.wandb_project",
    "run.wandb_mode",
    "run.mlflow_tracking_uri",
    "run.mlflow_experiment",
)
# Cached weights, prompt streams, RNG streams and adapter shapes (rank, targets) are saved
# under these. The objective's name too: its saved state (an advantage tracker) belongs to it.
FIXED = (
    "rewards",
    "strategy",
    "prompts",
    "run.seed",
    "lora.rank",
    "lora.target_modules",
    "model.path",
    "objective.name",
)


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple]:
    """{dotted key: (saved, current)} for every leaf that differs; lists compare whole."""
    changes: dict[str, tuple] = {}
    for key in sorted(set(saved) | set(current), key=str):
        old, new = saved.get(key), current.get(key)
        if isinstance(old, dict) and isinstance(new, dict):
            nested = config_changes(old, new)
            changes.update({f"{key}.{inner}": pair for inner, pair in nested.items()})
        elif old != new:
            changes[str(key)] = (old, new)
    return changes


def check_resume(
    saved: dict[str, Any], current: dict[str, Any], run_dir: Path, allow_change: bool
) -> dict[str, tuple]:
    """The changes a resume applies; raises ConfigError (one line) for a refused one."""
    changes = {key: pair for key, pair in config_changes(saved, current).items() if key not in FREE}
    own_config = latest_settings(run_dir)
    fixed = [key for key in changes if any(key == f or key.startswith(f + ".") for f in FIXED)]
    if fixed:
        raise ConfigError(
            f"{run_dir} was trained with other {_describe(changes, fixed)}; these cannot "
            f"change when a run resumes: resume with the run's own settings ({own_config}) "
            "or use a new run.directory"
        )
    if changes and not allow_change:
        raise ConfigError(
            f"{run_dir} was trained with other {_describe(changes, list(changes))}; resume "
            f"with the run's own settings ({own_config}; only train.epochs may change), pass "
            "--allow-config-change to apply the new values from here on, or use a new "
            "run.directory"
        )
    return changes


def latest_settings(run_dir: Path) -> Path:
    """The file holding the settings the run last ran with: its newest ``resume-<n>.yaml``
    (written by every resume, changes included), else ``config.yaml``."""
    records = _resume_records(run_dir)
    return records[max(records)] if records else run_dir / "config.yaml"


def _resume_records(run_dir: Path) -> dict[int, Path]:
    if not run_dir.is_dir():
        return {}
    found = (re.fullmatch(r"resume-(\d+)\.yaml", path.name) for path in run_dir.iterdir())
    return {int(match.group(1)): run_dir / match.group(0) for match in found if match}


def write_resume_record(
    run_dir: Path, config: dict[str, Any], epoch: int, changes: dict[str, tuple]
) -> Path:
    """``resume-<n>.yaml``: the config this resume runs with, headed by what changed."""
    number = 1 + max(_resume_records(run_dir), default=0)
    path = run_dir / f"resume-{number}.yaml"
    header = [f"# resumed at epoch {epoch}"]
    header += [f"# changed {key}: {old!r} -> {new!r}" for key, (old, new) in changes.items()]
    path.write_text("\n".join(header) + "\n" + yaml.safe_dump(config, sort_keys=False))
    return path


def describe_changes(changes: dict[str, tuple]) -> str:
    """``key (old -> new), ...`` for every change."""
    return _describe(changes, list(changes))


def _describe(changes: dict[str, tuple], keys: list[str]) -> str:
    return ", ".join(
        f"{key} ({_short(changes[key][0])} -> {_short(changes[key][1])})" for key in keys
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
