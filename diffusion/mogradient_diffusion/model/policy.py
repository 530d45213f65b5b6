"""A diffusion transformer with two LoRA adapters: the trained policy and the rollout policy.

DiffusionNFT keeps three velocity fields on one frozen transformer: ``default`` (the
LoRA being trained), ``old`` (the rollout policy, a lagged copy of ``default``) and the
reference (the base model, adapters disabled). peft's ``set_adapter`` flips
``requires_grad`` on the adapters it switches, so every switch goes through
[`Policy.use_adapter`][mogradient_diffusion.model.policy.Policy.use_adapter], which puts ``default``
back, trainable, on the way out.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from mogradient.engines import is_shard, shard_frozen
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families import Family
from mogradient_diffusion.model.pipeline_files import AUTO, load_pipeline

ADAPTERS = ("default", "old", "reference")
LORA_INITS = {"gaussian": "gaussian", "kaiming": True}
# Config names of the transformer dtypes (model.dtype, eval --dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Config names of how the frozen transformer weights are spread over processes (model.shard).
SHARDING = ("none", "fsdp2")


@dataclass(frozen=True)
class LoraSpec:
    """LoRA hyper-parameters; defaults are DiffusionNFT's (r=32, alpha=64, gaussian init).

    ``target_modules`` None stands for the model family's own list
    ([`Family.lora_targets`][mogradient_diffusion.model.families.base.Family], what
    the reference trainers adapt on that model): one default could not fit every family,
    since FLUX and Qwen-Image train their MLPs too.
    [`for_family`][mogradient_diffusion.model.policy.LoraSpec.for_family] fills it in, and
    [`Policy.load`][mogradient_diffusion.model.policy.Policy.load] does so with the family it loads.
    Names match as peft matches them: a module's full name or its tail.
    """

    rank: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    init: str = "gaussian"
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"rank must be a positive integer, got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.init not in LORA_INITS:
            raise ValueError(f"init must be one of {sorted(LORA_INITS)}, got {self.init!r}")
        if self.target_modules is None:
            return
        if not self.target_modules or not all(isinstance(t, str) for t in self.target_modules):
            raise ValueError(
                "target_modules must be non-empty strings (or null for the model family's), "
                f"got {self.target_modules!r}"
            )
        object.__setattr__(self, "target_modules", tuple(self.target_modules))

    def for_family(self, family: Family) -> LoraSpec:
        """This spec with ``family``'s targets in place of None; given targets are kept."""
        if self.target_modules is not None:
            return self
        return dataclasses.replace(self, target_modules=family.lora_targets)

    def peft_config(self, exclude_modules: Sequence[str] = ()):
        """The equivalent ``peft.LoraConfig``, skipping the ``exclude_modules`` (full names).

        The targets must be resolved
        ([`for_family`][mogradient_diffusion.model.policy.LoraSpec.for_family]): None would make
        peft guess.
        """
        from peft import LoraConfig

        if self.target_modules is None:
            raise ValueError("target_modules is None: resolve it with for_family(family) first")
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            init_lora_weights=LORA_INITS[self.init],
            target_modules=list(self.target_modules),
            exclude_modules=list(exclude_modules) or None,
        )


class LoraTargetError(ValueError):
    """A LoRA target names no module of the model (peft would skip it, or fail late)."""


