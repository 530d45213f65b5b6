"""The objective interface: what an RL objective hands the multi-reward training loop.

The trainer knows nothing of any objective's maths. Per epoch it asks the objective to

1. ``rollout``: sample this rank's prompts with the sampler the objective needs (a
   deterministic ODE, the SDE with per-step log-probs, or pairs that share x_T) and
   return a [`RolloutData`][mogradient_diffusion.objectives.base.RolloutData] holding, as values,
   everything the losses will need (NFT: final latents, sigmas, embeddings, group ids; Flow-GRPO:
   per-step x_t, x_next, log p_old, sigmas; SDPO: pairs, per-step log-probs and x0 predictions). The
   trainer then scores ``images`` with every reward (possibly overlapped with sampling); an
   objective that scores intermediate states itself (SDPO) uses the ``score`` callable it
   is given.
2. ``advantages``: turn the rewards of the whole (all-rank) batch into advantages for this
   rank's rows, one column per strategy objective: [B, K'] per sample (NFT, Flow-GRPO) or
   [B, S, K'] per sample and step (SDPO). NaN marks "this objective does not apply here".
3. ``losses``: for the micro-batches of one optimizer step, yield ``(scale, loss)`` pieces,
   each loss a [`CombinableLoss`][mogradient.combinable.CombinableLoss] (shared differentiable
   per-sample terms, constant per-objective coefficients, non-harmonized terms such as a
   KL penalty in ``extra``) so that ``sum scale * loss.combined(w)`` is the step's loss for
   any weights ``w`` at once. This is what makes MARBLE's cached steps exact: one backward
   of the combined loss equals the weighted sum of the K per-objective gradients.

Objectives may keep state across epochs (SDPO's per-(prompt, step) statistics tracker):
``state_dict`` goes into every checkpoint and ``load_state_dict`` gets it back on resume.

Conventions shared by every objective: a rank's rows are ``prompts x images_per_prompt``
samples (a prompt's rows adjacent, sharing a group id); rewards are [N, K] float tensors
with NaN where a reward does not apply; the policy's velocity convention is SD3's flow
matching, x_t = (1 - t) x0 + t noise, v = noise - x0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

import torch

from mogradient.combinable import CombinableLoss

if TYPE_CHECKING:
    from mogradient_diffusion.config.settings import RolloutConfig, TrainConfig
    from mogradient_diffusion.model.policy import Policy

Scorer = Callable[[torch.Tensor, list[str], list[dict[str, Any]]], torch.Tensor]
"""``score(images [N, 3, H, W] in [0, 1], prompts [N], metadata [N]) -> rewards [N, K]``.

