"""The two slow copies of the trained LoRA: the old (rollout) adapter's decay schedule,
and the EMA of the weights that evaluation uses."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

# schedule -> (flat steps, rate per step, default cap), as in the official DiffusionNFT code.
OLD_DECAY_SCHEDULES = {
    "copy": (0, 0.0, 0.0),
    "linear": (0, 0.001, 0.5),
    "delayed_linear": (75, 0.0075, 0.999),
}


def old_decay(schedule: str, step: int, cap: float | None = None) -> float:
    """Decay for ``Policy.update_old`` after ``step`` optimizer steps (the reference's global step).

    ``copy``: 0 (old = default). ``linear``: step * 0.001, capped at 0.5 (MARBLE's recipe
    raises the cap to 0.95). ``delayed_linear``: 0 for 75 steps, then (step - 75) * 0.0075,
    capped at 0.999. ``cap`` overrides the schedule's cap.
    """
    if schedule not in OLD_DECAY_SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(OLD_DECAY_SCHEDULES)}, got {schedule!r}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    flat, rate, default_cap = OLD_DECAY_SCHEDULES[schedule]
    cap = default_cap if cap is None else cap
    if not 0.0 <= cap < 1.0:
        raise ValueError(f"cap must be in [0, 1), got {cap!r}")
    if step < flat:
        return 0.0
    return min((step - flat) * rate, cap)


class ParameterEMA:
    """EMA of trained parameters for evaluation, with the reference's warm-up.

    Each [`update`][mogradient_diffusion.training.ema.ParameterEMA.update] (one per optimizer step)
    uses decay min(decay, (1 + n) / (10 + n)), n = updates so far including this one, as the
    reference calls it with the already incremented global step; so early averages follow the
    weights closely.
    """

    def __init__(self, parameters: Sequence[nn.Parameter], decay: float = 0.9) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay!r}")
        self.parameters = list(parameters)
        self.decay = float(decay)
        self.num_updates = 0
        self.shadow = [p.detach().clone() for p in self.parameters]

    def decay_at(self, num_updates: int) -> float:
        """Effective decay of the ``num_updates``-th update."""
        return min(self.decay, (1 + num_updates) / (10 + num_updates))

    @torch.no_grad()
    def update(self) -> None:
        """shadow <- d * shadow + (1 - d) * parameter, after an optimizer step."""
        self.num_updates += 1
        weight = 1.0 - self.decay_at(self.num_updates)
        for shadow, parameter in zip(self.shadow, self.parameters, strict=True):
            shadow.lerp_(parameter.detach(), weight)

    @contextmanager
    def swap_in(self) -> Iterator[None]:
        """Evaluate with the EMA weights inside the block; the trained weights come back after."""
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.parameters]
            for parameter, shadow in zip(self.parameters, self.shadow, strict=True):
                parameter.copy_(shadow)
        try:
            yield
        finally:
            with torch.no_grad():
                for parameter, value in zip(self.parameters, saved, strict=True):
                    parameter.copy_(value)

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "num_updates": self.num_updates,
            "shadow": [s.clone() for s in self.shadow],
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        """Restore decay, update count and averages (shapes must match the tracked parameters)."""
        if len(state["shadow"]) != len(self.shadow):
            raise ValueError(
                f"EMA state has {len(state['shadow'])} tensors, expected {len(self.shadow)}"
            )
        for shadow, value in zip(self.shadow, state["shadow"], strict=True):
            shadow.copy_(value)
        self.decay = float(state["decay"])
        self.num_updates = int(state["num_updates"])
