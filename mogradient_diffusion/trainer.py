"""The training loop, one arrow per function:

rollout -> rewards -> advantages -> per-objective gradients or cached weights -> step
-> old-adapter update -> log / checkpoint.

Randomness is drawn from generators seeded by (seed, rank, epoch, purpose), so a run
resumed from a checkpoint replays the remaining epochs exactly. Under ``torchrun`` the
gradients are averaged with explicit collectives (peft's adapter switching flips
``requires_grad``, which DistributedDataParallel does not allow): the K x D stack on
full-solve steps, ``.grad`` otherwise; weights are solved in float64 on identical data
and broadcast from rank 0.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from mogradient import MGDA, combinable_gradients, conflict_diagnostics, flat_gradient
from mogradient.harmonizers.base import combine
from mogradient.objectives import CombinableLoss
from mogradient_diffusion.advantages import group_advantages
from mogradient_diffusion.checkpoint import (
    Restored,
    keep_last,
    load_newest_intact,
    save_checkpoint,
)
from mogradient_diffusion.config import ConfigError, TrainingConfig
from mogradient_diffusion.distributed import World
from mogradient_diffusion.nft import NFTConfig, nft_loss
from mogradient_diffusion.policy import LoraSpec, ParameterEMA, Policy, old_decay
from mogradient_diffusion.prompt_setup import build_prompt_sampler
from mogradient_diffusion.prompts import SampledPrompt
from mogradient_diffusion.resume import check_resume, write_resume_record
from mogradient_diffusion.rewards import RewardSet, make_reward
from mogradient_diffusion.rewards.background import BackgroundScoring
from mogradient_diffusion.rollout import RolloutBatch, rollout
from mogradient_diffusion.runlog import RunLog
from mogradient_diffusion.strategies import Strategy, build_strategy

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class MicroBatch:
    """What one forward pass of the NFT loss needs, cut from the rollout batch."""

    latents: torch.Tensor
    embeds: Any
    advantages: torch.Tensor
    sigma_order: torch.Tensor  # [rows, timesteps]: indices into the sampler's sigmas
    reward_advantages: torch.Tensor | None = None  # per-reward, for the conflict probe


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot skip; nothing of them was saved."""


