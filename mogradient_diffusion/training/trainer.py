"""The training loop, one arrow per function:

rollout -> rewards -> advantages -> per-objective gradients or cached weights -> step
-> old-adapter update -> log / checkpoint.

The RL objective (DiffusionNFT, ...) supplies the rollout, the advantages and the loss
pieces (``mogradient_diffusion.objectives``); the strategy supplies the weights; the
gradient plumbing is ``mogradient``'s. Per-epoch data travels as values (``EpochData``).

Randomness is drawn from generators seeded by (seed, rank, epoch, purpose), so a run
resumed from a checkpoint replays the remaining epochs exactly. Under ``torchrun`` the
gradients are averaged with explicit collectives (peft's adapter switching flips
``requires_grad``, which DistributedDataParallel does not allow): the K x D stack on
full-solve steps, ``.grad`` otherwise; weights are solved in float64 on identical data
and broadcast from rank 0. Benchmarks, probes and experiments plug in through
``TrainerCallback`` hooks, never by patching the trainer's methods.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from mogradient import MGDA, conflict_diagnostics, flat_gradient
from mogradient.combinable import CombinableLoss
from mogradient.distributed import apply_weights
from mogradient.gradients import accumulate_gradients
from mogradient_diffusion.config.loading import ConfigError, TrainingConfig, read_run_config
from mogradient_diffusion.model.policy import (
    DTYPES,
    LoraTargetError,
    ParameterEMA,
    Policy,
    PromptEmbeddings,
    old_decay,
)
from mogradient_diffusion.objectives import (
    Objective,
    RewardView,
    RolloutData,
    RolloutRequest,
    StepMetrics,
    TrainPiece,
    build_objective,
)
from mogradient_diffusion.prompts.sources import SampledPrompt
from mogradient_diffusion.prompts.stream import build_prompt_sampler
from mogradient_diffusion.rewards import RewardSet, make_reward
from mogradient_diffusion.rewards.background import BackgroundScoring
from mogradient_diffusion.runs.checkpoint import (
    Restored,
    keep_last,
    latest_checkpoint,
    load_newest_intact,
    save_checkpoint,
)
from mogradient_diffusion.runs.metrics_log import RunLog
from mogradient_diffusion.runs.resume import check_resume, write_resume_record
from mogradient_diffusion.training import metric_keys as keys
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.step_gradients import StepGradients
from mogradient_diffusion.training.strategies import Strategy, build_strategy

LossStream = Iterator[tuple[float, CombinableLoss]]
# Each optimizer step's timers, summed per epoch. The conflict probe's extra gradients are
# a measurement, not part of any method's cost: apart, in time/probe.


@dataclass(frozen=True)
class EpochData:
    """One epoch's rollout and advantages, as values: what its optimizer steps train on.

    ``advantages`` are the objective's ([B, K'] or [B, S, K']), silent objectives masked;
    ``reward_advantages`` the same rows' per-reward ones, for the conflict probe.
    """

    batch: RolloutData
    advantages: torch.Tensor
    reward_advantages: torch.Tensor | None = None


class TrainerCallback:
    """Hooks of one run; override the ones you need."""

    def on_train_start(self, trainer: Trainer) -> None:
        """Everything is built and restored; the first epoch is next."""

    def on_epoch_start(self, trainer: Trainer) -> None:
        """Epoch ``trainer.epoch`` is about to sample."""

    def on_epoch_end(self, trainer: Trainer, record: dict[str, Any]) -> None:
        """Epoch ``trainer.epoch`` ended with ``record`` (what metrics.jsonl gets)."""

    def on_step_start(self, trainer: Trainer, step: list[TrainPiece]) -> None:
        """An optimizer step on ``step`` begins."""

    def replace_step(
        self, trainer: Trainer, step: list[TrainPiece], generator: torch.Generator
    ) -> dict[str, Any] | None:
        """Return a step record to take the optimizer step's place (nothing is applied),
        or None to let it run. ``step`` has its silent objectives masked (NaN)."""
        return None

    def on_step_end(self, trainer: Trainer, step: list[TrainPiece], record: dict[str, Any]) -> None:
        """The optimizer step on ``step`` ended with ``record``."""


class RunComplete(Exception):
    """The run already has the epochs asked for: there is nothing to train."""


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot skip; nothing of them was saved."""


class Trainer:
    """Owns the policy, rewards, strategy and optimizer of one run.

    Rewards and prompts are built before the pipeline loads, so a wrong reward path or
    an unreadable prompt file fails in seconds, as a ConfigError.
    """

    def __init__(
        self,
        config: TrainingConfig,
        world: World,
        allow_config_change: bool = False,
        callbacks: Sequence[TrainerCallback] = (),
    ) -> None:
        self.config = config
        self.world = world
        self.allow_config_change = allow_config_change
        self.callbacks = tuple(callbacks)
        self.run_dir = Path(config.run.directory)
        self.rewards = build_rewards(config)
        self.reward_names = [r.name for r in config.rewards]
        self.prompt_sampler = build_prompt_sampler(config.prompts, seed=config.run.seed)
        self._restored, self._resume_changes = self._saved_run()
        if self._restored is not None and self._restored.state["epoch"] >= config.train.epochs:
            raise RunComplete(
                f"{self.run_dir} is already at epoch {self._restored.state['epoch']} "
                f"(train.epochs={config.train.epochs}): nothing to train, nothing written; "
                "raise train.epochs to continue"
            )
        model_path = self._model_path()
        torch.manual_seed(config.run.seed)  # same LoRA init everywhere, whatever ran before
        try:
            self.policy = Policy.load(
                model_path,
                config.lora,
                device=world.device,
                dtype=DTYPES[config.model.dtype],
                gradient_checkpointing=config.model.gradient_checkpointing,
            )
        except LoraTargetError as error:
            raise ConfigError(str(error)) from None
        self.parameters = self.policy.trainable_parameters()
        self.gradients = StepGradients(
            self.policy.transformer,
            self.parameters,
            config.train.gradient_engine,
            compute_dtype=DTYPES[config.model.dtype],
        )
        self._synchronize_adapters()
        self.strategy: Strategy = build_strategy(
            config.strategy, self.reward_names, seed=config.run.seed
        )
        train = config.train
        self.optimizer = torch.optim.AdamW(
            self.parameters,
            lr=train.learning_rate,
            betas=train.adam_betas,
            weight_decay=train.weight_decay,
        )
        self.ema = ParameterEMA(self.parameters, decay=train.ema_decay)
        self.rewards.to(world.device)
        self.objective: Objective = build_objective(
            config.objective.name, config.objective.settings
        )
        self.epoch = 0
        self.optimizer_step = 0
        self._nonfinite_streak = 0  # consecutive skipped optimizer steps
        self._probe_input: tuple[torch.Tensor, PromptEmbeddings] | None = None

    # ----------------------------------------------------------------- run
    def run(self) -> Path:
        """Train from the latest checkpoint (if any) to the configured number of epochs."""
        if self._restored is not None:
            self._restore(self._restored)
            self._restored = None  # the state is loaded; free it
        changes = self._resume_changes
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            first_config = self.run_dir / "config.yaml"
            if changes is None:
                first_config.write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
            else:
                write_resume_record(self.run_dir, self.config.to_dict(), self.epoch, changes)
        log = RunLog(self.run_dir, resume_from_step=self.epoch) if self.world.is_main else None
        bar = tqdm(
            total=self.config.train.epochs,
            initial=self.epoch,
            desc="epochs",
            disable=not self.world.is_main or self.config.run.quiet,
        )
        for callback in self.callbacks:
            callback.on_train_start(self)
        try:
            while self.epoch < self.config.train.epochs:
                record = self.train_epoch()
                if log is not None:
                    log.log(self.epoch, record)
                bar.update(1)
                bar.set_postfix(_summary(record, self.reward_names))
                self.epoch += 1
                last = self.epoch == self.config.train.epochs
                if last or self.epoch % self.config.run.checkpoint_every == 0:
                    self._checkpoint()
            if self.world.is_main:
                self._export_lora()
        finally:
            bar.close()
            if log is not None:
                log.close()
        return self.run_dir

    def train_epoch(self) -> dict[str, Any]:
        """One epoch: sample, score, estimate advantages, train, update the old adapter."""
        for callback in self.callbacks:
            callback.on_epoch_start(self)
        times: dict[str, float] = {}
        started = time.perf_counter()
        drawn = self._epoch_prompts()
        per_image = self.config.rollout.images_per_prompt
        prompts = [item.prompt for item in drawn for _ in range(per_image)]
        metadata = [item.metadata for item in drawn for _ in range(per_image)]
        background = None
        if self.config.rollout.overlap_rewards:
            background = BackgroundScoring(self.rewards, prompts, metadata)
        request = RolloutRequest(
            prompts=[item.prompt for item in drawn],
            metadata=[item.metadata for item in drawn],
            settings=self.config.rollout,
            timestep_fraction=self.config.train.timestep_fraction,
            generator=self._generator("rollout"),
            progress=self.world.is_main and not self.config.run.quiet,
            on_images=None if background is None else background.submit,
        )
        batch = self.objective.rollout(self.policy, request, self._score)
        if not all_finite([batch.images]):
            raise NonFiniteError(
                f"epoch {self.epoch}: the policy sampled non-finite images (diverged weights: "
                "is train.learning_rate or lora.alpha far too large?); the rewards were not "
                f"asked to score them; {self._kept_checkpoint()}"
            )
        times[keys.ROLLOUT_TIME] = time.perf_counter() - started
        started = time.perf_counter()  # overlapped: only the wait after sampling is counted
        if background is not None:
            rewards, reward_seconds = background.collect()
        else:
            rewards, reward_seconds = self.rewards(batch.images, prompts, metadata)
        times[keys.REWARD_TIME] = time.perf_counter() - started
        epoch_data, stats = self._advantages(rewards, batch)
        started = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        step_records = self._train_on(epoch_data)
        for key in keys.STEP_TIMERS:
            times[key] = sum(record[key] for record in step_records)
        times[keys.TRAIN_TIME] = time.perf_counter() - started
        # The reference schedules count optimizer steps, not epochs.
        decay = old_decay(
            self.config.train.old_schedule, self.optimizer_step, self.config.train.old_cap
        )
        self.policy.update_old(decay)
        record = self._epoch_record(rewards, stats, step_records, times, reward_seconds, decay)
        for callback in self.callbacks:
            callback.on_epoch_end(self, record)
        return record

    def _score(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> torch.Tensor:
        """Every reward on some images: the scorer objectives get for intermediate states."""
        return self.rewards(images, prompts, metadata)[0]

    # ---------------------------------------------------------- advantages
    def _advantages(
        self, rewards: torch.Tensor, batch: RolloutData
    ) -> tuple[EpochData, dict[str, Any]]:
        """The objective's advantages from the whole (all-rank) batch, for this rank's rows.

        Objectives without a nonzero advantage anywhere are masked (NaN) on every rank.
        With the conflict probe on, per-reward advantages of the same rows come along.
        """
        all_rewards = self.world.all_gather_rows(rewards.to(self.world.device)).cpu()
        groups_per_rank = self.config.rollout.prompts_per_epoch // self.world.size
        all_groups = self.world.all_gather_rows(
            (batch.group_ids + self.world.rank * groups_per_rank).to(self.world.device)
        ).cpu()
        epoch = self.epoch
        view = RewardView(
            rewards=all_rewards,
            group_ids=all_groups,
            rows=slice(self.world.rank * len(rewards), (self.world.rank + 1) * len(rewards)),
            to_objectives=lambda values: self.strategy.objective_rewards(values, epoch),
            gather=lambda local: self.world.all_gather_rows(local.to(self.world.device)).cpu(),
        )
        estimated = self.objective.advantages(batch, view)
        advantages, silent = self._mask_silent(estimated.values)
        reward_advantages = None
        if self.config.run.conflict_probe:
            per_reward = dataclasses.replace(view, to_objectives=lambda values: values)
            probe = self.objective.advantages(batch, per_reward, probe=True)
            reward_advantages = self._mask_silent(probe.values)[0]
        stats = {"all_rewards": all_rewards, "silent": silent.tolist(), **estimated.stats}
        return EpochData(batch, advantages, reward_advantages), stats

    def _mask_silent(self, advantages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mark objectives whose advantages are all zero (or NaN) on every rank as not
        applicable: (masked advantages, silent per objective).

        With every advantage zero (e.g. every group got identical rewards) an objective's
        NFT gradient is only the symmetric pull towards the old policy, which is round-off
        while default == old; normalize-and-rescale would blow that up to unit size (seen:
        a raw weight of 1.7e6). As NaN it gets exactly zero coefficients and the
        harmonizer drops it. Advantages are [..., K]: per sample, or per sample and step.
        """
        local = has_signal(advantages).to(torch.float32).to(self.world.device)
        signal = self.world.average(local).cpu() > 0
        return mask_objectives(advantages, ~signal), ~signal

    # ------------------------------------------------------------ training
    def _train_on(self, data: EpochData) -> list[dict[str, Any]]:
        """All optimizer steps of one epoch, on shuffled micro-batches of the rollout
        (with ``train.group_batches``, cut from the prompt groups one after another)."""
        train = self.config.train
        generator = self._generator("train")
        order = torch.randperm(len(data.batch), generator=generator)
        if train.group_batches:  # whole groups in shuffled order, each group's rows together
            ids = data.batch.group_ids[order]
            groups = torch.randperm(int(ids.max()) + 1, generator=generator)
            order = torch.cat([order[ids == group] for group in groups])
        micro = [order[i : i + train.batch_size] for i in range(0, len(order), train.batch_size)]
        records = []
        for first in range(0, len(micro), train.gradient_accumulation):
            rows = micro[first : first + train.gradient_accumulation]
            step = [TrainPiece(data.batch.rows(r), data.advantages[r]) for r in rows]
            probe = None
            if data.reward_advantages is not None:
                probe = [
                    TrainPiece(piece.data, data.reward_advantages[r])
                    for piece, r in zip(step, rows, strict=True)
                ]
            for callback in self.callbacks:
                callback.on_step_start(self, step)
            record = self.optimizer_step_on(step, generator, probe)
            for callback in self.callbacks:
                callback.on_step_end(self, step, record)
            records.append(record)
        return records

    def optimizer_step_on(
        self,
        step: list[TrainPiece],
        generator: torch.Generator,
        probe: list[TrainPiece] | None = None,
    ) -> dict[str, Any]:
        """One iteration of MARBLE's Algorithm 1 (any strategy fits the same steps).

        On a solve step: the K per-objective gradients of the step's loss, a fresh solve
        on them, their weighted sum applied. Otherwise: the cached (or fixed) weights and
        one combined backward, the same sum without the K gradients. Then clip and step.
        ``probe``: the same rows with per-reward advantages, for the conflict probe.
        """
        count = step[0].advantages.shape[-1]
        step, signal = self._mask_silent_in_step(step)
        for callback in self.callbacks:
            replaced = callback.replace_step(self, step, generator)
            if replaced is not None:
                return replaced
        if not signal.any():
            # No objective has an applicable sample with signal: stepping would only let
            # Adam's momentum replay earlier gradients (and the KL pull alone).
            self.optimizer_step += 1
            return skipped_step_record("no reward signal", count)
        replay = generator.get_state()
        metrics = StepMetrics()
        losses = self.objective.losses(self.policy, step, generator, metrics)
        if self.strategy.needs_gradients():
            weights, record = self._solve_step(losses, count, self._replayer(step, replay))
        else:
            weights, record = self._combined_step(losses, count)
        record.update(
            {keys.objective_metric(key): value for key, value in metrics.summary().items()}
        )
        started = time.perf_counter()
        record[keys.PROBE_TIME] = 0.0
        if probe is not None and not record[keys.SOLVED]:
            probe, _ = self._mask_silent_in_step(probe)
            record.update(self._conflict_probe(probe, self._replayer(probe, replay)))
            record[keys.PROBE_TIME] = time.perf_counter() - started
        record[keys.WEIGHTS] = [float(w) for w in weights]
        started = time.perf_counter()
        self._apply_step(record)
        record[keys.OPTIMIZER_TIME] = time.perf_counter() - started
        return record

    def _replayer(self, step: list[TrainPiece], state: torch.Tensor) -> Callable[[], LossStream]:
        """A fresh copy of ``step``'s loss stream (same draws from generator ``state``),
        whose diagnostics go nowhere: for the probe and the engine check."""

        def replay() -> LossStream:
            generator = torch.Generator()
            generator.set_state(state)
            return self.objective.losses(self.policy, step, generator, StepMetrics())

        return replay

    def _solve_step(
        self, losses: LossStream, count: int, replay: Callable[[], LossStream]
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Per-objective gradients (the KL term straight to ``.grad``), solve, apply."""
        started = time.perf_counter()
        stack = self.gradients.stack(losses, count)
        record: dict[str, Any] = {keys.BACKWARD_TIME: time.perf_counter() - started}
        self._check_engine(stack, replay, count)
        started = time.perf_counter()
        self.world.average_gradients(self.parameters)
        stack = self.world.average(stack)
        solved = self.strategy.weights(stack, count)
        weights, direction = apply_weights(self.parameters, stack, solved.weights, accumulate=True)
        diagnostics = conflict_diagnostics(
            weights,
            jacobian=stack,
            direction=direction,
            dropped=solved.harmonization.dropped if solved.harmonization else (),
            fallback=solved.fallback,
        )
        record.update(
            {keys.harmonize(k): v for k, v in diagnostics.items() if not isinstance(v, list)}
        )
        record[keys.HARMONIZE_TIME] = time.perf_counter() - started
        record.update(solved=1, fallback=solved.fallback, engine=self.gradients.name)
        return weights, record

    def _check_engine(
        self, stack: torch.Tensor, replay: Callable[[], LossStream], count: int
    ) -> None:
        """Once per process: the per-row engine against K backward passes (every rank
        agrees on the outcome). On a disagreement the stack is replaced by the
        K-backward one and the run goes on with that engine."""
        if self.gradients.checked:
            return
        engine = self.gradients.name
        reason, reference = self.gradients.check(stack, replay, count)
        failed = torch.tensor([0.0 if reason is None else 1.0], device=self.world.device)
        if float(self.world.average(failed)) > 0:
            self.gradients.use_k_backward()
            stack.copy_(reference)
            self._warn(
                f"the {engine} gradient engine disagreed with K backward passes on this "
                f"model ({reason or 'on another rank'}); training goes on with the "
                "K-backward engine (train.gradient_engine=batched)"
            )

    def _combined_step(self, losses: LossStream, count: int) -> tuple[torch.Tensor, dict[str, Any]]:
        """Rank 0's cached or fixed weights, and one combined backward per piece."""
        cached = self.strategy.weights(None, count)
        weights = self.world.broadcast(cached.weights)
        started = time.perf_counter()
        accumulate_gradients(losses, self.parameters, weights)
        record: dict[str, Any] = {keys.BACKWARD_TIME: time.perf_counter() - started}
        started = time.perf_counter()
        self.world.average_gradients(self.parameters)
        record[keys.HARMONIZE_TIME] = time.perf_counter() - started
        record.update(solved=0, fallback=cached.fallback)
        return weights, record

    def _apply_step(self, record: dict[str, Any]) -> None:
        """Clip, step (or skip a non-finite gradient), refuse non-finite weights."""
        record["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(self.parameters, self.config.train.grad_clip)
        )
        if math.isfinite(record["grad_norm"]):
            self.optimizer.step()
            self.ema.update()
            self._nonfinite_streak = 0
        else:
            record[keys.SKIPPED] = "non-finite gradients"
            self._skip_nonfinite_step()
        self.optimizer.zero_grad(set_to_none=True)
        if not all_finite(self.parameters):
            raise NonFiniteError(
                f"the LoRA weights became non-finite at optimizer step {self.optimizer_step} "
                "although the gradients were finite (is train.learning_rate far too large?); "
                "stopped before checkpointing them"
            )
        self.optimizer_step += 1

    def _skip_nonfinite_step(self) -> None:
        """Log a skipped step; stop after ``train.max_nonfinite_steps`` in a row."""
        self._nonfinite_streak += 1
        limit = self.config.train.max_nonfinite_steps
        if self._nonfinite_streak > limit:
            raise NonFiniteError(
                f"{self._nonfinite_streak} optimizer steps in a row had non-finite gradients "
                f"(train.max_nonfinite_steps={limit}); stopped, the last checkpoint is intact"
            )
        self._warn(
            f"optimizer step {self.optimizer_step} skipped: non-finite gradients "
            f"({self._nonfinite_streak} in a row, limit {limit})"
        )

    def _warn(self, message: str) -> None:
        if self.world.is_main:
            tqdm.write(f"mogradient-diffusion: warning: {message}", file=sys.stderr)

    def _conflict_probe(
        self, probe: list[TrainPiece], replay: Callable[[], LossStream]
    ) -> dict[str, float]:
        """cos(applied update, g_k) for every reward, on the step's own samples and noise.

        For steps that did not compute per-reward gradients (scalar baselines, cached
        MARBLE steps): K more gradients from per-reward advantages, replaying the step's
        loss stream from its generator state, against the gradient about to be applied
        (``.grad``, KL term included). With the per-row engine that is one backward pass
        per row value, not one per reward. Timed apart from the step (``time/probe``).
        """
        count = probe[0].advantages.shape[-1]
        stack = self.gradients.stack(replay(), count, apply_extra=False)
        stack = self.world.average(stack)
        direction = flat_gradient(self.parameters).float()
        diagnostics = conflict_diagnostics(torch.ones(count), jacobian=stack, direction=direction)
        record = {  # no weight/k: the probe's unit weights only set the round-off tolerance
            keys.harmonize(k): v
            for k, v in diagnostics.items()
            if not isinstance(v, list) and not k.startswith("weight/")
        }
        return record | self._staleness(stack, direction)

    def _staleness(self, stack: torch.Tensor, direction: torch.Tensor) -> dict[str, float]:
        """How far a cached MARBLE step is from what a fresh solve would apply now.

        Only for MGDA (stateless, so solving here does not change the run): cos between
        the applied update and the fresh direction, and the fresh update's worst cosine.
        """
        amortizer = self.strategy.amortizer
        if self.strategy.scalar_weights is not None or not isinstance(amortizer.harmonizer, MGDA):
            return {}
        fresh = amortizer.harmonizer(stack)
        if fresh.direction is None or not fresh.weights.any():
            return {}
        fresh_diagnostics = conflict_diagnostics(fresh.weights, jacobian=stack)
        cosine = torch.nn.functional.cosine_similarity(
            direction.double(), fresh.direction.double(), dim=0
        )
        return {
            keys.STEPS_SINCE_SOLVE: float(amortizer.steps_since_solve or 0),
            keys.COS_TO_FRESH: float(cosine),
            keys.FRESH_COS_MIN: float(fresh_diagnostics["cos_min"]),
        }

    def _mask_silent_in_step(self, step: list[TrainPiece]) -> tuple[list[TrainPiece], torch.Tensor]:
        """Per step, as per epoch: objectives with no nonzero advantage on any rank sit out.

        Returns the masked pieces and which objectives have signal (the same on every rank).
        """
        _, silent = self._mask_silent(torch.cat([piece.advantages for piece in step]))
        if not silent.any():
            return step, ~silent
        masked = [
            dataclasses.replace(piece, advantages=mask_objectives(piece.advantages, silent))
            for piece in step
        ]
        return masked, ~silent

    # ------------------------------------------------------------- helpers
    def _epoch_prompts(self) -> list[SampledPrompt]:
        """This rank's share of the epoch's prompts (every rank draws the same list)."""
        drawn = self.prompt_sampler.sample(self.config.rollout.prompts_per_epoch)
        per_rank = len(drawn) // self.world.size
        return drawn[self.world.rank * per_rank : (self.world.rank + 1) * per_rank]

    def _generator(self, purpose: str) -> torch.Generator:
        code = {"rollout": 1, "train": 2}[purpose]
        seed = (
            (self.config.run.seed * 1_000_003 + self.world.rank) * 10_007 + self.epoch
        ) * 7 + code
        return torch.Generator().manual_seed(seed % 2**64)  # unchanged for seeds < 2.6e8

    def _model_path(self) -> Path:
        if self.config.model.path is not None:
            return Path(self.config.model.path)
        from mogradient_diffusion.model.tiny import save_tiny_pipeline

        path = self.run_dir / "tiny_model"
        if self.world.is_main and not (path / "model_index.json").exists():
            save_tiny_pipeline(path)
        self.world.barrier()
        return path

    def _epoch_record(self, rewards, stats, step_records, times, reward_seconds, decay):
        record: dict[str, Any] = dict(times)
        all_rewards = stats.pop("all_rewards")
        silent = stats.pop("silent")
        for index, name in enumerate(self.reward_names):
            column = all_rewards[:, index]
            valid = column[~torch.isnan(column)]
            record[keys.reward_mean(name)] = float(valid.mean()) if len(valid) else float("nan")
            population_std = float(valid.std(unbiased=False)) if len(valid) else float("nan")
            record[keys.reward_std(name)] = population_std
            record[keys.reward_time(name)] = float(reward_seconds.get(name, float("nan")))
        objectives = self.strategy.objective_names(self.epoch)
        for key, values in stats.items():
            for name, value in zip(objectives, values.tolist(), strict=True):
                record[keys.advantage_stat(name, key)] = value
        record["old_decay"] = decay
        record[keys.OPTIMIZER_STEPS] = step_records
        record["objectives"] = objectives
        if self.world.size > 1:
            record[keys.PARAMETER_DIVERGENCE] = self.world.divergence(self.parameters)
        record[keys.OBJECTIVES_WITHOUT_SIGNAL] = [
            n for n, s in zip(objectives, silent, strict=True) if s
        ]
        record[keys.REWARDS_WITHOUT_SIGNAL] = [
            name
            for index, name in enumerate(self.reward_names)
            if torch.isnan(all_rewards[:, index]).all()
        ]
        for name in record[keys.REWARDS_WITHOUT_SIGNAL]:
            self._warn(
                f"epoch {self.epoch}: reward {name!r} was NaN (not applicable) for every "
                "image: it gave no training signal"
            )
        if torch.cuda.is_available():
            record[keys.PEAK_MEMORY] = torch.cuda.max_memory_allocated() / 2**30
        return record

    def _check_outputs_finite(self) -> None:
        """Weights can be finite yet diverged (a huge learning rate or LoRA alpha): one
        velocity per adapter on a fixed input keeps them out of the checkpoint."""
        if self._probe_input is None:
            shape = self.policy.latent_shape(self.config.rollout.resolution)
            noise = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
            prompt = self.prompt_sampler.sources[0].prompts[0]
            length = self.config.rollout.max_sequence_length
            embeds = self.policy.encode_prompts([prompt], max_sequence_length=length)
            self._probe_input = (noise.to(self.world.device), embeds)
        noise, embeds = self._probe_input
        with torch.no_grad():
            outputs = [self.policy.velocity(noise, 1.0, embeds, a) for a in ("default", "old")]
        if not all_finite(outputs):
            raise NonFiniteError(
                f"after epoch {self.epoch} the LoRA weights give non-finite velocities: they "
                "diverged (is train.learning_rate or lora.alpha far too large?); not "
                f"checkpointed: {self._kept_checkpoint()}"
            )

    def _kept_checkpoint(self) -> str:
        latest = latest_checkpoint(self.run_dir)
        return "no checkpoint was saved" if latest is None else f"{latest} is intact"

    def _checkpoint(self) -> None:
        self._check_outputs_finite()
        if not self.world.is_main:
            self.world.barrier()
            return
        state = {
            "epoch": self.epoch,
            "optimizer_step": self.optimizer_step,
            "default": self.policy.lora_state("default"),
            "old": self.policy.lora_state("old"),
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict(),
            "strategy": self.strategy.state_dict(),
            "objective": self.objective.state_dict(),
            "sampler": self.prompt_sampler.state_dict(),
            "config": self.config.to_dict(),
        }
        save_checkpoint(self.run_dir, self.epoch, state)
        keep_last(self.run_dir, self.config.run.keep_checkpoints)
        self.world.barrier()

    def _saved_run(self) -> tuple[Restored | None, dict[str, tuple] | None]:
        """The newest intact checkpoint and the config changes resuming it applies (None
        for a new run), checked before any model loads. A run directory whose config.yaml
        has no checkpoint yet is checked too."""
        restored = load_newest_intact(self.run_dir, _check_finite_state, weights_only=False)
        current = self.config.to_dict()
        if restored is not None:
            saved = restored.state["config"]
        elif (self.run_dir / "config.yaml").exists():
            saved = read_run_config(self.run_dir / "config.yaml")
        else:
            return None, None
        changes = check_resume(saved, current, self.run_dir, self.allow_config_change)
        if restored is not None:
            self._check_prompts(restored.state["sampler"])
        return restored, changes

    def _check_prompts(self, saved: dict[str, Any]) -> None:
        """The prompt files must be those the run was saved with: another line count is
        refused (the saved position means nothing there), edited text needs the flag."""
        try:
            self.prompt_sampler.check_state(saved)
        except ValueError as error:
            raise ConfigError(
                f"{self.run_dir}: the prompt files changed since the run was saved ({error}); "
                "restore them, or use a new run.directory"
            ) from None
        edited = self.prompt_sampler.edited_sources(saved)
        if edited and not self.allow_config_change:
            raise ConfigError(
                f"{self.run_dir}: the text of prompt source(s) {edited} changed since the run "
                "was saved (same number of prompts); restore the files, pass "
                "--allow-config-change to train on the new text from here on, or use a new "
                "run.directory"
            )
        for name in edited:
            self._warn(f"prompt source {name!r} was edited since the run was saved")

    def _restore(self, restored: Restored) -> None:
        """Continue from a checkpoint; the optimizer and EMA take the config's settings."""
        for reason in restored.passed_over:
            self._warn(f"checkpoint passed over: {reason}")
        if restored.passed_over:
            self._warn(f"resuming from {restored.path}")
        state = restored.state
        self.policy.load_lora_state("default", state["default"])
        self.policy.load_lora_state("old", state["old"])
        self.optimizer.load_state_dict(state["optimizer"])
        train = self.config.train
        for group in self.optimizer.param_groups:  # the saved state carries the old ones
            group.update(
                lr=train.learning_rate, betas=train.adam_betas, weight_decay=train.weight_decay
            )
        self.ema.load_state_dict(state["ema"])
        self.ema.decay = train.ema_decay
        self.strategy.load_state_dict(state["strategy"])
        self.objective.load_state_dict(state.get("objective", {}))  # none saved before 12
        self.prompt_sampler.load_state_dict(state["sampler"])
        self.epoch = int(state["epoch"])
        self.optimizer_step = int(state["optimizer_step"])
        epochs = self.world.all_gather_rows(torch.tensor([self.epoch], device=self.world.device))
        if (epochs != self.epoch).any():
            raise RuntimeError(
                f"ranks resumed from different checkpoints (epochs {epochs.tolist()}): every "
                f"rank must see the same {self.run_dir}/checkpoints (a shared filesystem)"
            )

    def _synchronize_adapters(self) -> None:
        """Start every replica from rank 0's adapters (both trained and rollout)."""
        for adapter in ("default", "old"):
            state = self.policy.lora_state(adapter)
            self.world.broadcast_parameters(list(state.values()))
            self.policy.load_lora_state(adapter, state)

    def _export_lora(self) -> None:
        self.policy.save_lora(self.run_dir / "lora", adapter="default")
        with self.ema.swap_in():
            self.policy.save_lora(self.run_dir / "lora_ema", adapter="default")


def build_rewards(config: TrainingConfig) -> RewardSet:
    """The configured rewards; a constructor that fails (missing weights, bad option values,
    a user reward's own check) is a configuration error naming the reward."""
    rewards = []
    for reward in config.rewards:
        try:
            rewards.append(make_reward(reward.name, **reward.options))
        except Exception as error:
            raise ConfigError(f"reward {reward.name!r} could not be built: {error}") from error
    return RewardSet(rewards)


def skipped_step_record(reason: str, count: int) -> dict[str, Any]:
    """The record of an optimizer step that applied nothing (``count`` objectives)."""
    idle = dict.fromkeys(keys.STEP_TIMERS, 0.0)
    return idle | {keys.SKIPPED: reason, keys.SOLVED: 0, keys.WEIGHTS: [0.0] * count}


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one device sync)."""
    return bool(torch.stack([t.detach().isfinite().all() for t in tensors]).all())


def _check_finite_state(state: dict[str, Any]) -> None:
    """Reject a checkpoint holding non-finite LoRA or EMA weights (a poisoned run)."""
    tensors = [*state["default"].values(), *state["old"].values(), *state["ema"]["shadow"]]
    if not all_finite(tensors):
        raise ValueError("it holds non-finite LoRA or EMA weights")


def _summary(record: dict[str, Any], reward_names: list[str]) -> dict[str, str]:
    """The progress bar's fields: each reward's mean, and with one objective per reward
    the weight its gradient got in the epoch's last step (on the raw gradients)."""
    summary = {name: f"{_number(record.get(f'reward/{name}/mean')):.3g}" for name in reward_names}
    steps = record.get(keys.OPTIMIZER_STEPS) or [{}]
    weights = steps[-1].get(keys.WEIGHTS) or []
    if len(weights) == len(reward_names):
        for name, weight in zip(reward_names, weights, strict=True):
            summary[name] += f" (weight {weight:.2g})"
    return summary


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


def has_signal(advantages: torch.Tensor) -> torch.Tensor:
    """Per objective (last dimension): whether any advantage is nonzero (NaN counts as 0)."""
    return (advantages.nan_to_num(0.0) != 0).flatten(0, -2).any(dim=0)


def mask_objectives(advantages: torch.Tensor, silent: torch.Tensor) -> torch.Tensor:
    """The advantages with every objective marked in ``silent`` set to NaN (not applicable)."""
    masked = advantages.clone()
    masked[..., silent] = float("nan")
    return masked