Every configured reward, in config order, NaN where a reward does not apply. Handed to
``Objective.rollout`` for objectives that score intermediate predictions (SDPO); it blocks
until the scores exist. The final images are scored by the trainer, not through it.
"""


@runtime_checkable
class RolloutData(Protocol):
    """One rank's rollout, as values; what the trainer reads of it is listed here.

    An objective's own rollout type adds whatever its losses need (per-step tensors are
    [B, S, ...] with the sample first). ``rows`` must select every per-sample field and
    keep shared ones (a sigma schedule) whole: micro-batches are made with it.
    """

    prompts: list[str]  # [B] one per sample
    group_ids: torch.Tensor  # [B] this rank's prompt index of each sample (0 .. prompts - 1)
    images: torch.Tensor  # [B, 3, H, W] in [0, 1]: the final images the rewards score

    def __len__(self) -> int: ...

    def rows(self, indices: torch.Tensor) -> RolloutData:
        """The samples ``indices`` (a 1-D long tensor) as a rollout of their own."""
        ...


@dataclass(frozen=True)
class RolloutRequest:
    """What the trainer asks to be sampled on this rank this epoch.

    ``prompts`` and ``metadata`` hold one entry per prompt group (each sampled
    ``settings.images_per_prompt`` times). ``timestep_fraction`` is the share of the
    ``settings.steps`` sampling steps to train on (``train.timestep_fraction``; the
    references train ``int(fraction x steps)`` of them): an objective that needs
    per-step values keeps them for those steps only, and records on its rollout data
    what its losses need to know. ``generator`` is the epoch's rollout
    generator: draw all sampling noise from it, so a resumed run replays the epoch.
    ``on_images(rows, images)`` (when given) must be called with each chunk's final
    images as soon as they exist, so the rewards can score them while sampling goes on.
    """

    prompts: list[str]
    metadata: list[dict[str, Any]]
    settings: RolloutConfig
    timestep_fraction: float
    generator: torch.Generator
    progress: bool = False
    on_images: Callable[[slice, torch.Tensor], object] | None = None


@dataclass(frozen=True)
class RewardView:
    """The epoch's rewards as an objective's advantage estimator sees them.

    ``rewards`` [B_all, K] and ``group_ids`` [B_all] hold every rank's rows in rank order
    (prompt groups are unique across ranks); ``rows`` are this rank's rows in them.
    ``to_objectives`` is the strategy's map from the K rewards to its K' objectives
    (identity for MARBLE and harmonizers, a weighted sum for the scalar baselines),
    applicable to any [..., K] tensor (SDPO's dense [B, S, K] rewards too). ``gather``
    concatenates a per-rank tensor's rows over all ranks, returned on the CPU (the
    identity on one process), for statistics of an objective's own rollout values.
    ``clip`` False asks for unclipped advantages: MARBLE as released mixes them and
    clips the mix (the NFT loss clips what it is given).
    """

    rewards: torch.Tensor
    group_ids: torch.Tensor
    rows: slice
    to_objectives: Callable[[torch.Tensor], torch.Tensor]
    gather: Callable[[torch.Tensor], torch.Tensor]
    clip: bool = True


@dataclass(frozen=True)
class Advantages:
    """Advantages for this rank's rows, and statistics to log.

    ``values``: [B, K'] (per sample) or [B, S, K'] (per sample and step), float32, NaN
    where objective k does not apply to a sample. The trainer masks an objective whose
    values are all zero or NaN over the batch (or over an optimizer step) to NaN, so an
    objective's losses must give an exactly zero coefficient wherever an advantage is NaN
    (``mogradient.combinable.masked_mean_coefficients`` does that). ``stats``: name ->
    tensor [K'] (logged as ``advantage/<objective>/<name>``), computed on all ranks' rows.
    """

    values: torch.Tensor
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainPiece:
    """One micro-batch of an optimizer step: rollout rows and their advantage rows."""

    data: RolloutData
    advantages: torch.Tensor  # the rows of Advantages.values, after the trainer's masking

    def __len__(self) -> int:
        return len(self.advantages)


def applicable_counts(step: Sequence[TrainPiece]) -> torch.Tensor:
    """[K'] how many entries (samples, or sample-steps) of the whole optimizer step each
    objective applies to: the denominators that make a step's loss its mean whatever
    pieces it is cut into."""
    return sum((~torch.isnan(piece.advantages)).flatten(0, -2).sum(dim=0) for piece in step)


class StepMetrics:
    """Weighted means of per-step diagnostics an objective reports while it yields losses.

    ``add("ratio/mean", value, weight)`` may be called any number of times per name;
    ``summary()`` gives each name's weighted mean as a float (logged in the optimizer
    step's record under ``objective/<name>``). Values are this rank's.
    """

    def __init__(self) -> None:
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}

    def add(self, name: str, value: float | torch.Tensor, weight: float = 1.0) -> None:
        value = float(value)
        self._sums[name] = self._sums.get(name, 0.0) + weight * value
        self._weights[name] = self._weights.get(name, 0.0) + weight

    def summary(self) -> dict[str, float]:
        return {
            name: total / self._weights[name] if self._weights[name] else float("nan")
            for name, total in self._sums.items()
        }


@runtime_checkable
class Objective(Protocol):
    """An RL objective for the multi-reward loop; see the module docstring for the flow.

    Build one with ``cls(settings)``, ``settings`` an instance of ``settings_type``: a
    frozen dataclass whose ``__post_init__`` raises ValueError naming the bad field (the
    config layer turns that into a ConfigError). Its fields are the keys accepted in the
    ``objective:`` config section besides ``name``; a key it does not declare is refused.
    """

    name: ClassVar[str]
    settings_type: ClassVar[type]
    settings: Any

    @classmethod
    def check_config(cls, settings: Any, rollout: RolloutConfig, train: TrainConfig) -> None:
        """Raise ConfigError (naming the key) for settings elsewhere in the config that
        this objective (with its ``settings``) cannot honour or would silently ignore (a
        sampler it does not use, a train.timestep_fraction that trains no step)."""
        ...

    def rollout(self, policy: Policy, request: RolloutRequest, score: Scorer) -> RolloutData:
        """Sample ``request`` with the ``old`` adapter, without gradients."""
        ...

    def advantages(
        self, batch: RolloutData, view: RewardView, *, probe: bool = False
    ) -> Advantages:
        """Advantages of this rank's ``batch`` from ``view``.

        Called once per epoch for training, and with ``probe=True`` and an identity
        ``to_objectives`` for per-reward diagnostics (the conflict probe): a probe call
        must not change the objective's state (a tracker updates on the training call).
        Every rank sees the same ``view.rewards``, so batch-wide statistics agree.
        """
        ...

    def losses(
        self,
        policy: Policy,
        step: Sequence[TrainPiece],
        generator: torch.Generator,
        metrics: StepMetrics,
    ) -> Iterator[tuple[float, CombinableLoss]]:
        """The pieces of one optimizer step's loss, built lazily (one forward at a time).

        ``sum scale * loss.objective_losses()`` must be the step's per-objective losses
        and ``sum scale * loss.extra`` its non-harmonized term, independent of how the
        step's rows are cut into pieces (normalize by counts over the whole ``step``,
        not per piece). Draw all randomness (timesteps, noise) from ``generator``: the
        conflict probe replays a step's stream from the generator state it started with,
        so the stream must be a function of (step, generator state, parameters). Report
        diagnostics to ``metrics``; the probe passes a throwaway one.
        """
        ...

    def state_dict(self) -> dict[str, Any]:
        """State carried across epochs (empty when there is none); saved in checkpoints."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def check_real(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    open_low: bool = False,
) -> None:
    """One check for every objective's numeric settings: a real, finite number in range
    (TypeError for a non-number, ValueError otherwise; the config names the key)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}")
    if low is not None and (value < low or (open_low and value == low)):
        raise ValueError(f"{name} must be {'>' if open_low else '>='} {low:g}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high:g}, got {value!r}")


class Stateless:
    """Defaults for an objective without cross-epoch state or config constraints."""

    @classmethod
    def check_config(cls, settings: Any, rollout: RolloutConfig, train: TrainConfig) -> None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"this objective keeps no state, got keys {sorted(state)}")
