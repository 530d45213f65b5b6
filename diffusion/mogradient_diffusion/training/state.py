"""What a checkpoint holds of a trainer, and how a resumed run is put back.

Everything stateful is saved: both adapters, the optimizer, the EMA, the strategy (cached
weights), the objective (an advantage tracker) and the prompt stream, with the config.
Restoring takes the config's optimizer and EMA settings, so a resume may change them.

Every part is plain data (tensors, dicts, lists, numbers, strings), so a checkpoint loads
with torch's weights-only unpickler and resuming never runs code from the run directory
(``runs.checkpoint``). A state missing a part is damaged: it is passed over, named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from mogradient_diffusion.config.settings import ConfigError, TrainConfig
from mogradient_diffusion.model.policy import Policy
from mogradient_diffusion.prompts.sources import StratifiedPromptSampler
from mogradient_diffusion.runs.checkpoint import (
    STATE_FILE,
    CorruptCheckpointError,
    Restored,
    UnsafeCheckpointError,
    load_newest_intact,
)
from mogradient_diffusion.runs.resume import (
    FREE,
    check_resume,
    config_changes,
    describe_changes,
)
from mogradient_diffusion.training.ema import ParameterEMA
from mogradient_diffusion.training.finite import all_finite
from mogradient_diffusion.training_config import read_run_config


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> Any: ...


@dataclass(frozen=True)
class TrainingState:
    """The parts of a trainer a checkpoint saves and restores."""

    policy: Policy
    optimizer: torch.optim.Optimizer
    ema: ParameterEMA
    strategy: Stateful
    objective: Stateful
    prompt_sampler: StratifiedPromptSampler

    def to_checkpoint(
        self, epoch: int, optimizer_step: int, config: dict[str, Any]
    ) -> dict[str, Any]:
        """The checkpoint after ``epoch`` epochs and ``optimizer_step`` optimizer steps."""
        return {
            "epoch": epoch,
            "optimizer_step": optimizer_step,
            "default": self.policy.lora_state("default"),
            "old": self.policy.lora_state("old"),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict(),
            "strategy": self.strategy.state_dict(),
            "objective": self.objective.state_dict(),
            "sampler": self.prompt_sampler.state_dict(),
            "config": config,
        }

    def restore(self, state: dict[str, Any], train: TrainConfig) -> tuple[int, int]:
        """Load ``state``; the optimizer and EMA take ``train``'s settings. Returns
        (epoch, optimizer step) to continue from."""
        self.policy.load_lora_state("default", state["default"])
        self.policy.load_lora_state("old", state["old"])
        self.optimizer.load_state_dict(state["optimizer"])
        for group in self.optimizer.param_groups:  # the saved state carries the old ones
            group.update(
                lr=train.learning_rate, betas=train.adam_betas, weight_decay=train.weight_decay
            )
        self.ema.load_state_dict(state["ema"])
        self.ema.decay = train.ema_decay
        self.strategy.load_state_dict(state["strategy"])
        self.objective.load_state_dict(state.get("objective", {}))  # none saved before 12
        self.prompt_sampler.load_state_dict(state["sampler"])
        return int(state["epoch"]), int(state["optimizer_step"])


# What every checkpoint holds (``objective`` only since 12: optional).
REQUIRED_KEYS = (
    "epoch",
    "optimizer_step",
    "default",
    "old",
    "optimizer",
    "ema",
    "strategy",
    "sampler",
    "config",
)


def check_finite_state(state: dict[str, Any]) -> None:
    """Reject a checkpoint missing a part (ValueError naming it, so it is passed over
    like a damaged one rather than a KeyError traceback) or holding non-finite LoRA or
    EMA weights (a poisoned run)."""
    missing = [key for key in REQUIRED_KEYS if key not in state]
    if missing:
        raise ValueError(f"it has no {', '.join(map(repr, missing))} entry")
    try:
        tensors = [*state["default"].values(), *state["old"].values(), *state["ema"]["shadow"]]
        finite = all_finite(tensors)
    except (KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"its LoRA or EMA weights are malformed ({_describe(error)})") from None
    if not finite:
        raise ValueError("it holds non-finite LoRA or EMA weights")


def _describe(error: Exception) -> str:
    return f"no {error.args[0]!r} entry" if isinstance(error, KeyError) else str(error)


def saved_run(
    run_dir: Path,
    config: dict[str, Any],
    prompt_sampler: StratifiedPromptSampler,
    allow_config_change: bool,
    warn: Callable[[str], None],
) -> tuple[Restored | None, dict[str, tuple] | None]:
    """The newest intact checkpoint and the config changes resuming it applies (None
    for a new run), checked before any model loads. A run directory whose config.yaml
    has no checkpoint yet trained nothing: it starts again with the new config (its
    differences are noted, ``warn``) and its config.yaml is rewritten."""
    try:
        restored = load_newest_intact(run_dir, check_finite_state)
    except UnsafeCheckpointError as error:  # the user's to fix (exit 2), not a failed run
        raise ConfigError(str(error)) from None
    if restored is None:
        if (run_dir / "config.yaml").exists():
            _note_restart(run_dir, read_run_config(run_dir / "config.yaml"), config, warn)
        return None, None
    changes = check_resume(restored.state["config"], config, run_dir, allow_config_change)
    if restored is not None:
        try:
            _check_prompts(
                run_dir, restored.state["sampler"], prompt_sampler, allow_config_change, warn
            )
        except (KeyError, TypeError, AttributeError) as error:
            raise CorruptCheckpointError(
                f"{restored.path / STATE_FILE}: its prompt sampler state is malformed "
                f"({_describe(error)}); remove that checkpoint or use a new run.directory"
            ) from None
    return restored, changes


def _note_restart(
    run_dir: Path, saved: dict[str, Any], config: dict[str, Any], warn: Callable[[str], None]
) -> None:
    """Say which settings a run that never reached a checkpoint starts again without."""
    changes = {key: pair for key, pair in config_changes(saved, config).items() if key not in FREE}
    if changes:
        warn(
            f"{run_dir} has a config.yaml but no checkpoint (nothing was trained): starting "
            f"it again with the new {describe_changes(changes)}"
        )


def _check_prompts(
    run_dir: Path,
    saved: dict[str, Any],
    prompt_sampler: StratifiedPromptSampler,
    allow_config_change: bool,
    warn: Callable[[str], None],
) -> None:
    """The prompt files must be those the run was saved with: another line count is
    refused (the saved position means nothing there), edited text needs the flag."""
    try:
        prompt_sampler.check_state(saved)
    except ValueError as error:
        raise ConfigError(
            f"{run_dir}: the prompt files changed since the run was saved ({error}); "
            "restore them, or use a new run.directory"
        ) from None
    edited = prompt_sampler.edited_sources(saved)
    if edited and not allow_config_change:
        raise ConfigError(
            f"{run_dir}: the text of prompt source(s) {edited} changed since the run "
            "was saved (same number of prompts); restore the files, pass "
            "--allow-config-change to train on the new text from here on, or use a new "
            "run.directory"
        )
    for name in edited:
        warn(f"prompt source {name!r} was edited since the run was saved")