def _check_targets(model: nn.Module, targets: Sequence[str]) -> None:
    """Every target must match a module as peft matches them: the name or its tail."""
    names = [name for name, _ in model.named_modules()]
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        linear = sorted(
            {_short_name(n) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise LoraTargetError(
            f"lora.target_modules {unmatched} match no module of the transformer; its "
            f"linear layers are named {', '.join(linear[:16])}{', ...' if len(linear) > 16 else ''}"
        )


def _short_name(name: str) -> str:
    """``transformer_blocks.3.attn.to_out.0`` -> ``to_out.0``: what a target would say."""
    parts = name.split(".")
    return ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]


class Policy:
    """A pipeline of one [`family`][mogradient_diffusion.model.families] whose transformer
    has LoRA adapters ``default`` and ``old``.

    Build with [`load`][mogradient_diffusion.model.policy.Policy.load]. ``denoiser`` is the module
    called for velocity forwards; it is ``transformer`` itself, and may be replaced by a DDP wrapper
    of it (built while ``default`` is active) so that backward passes synchronise gradients.
    """

    def __init__(
        self, pipeline, lora: LoraSpec, family: Family, guidance: float | None = None
    ) -> None:
        family.check_guidance(pipeline, guidance)
        self.pipeline = pipeline
        self.family = family
        self.guidance = guidance
        self.transformer = pipeline.transformer
        self.denoiser: nn.Module = self.transformer
        self.lora = lora
        self._active = "default"
        self._params = {name: self._collect_adapter_parameters(name) for name in ADAPTERS[:2]}

    # ----------------------------------------------------------------- construction
    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        lora: LoraSpec = LoraSpec(),
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        gradient_checkpointing: bool = False,
        family: str = AUTO,
        guidance: float | None = None,
    ) -> Policy:
        """Load a pipeline (local directory, or hub id unless ``HF_HUB_OFFLINE``), add adapters.

        ``family`` names the model family, or ``"auto"`` reads it from the pipeline.
        ``guidance`` is the embedded guidance of models that have one (FLUX.1-dev).
        ``lora`` without targets takes the loaded family's; ``policy.lora`` holds them.
        """
        pipeline, found = load_pipeline(path, dtype, family)
        lora = lora.for_family(found)
        found.check_guidance(pipeline, guidance)
        pipeline = pipeline.to(device)
        pipeline.set_progress_bar_config(disable=True)
        for component in pipeline.components.values():
            if isinstance(component, nn.Module):
                component.requires_grad_(False)
                component.eval()
        transformer = pipeline.transformer
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        _check_targets(transformer, lora.target_modules)
        excluded = found.lora_excluded(transformer)
        with warnings.catch_warnings():  # peft warns that a second adapter is a second adapter
            warnings.filterwarnings("ignore", message="Already found a `peft_config`")
            transformer.add_adapter(lora.peft_config(excluded), adapter_name="default")
            transformer.add_adapter(lora.peft_config(excluded), adapter_name="old")
        transformer.set_adapter("default")
        policy = cls(pipeline, lora, found, guidance)
        policy._upcast_lora()
        policy.load_lora_state("old", policy.lora_state("default"))
        return policy

    def shard_frozen_weights(self) -> None:
        """Shard the frozen transformer over the process group (FSDP2), block by block.

        Both adapters stay whole on every process: ``default`` so that autograd reaches it
        and per-reward gradients stay exact (`mogradient.engines._sharding`), ``old`` so that
        [`update_old`][mogradient_diffusion.model.policy.Policy.update_old] stays a plain in-place
        update. Gradients are then averaged over processes by the caller, as without sharding.
        """
        shard_frozen(self.transformer, keep=self._adapter_parameters())

    def frozen_weight_bytes(self) -> int:
        """Bytes of frozen transformer weights held by this process (its shards if sharded)."""
        adapters = {id(p) for p in self._adapter_parameters()}
        return sum(
            (p.to_local() if is_shard(p) else p).nbytes
            for p in self.transformer.parameters()
            if id(p) not in adapters
        )

    def _adapter_parameters(self) -> list[nn.Parameter]:
        return [p for params in self._params.values() for p in params.values()]

    def _upcast_lora(self) -> None:
        """Keep LoRA weights in float32 under a half-precision base, so optimizer steps survive.

        peft computes the LoRA branch in the weights' dtype and casts the sum back.
        """
        for params in self._params.values():
            for parameter in params.values():
                parameter.data = parameter.data.float()

    @property
    def device(self) -> torch.device:
        return self.transformer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    # ----------------------------------------------------------------- adapters
    @contextmanager
    def use_adapter(self, adapter: str) -> Iterator[None]:
        """Activate ``adapter`` for the block, then restore the previous one (normally ``default``).

        Switching once around a whole rollout avoids a module walk per sampling step.
        """
        _check_adapter(adapter)
        previous = self._active
        self._activate(adapter)
        try:
            yield
        finally:
            self._activate(previous)

    def _activate(self, adapter: str) -> None:
        if adapter == self._active:
            return
        if adapter == "reference":
            self.transformer.disable_adapters()
        else:
            if self._active == "reference":
                self.transformer.enable_adapters()
            self.transformer.set_adapter(adapter)
        self._active = adapter

    def _collect_adapter_parameters(self, adapter: str) -> dict[str, nn.Parameter]:
        """LoRA parameters of one adapter in module order, keyed by adapter-free names."""
        found = {}
        for name, parameter in self.transformer.named_parameters():
            parts = name.split(".")
            for i in range(1, len(parts)):
                if parts[i] == adapter and parts[i - 1].startswith("lora_"):
                    found[".".join(parts[:i] + parts[i + 1 :])] = parameter
                    break
        if not found:
            raise RuntimeError(f"no LoRA parameters found for adapter {adapter!r}")
        return found

    def trainable_parameters(self) -> list[nn.Parameter]:
        """The ``default`` adapter's LoRA parameters, in module order (stable across runs)."""
        return list(self._params["default"].values())

    @torch.no_grad()
    def update_old(self, decay: float) -> None:
        """old <- decay * old + (1 - decay) * default, in place; ``decay=0`` copies."""
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"decay must be in [0, 1], got {decay!r}")
        for name, old in self._params["old"].items():
            old.mul_(decay).add_(self._params["default"][name], alpha=1.0 - decay)

    def lora_state(self, adapter: str = "default") -> dict[str, torch.Tensor]:
        """Detached copies of an adapter's LoRA weights, keyed without the adapter name."""
        return {k: p.detach().clone() for k, p in self._trained(adapter).items()}

    @torch.no_grad()
    def load_lora_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        """Copy ``state`` (from [`lora_state`][mogradient_diffusion.model.policy.Policy.lora_state]
        of either adapter) into ``adapter``."""
        params = self._trained(adapter)
        missing, unexpected = params.keys() - state.keys(), state.keys() - params.keys()
        if missing or unexpected:
            raise KeyError(
                f"LoRA state does not match adapter {adapter!r}: missing {sorted(missing)[:3]}"
                f" ({len(missing)}), unexpected {sorted(unexpected)[:3]} ({len(unexpected)})"
            )
        for name, parameter in params.items():
            parameter.copy_(state[name])

    def save_lora(self, directory: str | os.PathLike, adapter: str = "default") -> Path:
        """Write ``adapter`` in the diffusers LoRA format (``pipeline.load_lora_weights`` reads it).

        The LoRA config goes into the safetensors metadata so loaders keep alpha != rank.
        """
        from peft.utils import get_peft_model_state_dict

        self._trained(adapter)
        layers = get_peft_model_state_dict(self.transformer, adapter_name=adapter)
        metadata = self.transformer.peft_config[adapter].to_dict()
        self.family.pipeline_class().save_lora_weights(
            directory,
            transformer_lora_layers={k: v.detach().cpu().contiguous() for k, v in layers.items()},
            transformer_lora_adapter_metadata=metadata,
        )
        return Path(directory)

    def _trained(self, adapter: str) -> dict[str, nn.Parameter]:
        if adapter not in self._params:
            raise ValueError(f"adapter must be 'default' or 'old', got {adapter!r}")
        return self._params[adapter]

    # ----------------------------------------------------------------- model calls
    @torch.no_grad()
    def encode_prompts(
        self, prompts: list[str], max_sequence_length: int = 256
    ) -> PromptEmbeddings:
        """Text conditioning for ``prompts`` (the family's text encoders), without CFG rows."""
        if isinstance(prompts, str) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings")
        embeds = self.family.encode_prompts(self.pipeline, list(prompts), max_sequence_length)
        return embeds.to(dtype=self.dtype)

    def velocity(
        self,
        latents: torch.Tensor,
        sigmas: torch.Tensor | float,
        embeds: PromptEmbeddings,
        adapter: str = "default",
    ) -> torch.Tensor:
        """Predicted flow velocity (noise - x0) at noise levels ``sigmas`` (shape [B] or scalar).

        ``default`` runs with autograd; ``old`` and ``reference`` run under no_grad. The
        adapter that was active before the call (``default`` normally) is active after it.
        The transformer runs in the policy's dtype (bf16 in the recipes); the velocity comes
        back in the latents' dtype, so losses are computed in float32.
        """
        _check_adapter(adapter)
        sigmas = torch.as_tensor(sigmas, device=latents.device, dtype=torch.float32)
        if sigmas.ndim == 0:
            sigmas = sigmas.expand(len(latents))
        if sigmas.shape != (len(latents),) or len(embeds) != len(latents):
            raise ValueError(
                f"batch mismatch: latents {len(latents)}, sigmas {tuple(sigmas.shape)}, "
                f"embeds {len(embeds)}"
            )
        with (
            self.use_adapter(adapter),
            torch.set_grad_enabled(adapter == "default" and torch.is_grad_enabled()),
        ):
            velocity = self.family.velocity(
                self.denoiser, latents.to(self.dtype), sigmas, embeds, self.guidance
            )
        return velocity.to(latents.dtype)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, batch_size: int | None = None) -> torch.Tensor:
        """Images [B, 3, H, W] in [0, 1] from clean latents (the family's VAE conventions)."""
        chunks = latents.split(batch_size or len(latents))
        images = [self.family.decode(self.pipeline, chunk) for chunk in chunks]
        return (torch.cat(images).float() / 2 + 0.5).clamp(0, 1)

    def latent_shape(self, resolution: int) -> tuple[int, int, int]:
        """(channels, height, width) of the latents for a square image of ``resolution`` px."""
        return self.family.latent_shape(self.pipeline, resolution)

    def sigmas(self, steps: int, resolution: int, shift: float | None = None) -> torch.Tensor:
        """Noise levels [steps + 1] of the family's schedule; ``shift`` overrides its shift."""
        return self.family.sigmas(self.pipeline, steps, resolution, shift)


def _check_adapter(adapter: str) -> None:
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, got {adapter!r}")


__all__ = [
    "ADAPTERS",
    "DTYPES",
    "SHARDING",
    "LoraSpec",
    "Policy",
]