class Trainer:
    """Owns the policy, rewards, strategy and optimizer of one run.

    Rewards and prompts are built before the pipeline loads, so a wrong reward path or
    an unreadable prompt file fails in seconds, as a ConfigError.
    """

    def __init__(
        self, config: TrainingConfig, world: World, allow_config_change: bool = False
    ) -> None:
        self.config = config
        self.world = world
        self.allow_config_change = allow_config_change
        self.run_dir = Path(config.run.directory)
        self.rewards = build_rewards(config)
        self.reward_names = [r.name for r in config.rewards]
        self.sampler = build_prompt_sampler(config.prompts, seed=config.run.seed)
        self._restored, self._resume_changes = self._saved_run()
        model_path = self._model_path()
        torch.manual_seed(config.run.seed)  # same LoRA init everywhere, whatever ran before
        self.policy = Policy.load(
            model_path,
            LoraSpec(rank=config.lora.rank, alpha=config.lora.alpha, dropout=config.lora.dropout),
            device=world.device,
            dtype=DTYPES[config.model.dtype],
            gradient_checkpointing=config.model.gradient_checkpointing,
        )
        self.parameters = self.policy.trainable_parameters()
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
        self.nft = NFTConfig(
            beta=config.nft.beta,
            a_max=config.nft.a_max,
            form=config.nft.form,
            kl_coefficient=config.nft.kl_coefficient,
        )
        self.epoch = 0
        self.optimizer_step = 0
        self._nonfinite_streak = 0  # consecutive skipped optimizer steps
        self._reward_advantages: torch.Tensor | None = None

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
        times: dict[str, float] = {}
        started = time.perf_counter()
        drawn = self._epoch_prompts()
        per_image = self.config.rollout.images_per_prompt
        prompts = [item.prompt for item in drawn for _ in range(per_image)]
        metadata = [item.metadata for item in drawn for _ in range(per_image)]
        background = None
        if self.config.rollout.overlap_rewards:
            background = BackgroundScoring(self.rewards, prompts, metadata)
        batch = rollout(
            self.policy,
            [item.prompt for item in drawn],
            images_per_prompt=self.config.rollout.images_per_prompt,
            steps=self.config.rollout.steps,
            guidance_scale=self.config.rollout.guidance_scale,
            sampler=self.config.rollout.sampler,
            resolution=self.config.rollout.resolution,
            generator=self._generator("rollout"),
            adapter="old",
            batch_size=self.config.rollout.batch_size,
            max_sequence_length=self.config.rollout.max_sequence_length,
            progress=self.world.is_main and not self.config.run.quiet,
            on_images=None if background is None else background.submit,
        )
        times["time/rollout"] = time.perf_counter() - started
        started = time.perf_counter()  # overlapped: only the wait after sampling is counted
        if background is not None:
            rewards, reward_seconds = background.collect()
        else:
            rewards, reward_seconds = self.rewards(batch.images, prompts, metadata)
        times["time/reward"] = time.perf_counter() - started
        advantages, stats = self._advantages(rewards, batch)
        started = time.perf_counter()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        self._rollout_sigmas = batch.sigmas
        step_records = self._train_on(batch, advantages)
        for key in ("time/backward", "time/harmonize", "time/optimizer"):
            times[key] = sum(record[key] for record in step_records)
        times["time/train"] = time.perf_counter() - started
        # The reference schedules count optimizer steps, not epochs.
        decay = old_decay(
            self.config.train.old_schedule, self.optimizer_step, self.config.train.old_cap
        )
        self.policy.update_old(decay)
        return self._epoch_record(rewards, stats, step_records, times, reward_seconds, decay)

    # ---------------------------------------------------------- advantages
    def _advantages(
        self, rewards: torch.Tensor, batch: RolloutBatch
    ) -> tuple[torch.Tensor, dict[str, Any]]:
        """Advantages from the whole (all-rank) batch, returned for this rank's rows."""
        all_rewards = self.world.all_gather_rows(rewards.to(self.world.device)).cpu()
        groups_per_rank = self.config.rollout.prompts_per_epoch // self.world.size
        all_groups = self.world.all_gather_rows(
            (batch.group_ids + self.world.rank * groups_per_rank).to(self.world.device)
        ).cpu()
        objective_rewards = self.strategy.objective_rewards(all_rewards, self.epoch)
        advantages, stats = group_advantages(
            objective_rewards,
            all_groups,
            std=self.config.nft.advantage_std,
            clip=self.config.nft.a_max,
        )
        advantages, silent = mask_silent_objectives(advantages)
        rows = slice(self.world.rank * len(rewards), (self.world.rank + 1) * len(rewards))
        self._reward_advantages = None
        if self.config.run.conflict_probe:
            per_reward, _ = group_advantages(
                all_rewards,
                all_groups,
                std=self.config.nft.advantage_std,
                clip=self.config.nft.a_max,
            )
            self._reward_advantages = mask_silent_objectives(per_reward)[0][rows]
        return advantages[rows], {"all_rewards": all_rewards, "silent": silent, **stats}

    # ------------------------------------------------------------ training
    def _train_on(self, batch: RolloutBatch, advantages: torch.Tensor) -> list[dict[str, Any]]:
        """All optimizer steps of one epoch."""
        train = self.config.train
        generator = self._generator("train")
        order = torch.randperm(len(batch.latents), generator=generator)
        micro = [order[i : i + train.batch_size] for i in range(0, len(order), train.batch_size)]
        records = []
        for first in range(0, len(micro), train.gradient_accumulation):
            group = [
                self._micro_batch(batch, advantages, rows, generator)
                for rows in micro[first : first + train.gradient_accumulation]
            ]
            records.append(self.optimizer_step_on(group, generator))
        return records

    def optimizer_step_on(
        self, group: list[MicroBatch], generator: torch.Generator
    ) -> dict[str, Any]:
        """Accumulate one optimizer step's gradients, harmonize, clip and step."""
        count = group[0].advantages.shape[1]
        group, signal = self._mask_silent_in_step(group)
        if not signal.any():
            # No objective has an applicable sample with signal: stepping would only let
            # Adam's momentum replay earlier gradients (and the KL pull alone).
            self.optimizer_step += 1
            idle = dict.fromkeys(("time/backward", "time/harmonize", "time/optimizer"), 0.0)
            return idle | {"skipped": "no reward signal", "solved": 0, "weights": [0.0] * count}
        full = self.strategy.needs_gradients()
        cached = None
        if not full:  # weight-only or cached: every rank applies rank 0's weights
            cached = self.strategy.weights(None, count)
            cached = dataclasses.replace(cached, weights=self.world.broadcast(cached.weights))
        probe_noise = generator.get_state() if self.config.run.conflict_probe else None
        started = time.perf_counter()
        jacobian = accumulate_gradients(
            self._loss_stream(group, generator),
            self.parameters,
            None if full else cached.weights,
            count,
        )
        record: dict[str, Any] = {"time/backward": time.perf_counter() - started}
        harmonize_started = time.perf_counter()
        self.world.average_gradients(self.parameters)
        if full:
            jacobian = self.world.average(jacobian)
            step = self.strategy.weights(jacobian, count)
            weights = self.world.broadcast(step.weights)
            direction = combine(jacobian, weights)
            add_to_gradients(self.parameters, direction)
            diagnostics = conflict_diagnostics(
                weights,
                jacobian=jacobian,
                direction=direction,
                dropped=step.harmonization.dropped if step.harmonization else (),
                fallback=step.fallback,
            )
            record.update(
                {f"harmonize/{k}": v for k, v in diagnostics.items() if not isinstance(v, list)}
            )
        else:
            step = cached
            weights = step.weights
        if probe_noise is not None and "harmonize/cos_min" not in record:
            record.update(self._conflict_probe(group, probe_noise))
        record["time/harmonize"] = time.perf_counter() - harmonize_started
        optimizer_started = time.perf_counter()
        record["solved"] = int(full)
        record["fallback"] = step.fallback
        record["weights"] = [float(w) for w in weights]
        record["grad_norm"] = float(
            torch.nn.utils.clip_grad_norm_(self.parameters, self.config.train.grad_clip)
        )
        if math.isfinite(record["grad_norm"]):
            self.optimizer.step()
            self.ema.update()
            self._nonfinite_streak = 0
        else:
            record["skipped"] = "non-finite gradients"
            self._skip_nonfinite_step()
        self.optimizer.zero_grad(set_to_none=True)
        if not all_finite(self.parameters):
            raise NonFiniteError(
                f"the LoRA weights became non-finite at optimizer step {self.optimizer_step} "
                "although the gradients were finite (is train.learning_rate far too large?); "
                "stopped before checkpointing them"
            )
        self.optimizer_step += 1
        record["time/optimizer"] = time.perf_counter() - optimizer_started
        return record

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

    def _conflict_probe(self, group: list[MicroBatch], noise_state: torch.Tensor) -> dict:
        """cos(applied update, g_k) for every reward, on the step's own samples and noise.

        For steps that did not compute per-reward gradients (scalar baselines, cached
        MARBLE steps): K more gradients from per-reward advantages, replaying the noise the
        step drew, against the gradient about to be applied (``.grad``, KL term included).
        """
        generator = torch.Generator()
        generator.set_state(noise_state)
        probe = [dataclasses.replace(m, advantages=m.reward_advantages) for m in group]
        probe, _ = self._mask_silent_in_step(probe)
        count = probe[0].advantages.shape[1]
        stack = accumulate_gradients(
            self._loss_stream(probe, generator), self.parameters, None, count, apply_extra=False
        )
        stack = self.world.average(stack)
        direction = flat_gradient(self.parameters).float()
        diagnostics = conflict_diagnostics(torch.ones(count), jacobian=stack, direction=direction)
        record = {  # no weight/k: the probe's unit weights only set the round-off tolerance
            f"harmonize/{k}": v
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
            "stale/steps_since_solve": float(amortizer.steps_since_solve or 0),
            "stale/cos_to_fresh": float(cosine),
            "stale/fresh_cos_min": float(fresh_diagnostics["cos_min"]),
        }

    def _mask_silent_in_step(
        self, group: list[MicroBatch]
    ) -> tuple[list[MicroBatch], torch.Tensor]:
        """Per step, as per epoch: objectives with no nonzero advantage on any rank sit out.

        Returns the masked group and which objectives have signal (the same on every rank).
        """
        rows = torch.cat([micro.advantages for micro in group])
        signal = (rows.nan_to_num(0.0) != 0).any(dim=0).to(torch.float32).to(self.world.device)
        signal = self.world.average(signal).cpu() > 0
        if signal.all():
            return group, signal
        masked = []
        for micro in group:
            advantages = micro.advantages.clone()
            advantages[:, ~signal] = float("nan")
            masked.append(dataclasses.replace(micro, advantages=advantages))
        return masked, signal

    def _loss_stream(self, group: list[MicroBatch], generator: torch.Generator):
        """Yield (scale, CombinableLoss) for every micro-batch x training timestep.

        Each reward's loss is its mean over the step's applicable samples (not a mean of
        micro-batch means) and the KL term the step's mean, so the step's gradient does
        not depend on how it is cut into micro-batches; timesteps are averaged.
        """
        sigmas = self._sigmas
        valid_counts = sum((~torch.isnan(micro.advantages)).sum(dim=0) for micro in group)
        total_rows = sum(len(micro.latents) for micro in group)
        for micro in group:
            columns = micro.sigma_order.shape[1]
            share = len(micro.latents) / total_rows
            for column in range(columns):
                sigma = sigmas[micro.sigma_order[:, column]].to(micro.latents)
                noise = torch.randn(micro.latents.shape, generator=generator).to(micro.latents)
                shaped = sigma.view(-1, *([1] * (micro.latents.ndim - 1)))
                noisy = (1 - shaped) * micro.latents + shaped * noise
                loss = self._nft_loss(micro, noisy, sigma, valid_counts)
                if loss.extra is not None:
                    loss = dataclasses.replace(loss, extra=loss.extra * share)
                yield 1.0 / columns, loss

    def _nft_loss(
        self,
        micro: MicroBatch,
        noisy: torch.Tensor,
        sigma: torch.Tensor,
        valid_counts: torch.Tensor,
    ) -> CombinableLoss:
        v_old = self.policy.velocity(noisy, sigma, micro.embeds, adapter="old")
        v_reference = None
        if self.nft.kl_coefficient > 0:
            v_reference = self.policy.velocity(noisy, sigma, micro.embeds, adapter="reference")
        v_theta = self.policy.velocity(noisy, sigma, micro.embeds, adapter="default")
        return nft_loss(
            v_theta,
            v_old,
            noisy,
            micro.latents,
            sigma,
            micro.advantages,
            self.nft,
            v_reference=v_reference,
            valid_counts=valid_counts,
        )

    def _micro_batch(
        self,
        batch: RolloutBatch,
        advantages: torch.Tensor,
        rows: torch.Tensor,
        generator: torch.Generator,
    ) -> MicroBatch:
        steps = self.config.rollout.steps
        # int(), as the reference trainers: 0.99 x 10 steps trains 9 timesteps.
        count = max(1, int(self.config.train.timestep_fraction * steps))
        order = torch.stack([torch.randperm(steps, generator=generator)[:count] for _ in rows])
        return MicroBatch(
            latents=batch.latents[rows].to(self.world.device),
            embeds=batch.embeds.index(rows),
            advantages=advantages[rows],
            sigma_order=order,
            reward_advantages=(
                None if self._reward_advantages is None else self._reward_advantages[rows]
            ),
        )

    @property
    def _sigmas(self) -> torch.Tensor:
        """The noise levels the rollout sampled at (the final 0 excluded): the training grid."""
        return self._rollout_sigmas[:-1]

    # ------------------------------------------------------------- helpers
    def _epoch_prompts(self) -> list[SampledPrompt]:
        """This rank's share of the epoch's prompts (every rank draws the same list)."""
        drawn = self.sampler.sample(self.config.rollout.prompts_per_epoch)
        per_rank = len(drawn) // self.world.size
        return drawn[self.world.rank * per_rank : (self.world.rank + 1) * per_rank]

    def _generator(self, purpose: str) -> torch.Generator:
        code = {"rollout": 1, "train": 2}[purpose]
        seed = (
            (self.config.run.seed * 1_000_003 + self.world.rank) * 10_007 + self.epoch
        ) * 7 + code
        return torch.Generator().manual_seed(seed)

    def _model_path(self) -> Path:
        if self.config.model.path is not None:
            return Path(self.config.model.path)
        from mogradient_diffusion.tiny import save_tiny_pipeline

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
            record[f"reward/{name}/mean"] = float(valid.mean()) if len(valid) else float("nan")
            population_std = float(valid.std(unbiased=False)) if len(valid) else float("nan")
            record[f"reward/{name}/std"] = population_std
            record[f"time/reward/{name}"] = float(reward_seconds.get(name, float("nan")))
        objectives = self.strategy.objective_names(self.epoch)
        for key, values in stats.items():
            for name, value in zip(objectives, values.tolist(), strict=True):
                record[f"advantage/{name}/{key}"] = value
        record["old_decay"] = decay
        record["optimizer_steps"] = step_records
        record["objectives"] = objectives
        if self.world.size > 1:
            record["ddp/parameter_divergence"] = self.world.divergence(self.parameters)
        record["objectives_without_signal"] = [
            n for n, s in zip(objectives, silent, strict=True) if s
        ]
        record["rewards_without_signal"] = [
            name
            for index, name in enumerate(self.reward_names)
            if torch.isnan(all_rewards[:, index]).all()
        ]
        for name in record["rewards_without_signal"]:
            self._warn(
                f"epoch {self.epoch}: reward {name!r} was NaN (not applicable) for every "
                "image: it gave no training signal"
            )
        if torch.cuda.is_available():
            record["memory/peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return record

    def _checkpoint(self) -> None:
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
            "sampler": self.sampler.state_dict(),
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
            saved = yaml.safe_load((self.run_dir / "config.yaml").read_text())
        else:
            return None, None
        return restored, check_resume(saved, current, self.run_dir, self.allow_config_change)

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
        self.sampler.load_state_dict(state["sampler"])
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


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one device sync)."""
    return bool(torch.stack([t.detach().isfinite().all() for t in tensors]).all())


def _check_finite_state(state: dict[str, Any]) -> None:
    """Reject a checkpoint holding non-finite LoRA or EMA weights (a poisoned run)."""
    tensors = [*state["default"].values(), *state["old"].values(), *state["ema"]["shadow"]]
    if not all_finite(tensors):
        raise ValueError("it holds non-finite LoRA or EMA weights")


def _summary(record: dict[str, Any], reward_names: list[str]) -> dict[str, str]:
    """A few numbers for the progress bar: mean rewards and the latest weights."""
    summary = {name: f"{_number(record.get(f'reward/{name}/mean')):.3g}" for name in reward_names}
    steps = record.get("optimizer_steps") or [{}]
    weights = steps[-1].get("weights")
    if weights:
        summary["w"] = "/".join(f"{w:.2g}" for w in weights)
    return summary


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else float("nan")


def mask_silent_objectives(advantages: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """Mark objectives whose advantages are all zero (or NaN) as not applicable this epoch.

    With every advantage zero (e.g. every group got identical rewards) an objective's NFT
    gradient is only the symmetric pull towards the old policy, which is round-off while
    default == old; normalize-and-rescale would blow that up to unit size (seen: a raw
    weight of 1.7e6). As NaN it gets exactly zero coefficients and the harmonizer drops it.
    """
    signal = (advantages.nan_to_num(0.0) != 0).any(dim=0)
    masked = advantages.clone()
    masked[:, ~signal] = float("nan")
    return masked, (~signal).tolist()


def accumulate_gradients(
    losses: Any,
    parameters: list[torch.Tensor],
    weights: torch.Tensor | None,
    count: int,
    apply_extra: bool = True,
) -> torch.Tensor | None:
    """Sum ``scale * grad`` over a stream of (scale, CombinableLoss).

    With ``weights`` (a cached or weight-only step) every loss is combined first and one
    backward accumulates ``sum_k w_k g_k`` into ``.grad``. Without, the K per-objective
    gradients are accumulated into a K x D stack (returned) and only the non-harmonized
    ``extra`` term (KL) goes to ``.grad`` (left out with ``apply_extra=False``, for
    measurements that must not touch ``.grad``). Both paths are exact for the same weights.
    """
    stack = None
    for scale, loss in losses:
        if weights is not None:
            (loss.combined(weights) * scale).backward()
            continue
        extra = loss.extra if apply_extra else None
        part = combinable_gradients(loss, parameters, retain_graph=extra is not None)
        stack = part * scale if stack is None else stack.add_(part, alpha=scale)
        if extra is not None:
            (extra * scale).backward()
    if weights is None and stack is None:
        total = sum(parameter.numel() for parameter in parameters)
        stack = torch.zeros(count, total, device=parameters[0].device)
    return stack


def add_to_gradients(parameters: list[torch.Tensor], direction: torch.Tensor) -> None:
    """``.grad += direction`` (flat), creating gradients where none exist yet."""
    offset = 0
    for parameter in parameters:
        size = parameter.numel()
        piece = direction[offset : offset + size].view_as(parameter).to(parameter.dtype)
        parameter.grad = piece.clone() if parameter.grad is None else parameter.grad + piece
        offset += size
