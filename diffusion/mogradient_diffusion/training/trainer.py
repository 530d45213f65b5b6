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

Beside the loop: what it records (``training.records``, ``training.diagnostics``), its
finiteness guards (``training.finite``), and what a checkpoint holds and how a run
resumes (``training.state``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
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

from mogradient.combinable import CombinableLoss
from mogradient.engines import accumulate_gradients, flat_gradient
from mogradient.step import HarmonizedStep, StepReport
from mogradient_diffusion.model.families import Family, family_named
from mogradient_diffusion.model.families.base import UnsupportedGuidance
from mogradient_diffusion.model.pipeline_files import AUTO, pipeline_family
from mogradient_diffusion.model.policy import (
    DTYPES,
    LoraTargetError,
    Policy,
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
from mogradient_diffusion.runs import metric_keys as keys
from mogradient_diffusion.runs.checkpoint import (
    STATE_FILE,
    CorruptCheckpointError,
    Restored,
    export_is_current,
    keep_last,
    latest_checkpoint,
    save_checkpoint,
    write_export,
)
from mogradient_diffusion.runs.loggers.samples import sample_grid
from mogradient_diffusion.runs.metrics_log import RunLog
from mogradient_diffusion.runs.resume import write_resume_record
from mogradient_diffusion.strategies import Strategy, build_strategy
from mogradient_diffusion.training.diagnostics import probe_record
from mogradient_diffusion.training.distributed import World
from mogradient_diffusion.training.ema import ParameterEMA, old_decay
from mogradient_diffusion.training.finite import DivergenceProbe, NonFiniteError, all_finite
from mogradient_diffusion.training.records import (
    epoch_record,
    progress_summary,
    skipped_step_record,
)
from mogradient_diffusion.training.state import TrainingState, saved_run
from mogradient_diffusion.training_config import ConfigError, TrainingConfig

LossStream = Iterator[tuple[float, CombinableLoss]]
# The exported adapters: the trained weights and their EMA.
EXPORTS = {"lora": "trained", "lora_ema": "ema"}
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
    """The run already has the epochs asked for, and their exports: nothing to do."""


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
        self.world = world
        self.allow_config_change = allow_config_change
        self.callbacks = tuple(callbacks)
        self.run_dir = Path(config.run.directory)
        self.rewards = build_rewards(config)
        self._intermediate_images = 0  # scored by _score this epoch (SDPO's anchor states)
        self.reward_names = [r.run_name for r in config.rewards]
        self.prompt_sampler = build_prompt_sampler(config.prompts, seed=config.run.seed)
        family = _model_family(config)
        # The LoRA targets the run uses (the family's unless the config names them) are
        # part of its config: recorded in config.yaml and checkpoints, compared on resume.
        config = dataclasses.replace(config, lora=config.lora.for_family(family))
        self.config = config
        self._restored, self._resume_changes = saved_run(
            self.run_dir, config.to_dict(), self.prompt_sampler, allow_config_change, self._warn
        )
        # A complete run whose export was cut short (a kill between the last checkpoint
        # and lora/) still loads the policy: run() finishes the export, nothing else.
        self._export_only = self._run_complete(config.train.epochs)
        model_path = self._model_path()
        if config.model.tf32:  # process-wide, as the release sets it (train.py:722-724)
            torch.set_float32_matmul_precision("high")
            torch.backends.cudnn.allow_tf32 = True
        torch.manual_seed(config.run.seed)  # same LoRA init everywhere, whatever ran before
        try:
            self.policy = Policy.load(
                model_path,
                config.lora,
                device=world.device,
                dtype=DTYPES[config.model.dtype],
                gradient_checkpointing=config.model.gradient_checkpointing,
                family=family.name,
                guidance=config.model.guidance,
            )
        except (LoraTargetError, UnsupportedGuidance) as error:
            raise ConfigError(str(error)) from None
        if config.model.shard == "fsdp2":
            self.policy.shard_frozen_weights()
        self._frozen_gib = self.policy.frozen_weight_bytes() / 2**30
        self.parameters = self.policy.trainable_parameters()
        self._synchronize_adapters()
        self.strategy: Strategy = build_strategy(
            config.strategy.name, config.strategy.settings, self.reward_names, seed=config.run.seed
        )
        self.harmonized = HarmonizedStep(
            self.parameters,
            self.strategy.weights,
            module=self.policy.transformer,
            engine=config.train.gradient_engine,
            compute_dtype=DTYPES[config.model.dtype],
            collective=world,
            warn=self._warn,
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
        self.state = TrainingState(
            self.policy,
            self.optimizer,
            self.ema,
            self.strategy,
            self.objective,
            self.prompt_sampler,
        )
        self.divergence_probe = DivergenceProbe(
            self.policy,
            prompt=self.prompt_sampler.sources[0].prompts[0],
            resolution=config.rollout.resolution,
            max_sequence_length=config.rollout.max_sequence_length,
        )

    # ----------------------------------------------------------------- run
    def run(self) -> Path:
        """Train from the latest checkpoint (if any) to the configured number of epochs,
        then export; for a complete run whose export is missing, only export. The rewards
        are closed when it returns or fails (``RewardSet.close``: a remote reward's
        connections and threads)."""
        try:
            return self._run()
        finally:
            self.rewards.close()

    def _run(self) -> Path:
        restored = self._restored
        if restored is not None:
            self._restore(restored)
            self._restored = None  # the state is loaded; free it
        if self._export_only and restored is not None:
            return self._finish_export(restored.path)
        changes = self._resume_changes
        if self.world.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            first_config = self.run_dir / "config.yaml"
            if changes is None:
                first_config.write_text(yaml.safe_dump(self.config.to_dict(), sort_keys=False))
            else:
                write_resume_record(self.run_dir, self.config.to_dict(), self.epoch, changes)
        log = None
        if self.world.is_main:
            log = RunLog(
                self.run_dir,
                resume_from_step=self.epoch,
                settings=self.config.run,
                config=self.config.to_dict(),
                resume_from_optimizer_step=self.optimizer_step,
            )
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
                first_step = self.optimizer_step
                record = self.train_epoch()
                if log is not None:
                    log.log(self.epoch, record, first_step, self._samples)
                bar.update(1)
                bar.set_postfix(progress_summary(record, self.reward_names))
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
        self._intermediate_images = 0  # SDPO's anchor states, scored beside the samples
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
        try:
            batch = self.objective.rollout(self.policy, request, self._score)
            if not all_finite([batch.images]):
                raise NonFiniteError(
                    f"epoch {self.epoch}: the policy sampled non-finite images (diverged "
                    "weights: is train.learning_rate or lora.alpha far too large?); the "
                    f"rewards were not asked to score them; {self._kept_checkpoint()}"
                )
            times[keys.ROLLOUT_TIME] = time.perf_counter() - started
            self._samples = sample_grid(batch.images, per_image) if self.world.is_main else None
            started = time.perf_counter()  # overlapped: only the wait after sampling counts
            if background is not None:
                rewards, reward_seconds = background.collect()
            else:
                rewards, reward_seconds = self.rewards(batch.images, prompts, metadata)
        finally:  # stopped early (Ctrl-C, an error): drop the chunks not yet scored
            if background is not None:
                background.close()
        times[keys.REWARD_TIME] = time.perf_counter() - started
        failed, intermediate = self._failed_samples()
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
        record = self._epoch_record(
            stats, step_records, times, reward_seconds, decay, failed, intermediate
        )
        for callback in self.callbacks:
            callback.on_epoch_end(self, record)
        return record

    def _score(
        self, images: torch.Tensor, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> torch.Tensor:
        """Every reward on some images: the scorer objectives get for intermediate states."""
        self._intermediate_images += len(prompts)
        return self.rewards(images, prompts, metadata)[0]

    def _failed_samples(self) -> tuple[dict[str, int], int]:
        """Per reward that degrades instead of raising (an optional remote one): the
        images it scored NaN this epoch because scoring failed, summed over the ranks; and
        the intermediate states (SDPO's) the rewards were asked to score beside the
        samples, summed too. A failure is counted where it happens, and with overlapped
        scoring the samples' and the states' scoring run at once, so the count holds both."""
        counts = {
            reward.name: count
            for reward in self.rewards.rewards
            if (count := reward.take_failed_samples()) is not None
        }
        if not counts:
            return {}, 0
        local = [*counts.values(), self._intermediate_images]
        local = torch.tensor([local], dtype=torch.float64)
        total = self.world.all_gather_rows(local.to(self.world.device)).sum(dim=0).cpu()
        *failed, intermediate = (int(value) for value in total.tolist())
        return dict(zip(counts, failed, strict=True)), intermediate

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
            to_objectives=lambda values: self.strategy.objective_rewards(values, epoch, all_groups),
            gather=lambda local: self.world.all_gather_rows(local.to(self.world.device)).cpu(),
            clip=self.strategy.micro_step is None,
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
        if self.strategy.micro_step is not None:
            weights, record = self._micro_step_marble(step, generator, metrics)
        elif self.strategy.needs_gradients():
            weights, record = self._solve_step(step, generator, metrics, replay)
        else:
            losses = self.objective.losses(self.policy, step, generator, metrics)
            measure = self.strategy.solve_when_stale
            report = self.harmonized.combine(losses, count, measure_outputs=measure)
            if measure:  # the cache went stale where its weights conflict in output space
                self.strategy.stale = report.diagnostics["output_cos_min"] < 0
            weights, record = report.weights, step_record(report)
        record.update(
            {keys.objective_metric(key): value for key, value in metrics.summary().items()}
        )
        started = time.perf_counter()
        record[keys.PROBE_TIME] = 0.0
        # A solve that saw less than the step (one micro-step as released, part of the
        # step, output space) is probed too: its own cosines are not the step's
        if probe is not None and (not record[keys.SOLVED] or not self.strategy.solve_sees_step):
            probe, _ = self._mask_silent_in_step(probe)
            record.update(self._conflict_probe(probe, self._replayer(probe, replay)))
            record[keys.PROBE_TIME] = time.perf_counter() - started
        record[keys.WEIGHTS] = [float(w) for w in weights]
        started = time.perf_counter()
        self._apply_step(record)
        record[keys.OPTIMIZER_TIME] = time.perf_counter() - started
        return record

    def _solve_step(
        self,
        step: list[TrainPiece],
        generator: torch.Generator,
        metrics: StepMetrics,
        replay: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """A fresh solve on as much of the step as the strategy's solve sees (its first
        micro-steps, in parameter or output space), its weights applied to all of it."""
        count = step[0].advantages.shape[-1]
        pieces = None
        if self.strategy.solve_fraction < 1:  # DiffusionNFT only (checked with the config)
            pieces = self.strategy.solve_pieces(len(step) * step[0].data.timesteps)
        losses = self.objective.losses(self.policy, step, generator, metrics)
        if self.strategy.solve_space == "outputs":
            report = self.harmonized.solve_outputs(losses, count, pieces=pieces)
        else:
            replayer = self._replayer(step, replay)
            report = self.harmonized.solve(losses, count, replayer, pieces=pieces)
        record = step_record(report)
        if pieces is not None:
            record[keys.SOLVE_PIECES] = pieces
        return report.weights, record

    def _replayer(self, step: list[TrainPiece], state: torch.Tensor) -> Callable[[], LossStream]:
        """A fresh copy of ``step``'s loss stream (same draws from generator ``state``),
        whose diagnostics go nowhere: for the probe and the engine check."""

        def replay() -> LossStream:
            generator = torch.Generator()
            generator.set_state(state)
            return self.objective.losses(self.policy, step, generator, StepMetrics())

        return replay

    def _micro_step_marble(
        self, step: list[TrainPiece], generator: torch.Generator, metrics: StepMetrics
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """MARBLE as released (``strategy.solve_scope: micro_step``, release_marble.py):
        solve micro-steps apply their fresh direction, the others one backward on the
        mixed advantage. A solve step's first micro-step is computed twice: its K
        gradients, then a no-grad forward as the mixed stream's skipped first piece (the
        stream's draws stay those of one pass)."""
        marble = self.strategy.micro_step
        plan = marble.plan(self.optimizer_step)
        state = generator.get_state()
        record: dict[str, Any] = {keys.SOLVED: 0, keys.FALLBACK: None, "solved_micro_steps": 0}
        started = time.perf_counter()
        if plan == "every":
            losses = iter(self.objective.losses(self.policy, step, generator, metrics))
            index = 0
            while self._solve_micro_step(losses, self._piece_replayer(step, state, index), record):
                index += 1
        else:
            if plan == "first":
                solving = torch.Generator()
                solving.set_state(state)
                losses = iter(self.objective.losses(self.policy, step, solving, StepMetrics()))
                self._solve_micro_step(losses, self._piece_replayer(step, state, 0), record)
            mixed = [dataclasses.replace(p, advantages=marble.mixed(p.advantages)) for p in step]
            losses = iter(self.objective.losses(self.policy, mixed, generator, metrics))
            if plan == "first":  # the solved micro-step: its draws, without a graph (which
                with torch.no_grad():  # the stream would hold through the next forward)
                    next(losses, None)
            accumulate_gradients(losses, self.parameters, torch.ones(1, dtype=torch.float64))
        record[keys.BACKWARD_TIME] = time.perf_counter() - started
        started = time.perf_counter()
        self.world.average_gradients(self.parameters)
        record[keys.HARMONIZE_TIME] = time.perf_counter() - started
        since = marble.steps_since_solve(self.optimizer_step)
        if since is not None:  # None: equal alpha, never solved
            record[keys.STEPS_SINCE_SOLVE] = float(since)
        record["release/alpha"] = marble.alpha.tolist()
        return marble.reward_coefficients(), record

    def _solve_micro_step(
        self, losses: LossStream, replay: Callable[[], LossStream], record: dict[str, Any]
    ) -> bool:
        """The next micro-step of ``losses``: its K gradients (its KL term to ``.grad``),
        the release's solve on them, the fresh direction added to ``.grad``. False when
        the stream had no piece left. The piece is drawn inside the gradient engine, which
        records its forward."""
        count = len(self.strategy.reward_names)
        drawn: list[bool] = []

        def next_piece() -> LossStream:
            for piece in itertools.islice(losses, 1):
                drawn.append(True)
                yield piece

        stack = self.harmonized.gradients(next_piece(), count, replay)
        if not drawn:
            return False
        stack = self.world.average(stack)
        weights, solved = self.strategy.micro_step.solve(stack, self.optimizer_step)
        self.harmonized.apply(stack, weights)
        record["solved_micro_steps"] += 1
        record.update(
            {
                keys.SOLVED: 1,
                keys.FALLBACK: solved["fallback"],
                keys.ENGINE: self.harmonized.engine.name,
                "release/fresh_alpha": solved["fresh_alpha"],
                "release/raw_norms": solved["raw_norms"],
                "release/rescale": solved["rescale"],
            }
        )
        return True

    def _piece_replayer(
        self, step: list[TrainPiece], state: torch.Tensor, index: int
    ) -> Callable[[], LossStream]:
        """Piece ``index`` of ``step``'s loss stream again (the pieces before it are
        computed to reach it: for the engine's one-time check and a refusal)."""
        replay = self._replayer(step, state)
        return lambda: itertools.islice(replay(), index, index + 1)

    def _apply_step(self, record: dict[str, Any]) -> None:
        """Clip, step (or skip a non-finite gradient), refuse non-finite weights."""
        record[keys.GRAD_NORM] = float(
            torch.nn.utils.clip_grad_norm_(self.parameters, self.config.train.grad_clip)
        )
        if math.isfinite(record[keys.GRAD_NORM]):
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
        stack = self.harmonized.engine.stack(replay(), count, apply_extra=False)
        stack = self.world.average(stack)
        direction = flat_gradient(self.parameters).float()
        return probe_record(stack, direction, self.strategy)

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

    def _epoch_record(
        self,
        stats: dict[str, Any],
        step_records: list[dict[str, Any]],
        times: dict[str, float],
        reward_seconds: dict[str, float],
        decay: float,
        failed: dict[str, int],
        intermediate: int = 0,
    ) -> dict[str, Any]:
        all_rewards = stats.pop("all_rewards")
        silent = stats.pop("silent")
        record = epoch_record(
            self.reward_names,
            self.strategy.objective_names(self.epoch),
            all_rewards,
            reward_seconds,
            stats,
            silent,
            step_records,
            times,
            decay,
            failed,
        )
        if self.world.size > 1:
            record[keys.PARAMETER_DIVERGENCE] = self.world.divergence(self.parameters)
        asked = f"{len(all_rewards)} samples"
        if intermediate:  # the denominator holds what the count may hold
            asked = f"{len(all_rewards) + intermediate} images ({asked}, {intermediate} "
            asked += "intermediate states)"
        for name, count in failed.items():
            if count:
                self._warn(
                    f"epoch {self.epoch}: reward {name!r} could not score {count} of {asked} "
                    "(required: false): they count as not applicable (NaN), so the other "
                    "rewards alone decided their advantages"
                )
        for name in record[keys.REWARDS_WITHOUT_SIGNAL]:
            self._warn(
                f"epoch {self.epoch}: reward {name!r} was NaN (not applicable) for every "
                "image: it gave no training signal"
            )
        record[keys.FROZEN_WEIGHTS] = self._frozen_gib
        if torch.cuda.is_available():
            record[keys.PEAK_MEMORY] = torch.cuda.max_memory_allocated() / 2**30
        return record

    def _check_outputs_finite(self) -> None:
        """Diverged but finite weights stop the run before they are checkpointed."""
        if not self.divergence_probe.outputs_finite(self.world.device):
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
        state = self.state.to_checkpoint(self.epoch, self.optimizer_step, self.config.to_dict())
        save_checkpoint(self.run_dir, self.epoch, state)
        keep_last(self.run_dir, self.config.run.keep_checkpoints)
        self.world.barrier()

    def _restore(self, restored: Restored) -> None:
        """Continue from a checkpoint; the optimizer and EMA take the config's settings."""
        for reason in restored.passed_over:
            self._warn(f"checkpoint passed over: {reason}")
        if restored.passed_over:
            self._warn(f"resuming from {restored.path}")
        try:
            self.epoch, self.optimizer_step = self.state.restore(restored.state, self.config.train)
        except (KeyError, ValueError) as error:  # one line naming the part, no traceback
            reason = f"it has no {error.args[0]!r} entry" if isinstance(error, KeyError) else error
            raise CorruptCheckpointError(
                f"{restored.path / STATE_FILE} cannot be restored: {reason}; nothing was "
                "overwritten: remove that checkpoint to resume from an older one, or use a "
                "new run.directory"
            ) from None
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
        """``lora/`` and ``lora_ema/`` of epoch ``self.epoch``, each written atomically
        and recorded with that epoch, so an interrupted export is redone, never kept."""
        for name, weights in EXPORTS.items():
            with self.ema.swap_in() if weights == "ema" else contextlib.nullcontext():
                write_export(
                    self.run_dir / name,
                    self.epoch,
                    lambda folder: self.policy.save_lora(folder, adapter="default"),
                )

    def _run_complete(self, epochs: int) -> bool:
        """Raise RunComplete when the saved run has ``epochs`` epochs and its exports are
        those of its last checkpoint; True when it has them but an export is missing."""
        if self._restored is None or self._restored.state["epoch"] < epochs:
            return False
        epoch = self._restored.state["epoch"]
        if not missing_exports(self.run_dir, epoch):
            raise RunComplete(
                f"{self.run_dir} is already at epoch {epoch} (train.epochs={epochs}): "
                "nothing to train, nothing written; raise train.epochs to continue"
            )
        return True

    def _finish_export(self, checkpoint: Path) -> Path:
        """Export a complete run from ``checkpoint`` (already restored), saying so."""
        if self.world.is_main:
            missing = [f"{name}/" for name in missing_exports(self.run_dir, self.epoch)]
            self._export_lora()
            tqdm.write(
                f"mogradient-diffusion: {self.run_dir} was complete at epoch {self.epoch} "
                f"but {' and '.join(missing)} {'was' if len(missing) == 1 else 'were'} "
                f"missing or unfinished (stopped while exporting?): exported again from "
                f"checkpoint {checkpoint.name}; nothing trained",
                file=sys.stderr,
            )
        self.world.barrier()
        return self.run_dir


def missing_exports(run_dir: Path, epoch: int) -> list[str]:
    """The exports of ``run_dir`` that are not whole exports of checkpoint ``epoch``."""
    return [name for name in EXPORTS if not export_is_current(run_dir / name, epoch)]


def build_rewards(config: TrainingConfig) -> RewardSet:
    """The configured rewards; a constructor that fails (missing weights, bad option values,
    a user reward's own check) is a configuration error naming the reward."""
    timeout = config.rollout.reward_timeout
    if timeout is not None and not timeout > 0:
        raise ConfigError(
            f"rollout.reward_timeout must be > 0 seconds (or null: no limit), got {timeout}"
        )
    rewards = []
    for entry in config.rewards:
        try:
            reward = make_reward(entry.name, **entry.options)
        except Exception as error:
            raise ConfigError(f"reward {entry.run_name!r} could not be built: {error}") from error
        reward.name = entry.run_name
        rewards.append(reward)
    return RewardSet(rewards, timeout=timeout)


def _model_family(config: TrainingConfig) -> Family:
    """The family of the configured model, before it loads; without ``model.path`` it is
    the tiny pipeline's, SD3. A pipeline class no family trains is a config error."""
    model = config.model
    if model.path is None:
        if model.family not in (AUTO, "sd3"):
            raise ConfigError(
                f"model.family={model.family} needs model.path: without it the run builds "
                "the tiny SD3 pipeline (the tiny FLUX.1 and Qwen-Image builders are in "
                "mogradient_diffusion.model.tiny_flux and tiny_qwen_image)"
            )
        return family_named("sd3")
    try:
        return pipeline_family(model.path, model.family)
    except ValueError as error:  # an unsupported pipeline class, an unreadable index
        raise ConfigError(f"model.path {model.path}: {error}") from None


def has_signal(advantages: torch.Tensor) -> torch.Tensor:
    """Per objective (last dimension): whether any advantage is nonzero (NaN counts as 0)."""
    return (advantages.nan_to_num(0.0) != 0).flatten(0, -2).any(dim=0)


def mask_objectives(advantages: torch.Tensor, silent: torch.Tensor) -> torch.Tensor:
    """The advantages with every objective marked in ``silent`` set to NaN (not applicable)."""
    masked = advantages.clone()
    masked[..., silent] = float("nan")
    return masked


def step_record(report: StepReport) -> dict[str, Any]:
    """A harmonized step's report under the names metrics.jsonl uses."""
    record: dict[str, Any] = {
        keys.BACKWARD_TIME: report.backward_seconds,
        keys.HARMONIZE_TIME: report.harmonize_seconds,
        keys.SOLVED: int(report.solved),
        keys.FALLBACK: report.fallback,
    }
    if report.engine is not None:
        record[keys.ENGINE] = report.engine
    record.update({keys.harmonize(name): value for name, value in report.diagnostics.items()})
    return record
