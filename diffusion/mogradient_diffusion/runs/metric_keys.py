"""The names in metrics.jsonl: one source for the trainer that writes them and every reader
(plots, the miniature's report, the benchmarks), so a renamed metric cannot go unread.

An epoch's record holds the epoch-level names and, under ``OPTIMIZER_STEPS``, one record
per optimizer step with the step-level names.
"""

from __future__ import annotations

# ---------------------------------------------------------------- per epoch
STEP = "step"  # the epoch index, written by the run log
OPTIMIZER_STEPS = "optimizer_steps"
ROLLOUT_TIME = "time/rollout"
REWARD_TIME = "time/reward"
TRAIN_TIME = "time/train"
TIMING_PREFIX = "time/"  # every wall-clock entry starts with it
PEAK_MEMORY = "memory/peak_gib"
# The frozen transformer weights this process holds: its shard under model.shard=fsdp2.
FROZEN_WEIGHTS = "memory/frozen_weights_gib"
PARAMETER_DIVERGENCE = "ddp/parameter_divergence"
OBJECTIVES = "objectives"
OLD_DECAY = "old_decay"
OBJECTIVES_WITHOUT_SIGNAL = "objectives_without_signal"
REWARDS_WITHOUT_SIGNAL = "rewards_without_signal"


def reward_mean(name: str) -> str:
    return f"reward/{name}/mean"


def reward_of_mean(key: str) -> str | None:
    """The reward whose mean ``key`` names (``reward_mean``'s inverse), else None."""
    parts = key.split("/")
    return parts[1] if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean" else None


def reward_std(name: str) -> str:
    return f"reward/{name}/std"


def reward_failed(name: str) -> str:
    """Samples a reward scored NaN in the epoch because scoring them failed (an optional
    remote reward whose server did not answer), over every rank."""
    return f"reward/{name}/failed"


def reward_time(name: str) -> str:
    return f"time/reward/{name}"


def advantage_stat(name: str, statistic: str) -> str:
    return f"advantage/{name}/{statistic}"


# --------------------------------------------------------- per optimizer step
SOLVED = "solved"
WEIGHTS = "weights"
FALLBACK = "fallback"
SKIPPED = "skipped"
ENGINE = "engine"
GRAD_NORM = "grad_norm"
BACKWARD_TIME = "time/backward"
HARMONIZE_TIME = "time/harmonize"
PROBE_TIME = "time/probe"
SOLVE_PIECES = "solve/pieces"  # micro-steps a solve on part of the step saw
OPTIMIZER_TIME = "time/optimizer"
STEP_TIMERS = (BACKWARD_TIME, HARMONIZE_TIME, PROBE_TIME, OPTIMIZER_TIME)
COS_MIN = "harmonize/cos_min"
COS_MEAN = "harmonize/cos_mean"
COS_VAR = "harmonize/cos_var"
STATIONARY = "harmonize/stationary"
STEPS_SINCE_SOLVE = "stale/steps_since_solve"
COS_TO_FRESH = "stale/cos_to_fresh"
FRESH_COS_MIN = "stale/fresh_cos_min"


def harmonize(diagnostic: str) -> str:
    """A conflict diagnostic of the applied update (``cos_min``, ``cos_mean``, ...)."""
    return f"harmonize/{diagnostic}"


def objective_metric(name: str) -> str:
    """A diagnostic the objective reports for the step (``ratio_mean``, ...)."""
    return f"objective/{name}"


def harmonize_of(diagnostic: str, index: int) -> str:
    """A per-objective diagnostic of a step in metrics.jsonl (``harmonize/cos/0``)."""
    return harmonize(f"{diagnostic}/{index}")


STALENESS = (STEPS_SINCE_SOLVE, COS_TO_FRESH, FRESH_COS_MIN)

# ------------------------- per optimizer step, as the loggers (TensorBoard, W&B, MLflow) name it
# Flat series on the global optimizer step, per-objective values named by objective.
STEP_PREFIX = "step/"
STEP_COS_MIN = "step/cos_min"
STEP_SOLVED = "step/solved"
STEP_FALLBACK = "step/fallback"  # 1 when the step's solve fell back, else 0
STEP_GRAD_NORM = "step/grad_norm"
SAMPLES = "samples"  # the epoch's grid of sample images


def step_scalar(key: str) -> str:
    """A step-level name of metrics.jsonl as the loggers name it (``step/stale/...``)."""
    return STEP_PREFIX + key


def step_weight(objective: str) -> str:
    return f"step/weight/{objective}"


def step_cos(objective: str) -> str:
    """cos(applied update, the objective's gradient)."""
    return f"step/cos/{objective}"


def step_norm(objective: str) -> str:
    """The norm of the objective's gradient."""
    return f"step/norm/{objective}"
