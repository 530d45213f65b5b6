"""Per-GPU memory of LoRA training at each family's reference recipe, counted where it can be.

Why: whether a recipe fits a 24, 48, 80 or 141 GB card decides how it is run (one GPU,
text encoders offloaded, gradient checkpointing, sharding), and no GPU is needed to
know most of the answer. Every module here is built on the meta device from its
released config, so nothing is allocated and the counts take seconds.

Counted exactly (device-independent):

* parameters and buffers of the transformer, the text encoders and the VAE;
* the LoRA parameters peft injects for the recipe's rank and targets (D);
* the tensors autograd saves in one training forward of the transformer at the recipe's
  rows and token counts, with attention saving what a flash kernel saves (q, k, v, the
  output and the log-sum-exp; on meta the SDPA call would otherwise take the math path
  and save the T x T weights, which no GPU run keeps);
* what gradient checkpointing keeps instead (the blocks' inputs, everything outside the
  blocks, and one block recomputed at a time);
* the LoRA layers' inputs that the per-row gradient engine
  ([`mogradient.engines.RowGradients`][mogradient.engines.RowGradients]) holds on solve
  steps, beyond those;
* under FSDP2 (``model.shard: fsdp2``), the frozen transformer's shard per GPU plus the
  blocks all-gathered whole.

Modelled (see ``benchmarks/bench_memory_estimate.py`` for the measurements behind it):

* the backward's transient working set, as ``TRANSIENT_BLOCK_FRACTION`` of the
  largest block's saved bytes, the largest ratio measured on CPU;
* ``RUNTIME_RESERVE_GIB`` for the CUDA context and library workspaces, assumed.

Not modelled: the allocator's rounding and fragmentation, the rollout (no-grad forwards
and VAE decoding, below the training peak), and the K-backward engine, whose vmapped
backward widens every gradient buffer K times.
"""

from __future__ import annotations

import importlib
import json
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mogradient.engines import default_blocks
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families import Family, family_named
from mogradient_diffusion.model.policy import LoraSpec

GIB = 2**30
# Frozen weights, text encoders and VAE in the recipes' precision; LoRA in float32
# (Policy._upcast_lora), as are its gradient, Adam moments and EMA.
WEIGHT_BYTES = 2
LORA_BYTES = 4
# What the trainer keeps per LoRA parameter: the trained adapter and the rollout adapter
# (Policy's ``default`` and ``old``), the EMA shadow (training/ema.py), the gradient, and
# AdamW's two moments.
LORA_COPIES = {"adapters (default, old)": 2, "EMA": 1, "gradient": 1, "Adam moments": 2}
# A solve step holds the running K x D sum and the current piece's stack at once
# (mogradient.engines.accumulate_gradients).
STACK_COPIES = 2
# The backward's working set beyond the saved tensors, as a fraction of the largest
# block's saved bytes: the largest ratio measured on CPU over the scaled-down configs
# of all three families (0.45, Qwen-Image at width 192; benchmarks/results/
# memory_estimate.md). A GPU's attention backward may need more; not measured.
TRANSIENT_BLOCK_FRACTION = 0.45
# CUDA context, cuBLAS/cuDNN workspaces and allocator slack: assumed, not measured here.
RUNTIME_RESERVE_GIB = 1.5
VAE_SCALE_FACTOR = 8  # all three families' VAEs downsample 8x

# ------------------------------------------------------------------ released configs
# stabilityai/stable-diffusion-3.5-medium, transformer/config.json (MMDiT-X): 24 layers,
# 24 heads x 64 = hidden 1536, a second, image-only attention in layers 0..12, RMS QK-norm.
SD35M_TRANSFORMER: dict[str, Any] = {
    "sample_size": 128,
    "patch_size": 2,
    "in_channels": 16,
    "out_channels": 16,
    "num_layers": 24,
    "attention_head_dim": 64,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048,
    "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)),
    "qk_norm": "rms_norm",
}
# The SD3 / SD3.5 VAE (vae/config.json): 16 latent channels, 8x downsampling. FLUX.1's
# VAE has the same layers (black-forest-labs/flux, AutoEncoderParams: ch 128, ch_mult
# 1, 2, 4, 4, z 16) and only other latent statistics.
SD3_VAE: dict[str, Any] = {
    "in_channels": 3,
    "out_channels": 3,
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "latent_channels": 16,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "sample_size": 1024,
    "scaling_factor": 1.5305,
    "shift_factor": 0.0609,
    "use_quant_conv": False,
    "use_post_quant_conv": False,
    "force_upcast": True,
}
FLUX_VAE: dict[str, Any] = {**SD3_VAE, "scaling_factor": 0.3611, "shift_factor": 0.1159}
# black-forest-labs/FLUX.1-dev transformer/config.json (= BFL flux/util.py "flux-dev":
# hidden 3072, depth 19, depth_single_blocks 38, 24 heads, context_in 4096, vec_in 768,
# guidance_embed True).
FLUX1_DEV_TRANSFORMER: dict[str, Any] = {
    "patch_size": 1,
    "in_channels": 64,
    "num_layers": 19,
    "num_single_layers": 38,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 4096,
    "pooled_projection_dim": 768,
    "guidance_embeds": True,
    "axes_dims_rope": [16, 56, 56],
}
# Qwen/Qwen-Image transformer/config.json (the defaults of diffusers'
# QwenImageTransformer2DModel): 60 layers, 24 heads x 128, text width 3584.
QWEN_IMAGE_TRANSFORMER: dict[str, Any] = {
    "patch_size": 2,
    "in_channels": 64,
    "out_channels": 16,
    "num_layers": 60,
    "attention_head_dim": 128,
    "num_attention_heads": 24,
    "joint_attention_dim": 3584,
    "guidance_embeds": False,
    "axes_dims_rope": [16, 56, 56],
}
# Qwen/Qwen-Image vae/config.json (AutoencoderKLQwenImage defaults).
QWEN_IMAGE_VAE: dict[str, Any] = {
    "base_dim": 96,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 2,
    "temperal_downsample": [False, True, True],
}
# openai/clip-vit-large-patch14's text tower (SD3's text_encoder, FLUX's text_encoder).
CLIP_L: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 77,
    "projection_dim": 768,
    "hidden_act": "quick_gelu",
}
# laion/CLIP-ViT-bigG-14-laion2B-39B-b160k's text tower (SD3's text_encoder_2).
CLIP_G: dict[str, Any] = {
    "vocab_size": 49408,
    "hidden_size": 1280,
    "intermediate_size": 5120,
    "num_hidden_layers": 32,
    "num_attention_heads": 20,
    "max_position_embeddings": 77,
    "projection_dim": 1280,
    "hidden_act": "gelu",
}
# google/t5-v1_1-xxl's encoder (SD3's text_encoder_3, FLUX's text_encoder_2).
T5_XXL: dict[str, Any] = {
    "vocab_size": 32128,
    "d_model": 4096,
    "d_kv": 64,
    "d_ff": 10240,
    "num_layers": 24,
    "num_heads": 64,
    "feed_forward_proj": "gated-gelu",
}
# Qwen/Qwen2.5-VL-7B-Instruct config.json (Qwen-Image's text_encoder). The whole model
# is loaded, vision tower and lm_head included, though only text hidden states are read.
QWEN25_VL_7B: dict[str, Any] = {
    "vocab_size": 152064,
    "hidden_size": 3584,
    "text_config": {
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "rope_scaling": {"mrope_section": [16, 24, 24], "rope_type": "default"},
    },
    "vision_config": {
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "out_hidden_size": 3584,
    },
}


@dataclass(frozen=True)
class ModuleSpec:
    """A module class and its released config: built on the meta device to be counted."""

    name: str
    class_name: str  # a diffusers or transformers class
    config: Mapping[str, Any]
    config_class: str | None = None  # transformers models take a config object

    def build(self, device: torch.device | str = "meta") -> nn.Module:
        library = importlib.import_module("transformers" if self.config_class else "diffusers")
        with torch.device(device):
            if self.config_class is None:
                return getattr(library, self.class_name)(**self.config)
            config = getattr(library, self.config_class)(**self.config)
            return getattr(library, self.class_name)(config)


@dataclass(frozen=True)
class Recipe:
    """One family's reference training setup, per GPU, with where each number comes from."""

    name: str
    label: str
    family: str
    transformer: ModuleSpec
    text_encoders: tuple[ModuleSpec, ...]
    vae: ModuleSpec
    resolution: int
    batch: int  # samples per GPU in one training forward (train.batch_size)
    forward_copies: int  # 2 when both halves of CFG run through the trained forward
    text_tokens: int
    lora_rank: int
    lora_targets: tuple[str, ...]
    rewards: int  # K: the rewards MARBLE takes one gradient for
    source: str

    @property
    def rows(self) -> int:
        """Rows of the trained forward: samples times CFG copies."""
        return self.batch * self.forward_copies


CLIP_L_SPEC = ModuleSpec("CLIP-L", "CLIPTextModelWithProjection", CLIP_L, "CLIPTextConfig")
T5_SPEC = ModuleSpec("T5-XXL encoder", "T5EncoderModel", T5_XXL, "T5Config")
# The shipped recipes' per-GPU numbers (tests/diffusion/test_memory.py checks them against
# the config files); K = their five rewards.
# The recipe's LoRA targets (configs/sd35m_base.yaml, as the references name them): the
# "attn." prefix leaves out the attn2 layers of SD3.5-M's dual-attention blocks.
SD35M_RECIPE_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "attn.add_q_proj",
    "attn.add_k_proj",
    "attn.add_v_proj",
    "attn.to_add_out",
)


RECIPES: dict[str, Recipe] = {
    "sd35m": Recipe(
        name="sd35m",
        label="SD3.5-Medium",
        family="sd3",
        transformer=ModuleSpec("transformer", "SD3Transformer2DModel", SD35M_TRANSFORMER),
        text_encoders=(
            CLIP_L_SPEC,
            ModuleSpec("CLIP-G", "CLIPTextModelWithProjection", CLIP_G, "CLIPTextConfig"),
            T5_SPEC,
        ),
        vae=ModuleSpec("VAE", "AutoencoderKL", SD3_VAE),
        resolution=512,
        batch=9,
        forward_copies=1,
        text_tokens=77 + 128,  # CLIP tokens + T5 tokens (rollout.max_sequence_length)
        lora_rank=32,
        lora_targets=SD35M_RECIPE_TARGETS,
        rewards=5,
        source="configs/sd35m_marble_5r.yaml (the MARBLE release's SD3.5-M numbers)",
    ),
    "flux1dev": Recipe(
        name="flux1dev",
        label="FLUX.1-dev",
        family="flux",
        transformer=ModuleSpec("transformer", "FluxTransformer2DModel", FLUX1_DEV_TRANSFORMER),
        text_encoders=(
            ModuleSpec("CLIP-L", "CLIPTextModel", CLIP_L, "CLIPTextConfig"),
            T5_SPEC,
        ),
        vae=ModuleSpec("VAE", "AutoencoderKL", FLUX_VAE),
        resolution=512,
        batch=3,
        forward_copies=1,  # embedded guidance, no CFG: one forward per step
        text_tokens=128,  # T5 tokens
        lora_rank=64,
        lora_targets=family_named("flux").lora_targets,
        rewards=5,
        source="configs/flux1dev_marble.yaml (Flow-GRPO's FLUX.1-dev numbers)",
    ),
    "qwen_image": Recipe(
        name="qwen_image",
        label="Qwen-Image",
        family="qwen_image",
        transformer=ModuleSpec(
            "transformer", "QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER
        ),
        text_encoders=(
            ModuleSpec(
                "Qwen2.5-VL-7B",
                "Qwen2_5_VLForConditionalGeneration",
                QWEN25_VL_7B,
                "Qwen2_5_VLConfig",
            ),
        ),
        vae=ModuleSpec("VAE", "AutoencoderKLQwenImage", QWEN_IMAGE_VAE),
        resolution=512,
        batch=12,
        forward_copies=1,  # true_cfg_scale 1: no CFG
        text_tokens=256,  # the cap; batches pad to their longest prompt, often shorter
        lora_rank=64,
        lora_targets=family_named("qwen_image").lora_targets,
        rewards=5,
        source="configs/qwen_image_marble.yaml (VeRL-Omni's DiffusionNFT numbers)",
    ),
}


# ------------------------------------------------------------------------ counting
def module_bytes(module: nn.Module, dtype_bytes: int | None = None) -> int:
    """Bytes of a module's parameters and buffers, floating ones at ``dtype_bytes`` per
    element when given (the dtype a pipeline is loaded in; integer buffers keep theirs)."""
    tensors = {id(t): t for t in (*module.parameters(), *module.buffers())}
    return sum(
        t.numel() * (dtype_bytes if dtype_bytes and t.is_floating_point() else t.element_size())
        for t in tensors.values()
    )


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def add_lora(transformer: nn.Module, family: Family, rank: int, targets: tuple[str, ...]) -> int:
    """Inject the recipe's LoRA with peft as ``Policy.load`` does (the family's exclusions,
    float32 weights, only they trainable) and return its parameter count D."""
    transformer.requires_grad_(False)
    spec = LoraSpec(rank=rank, alpha=2.0 * rank, target_modules=targets)
    transformer.add_adapter(spec.peft_config(family.lora_excluded(transformer)))
    lora = [p for name, p in transformer.named_parameters() if "lora_" in name]
    for parameter in lora:
        parameter.data = parameter.data.float()
        parameter.requires_grad_(True)
    return sum(p.numel() for p in lora)


class _FlashAttentionOnMeta(TorchFunctionMode):
    """Send meta-device SDPA calls to the flash kernel, whose saved tensors a GPU run keeps."""

    NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        given = {**dict(zip(self.NAMES, args, strict=False)), **kwargs}
        if given["query"].device.type != "meta":
            return func(*args, **kwargs)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            given["query"],
            given["key"],
            given["value"],
            given.get("dropout_p", 0.0),
            given.get("is_causal", False),
            attn_mask=given.get("attn_mask"),
            scale=given.get("scale"),
        )[0]


@dataclass(frozen=True)
class ActivationTrace:
    """Bytes one training forward leaves for the backward, by who keeps them."""

    saved: int  # every tensor autograd saves (no checkpointing)
    kept: int  # with checkpointing: outside the blocks plus the blocks' inputs
    blocks: tuple[int, ...]  # each block's saved bytes beyond ``kept`` (recomputed)
    row_captures: int  # per-row engine: the LoRA Linears' inputs beyond ``saved``
    row_captures_checkpointed: int  # the same beyond ``kept``

    def activations(self, checkpointing: bool) -> int:
        """Bytes alive when the backward starts; checkpointing adds the one recomputed block."""
        return self.kept + max(self.blocks) if checkpointing else self.saved

    def transient(self) -> int:
        return int(TRANSIENT_BLOCK_FRACTION * max(self.blocks))

    def captures(self, checkpointing: bool) -> int:
        return self.row_captures_checkpointed if checkpointing else self.row_captures


def transformer_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The repeated blocks (every ``*blocks`` ModuleList): the units checkpointing wraps."""
    return [
        block
        for name, child in transformer.named_children()
        if name.endswith("blocks") and isinstance(child, nn.ModuleList)
        for block in child
    ]


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def trace_training_forward(
    transformer: nn.Module, forward: Callable[[], torch.Tensor]
) -> ActivationTrace:
    """Run ``forward`` (one training forward to a scalar loss) and account its tensors.

    Tensors are told apart by storage, so views and tensors saved twice count once;
    parameters and buffers are resident weights, not activations.
    """
    resident = {
        id(t.untyped_storage()) for t in (*transformer.parameters(), *transformer.buffers())
    }
    storages: list[Any] = []  # held so that ids stay unique while counting
    sizes: dict[int, int] = {}
    saved: dict[int, int] = {}  # storage -> block index, -1 outside the blocks
    inputs: set[int] = set()
    captured: set[int] = set()
    where = [-1]

    def note(tensor: torch.Tensor) -> int | None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in resident:
            return None
        if key not in sizes:
            storages.append(storage)
            sizes[key] = storage.nbytes()
        return key

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = note(tensor)
        if key is not None:
            saved.setdefault(key, where[0])
        return tensor

    handles = []
    for index, block in enumerate(transformer_blocks(transformer)):

        def enter(module: nn.Module, args: tuple, kwargs: dict, index: int = index) -> None:
            where[0] = index
            inputs.update(k for k in map(note, _tensors((args, kwargs))) if k is not None)

        def leave(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            where[0] = -1

        handles.append(block.register_forward_pre_hook(enter, with_kwargs=True))
        handles.append(block.register_forward_hook(leave, with_kwargs=True))

    def capture(module: nn.Module, args: tuple, output: Any) -> None:
        captured.update(k for k in map(note, _tensors(args)) if k is not None)

    for module in transformer.modules():
        own = list(module.parameters(recurse=False))
        if isinstance(module, nn.Linear) and any(p.requires_grad for p in own):
            handles.append(module.register_forward_hook(capture))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), _FlashAttentionOnMeta():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    kept = {k for k, block in saved.items() if block < 0} | inputs
    blocks = [0] * len(transformer_blocks(transformer))
    for key, block in saved.items():
        if block >= 0 and key not in kept:
            blocks[block] += sizes[key]

    def total(keys: set[int]) -> int:
        return sum(sizes[k] for k in keys)

    return ActivationTrace(
        saved=total(set(saved)),
        kept=total(kept),
        blocks=tuple(blocks),
        row_captures=total(captured - set(saved)),
        row_captures_checkpointed=total(captured - kept),
    )


def training_forward(
    transformer: nn.Module,
    family: Family,
    rows: int,
    resolution: int,
    text_tokens: int,
    dtype: torch.dtype = torch.bfloat16,
) -> Callable[[], torch.Tensor]:
    """One trained forward as the objectives run it: the family's velocity on unpacked
    latents, in ``dtype``, to a float32 loss (a mean square stands in for the objective,
    whose own tensors are latent-sized)."""
    device = next(transformer.parameters()).device
    stand_in = SimpleNamespace(vae_scale_factor=VAE_SCALE_FACTOR, transformer=transformer)
    shape = family.latent_shape(stand_in, resolution)
    config = transformer.config
    latents = torch.randn(rows, *shape, device=device, dtype=dtype)
    sigmas = torch.full((rows,), 0.5, device=device)
    text = torch.randn(rows, text_tokens, config.joint_attention_dim, device=device, dtype=dtype)
    pooled_width = config.get("pooled_projection_dim")
    pooled = None
    if pooled_width:
        pooled = torch.randn(rows, pooled_width, device=device, dtype=dtype)
    embeds = PromptEmbeddings(text, pooled)

    def forward() -> torch.Tensor:
        return family.velocity(transformer, latents, sigmas, embeds).float().square().mean()

    return forward


def measured_cpu_peak(step: Callable[[], Any]) -> int:
    """High-water mark of the bytes allocated during ``step`` on CPU (``torch.profiler``
    memory events): what the activation model is checked against."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        step()
    with tempfile.TemporaryDirectory() as folder:
        trace = Path(folder) / "trace.json"
        profiler.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    memory = sorted((e["ts"], e["args"]) for e in events if e.get("name") == "[memory]")
    return peak_bytes((args["Addr"], args["Bytes"]) for _, args in memory)


def peak_bytes(events: Iterable[tuple[int, int]]) -> int:
    """High-water mark of ``(address, bytes)`` allocation (+) and free (-) events in order,
    counting only frees of blocks allocated within them.

    The profiler sometimes remembers a block's size from an earlier session: a block made
    before this one at an address it saw then, freed during ``step``, comes out as a free
    of the stale size (reproduced, not every time). Counted, it lowers the peak; a full
    suite once measured half the usual peak."""
    live: dict[int, int] = {}
    current = peak = 0
    for address, nbytes in events:
        if nbytes > 0:
            live[address] = live.get(address, 0) + nbytes
        elif address in live:
            nbytes = -live.pop(address)
        else:
            continue
        current += nbytes
        peak = max(peak, current)
    return peak


# ------------------------------------------------------------------------ estimate
@dataclass(frozen=True)
class MemoryEstimate:
    """One recipe's per-GPU bytes by component (see the module docstring for each)."""

    recipe: Recipe
    transformer_parameters: int
    transformer_bytes: int
    block_bytes: tuple[int, ...]  # each unit shard_frozen all-gathers whole (a block)
    text_encoder_parameters: dict[str, int]
    text_encoder_bytes: int
    vae_parameters: int
    vae_bytes: int
    lora_parameters: int
    trace: ActivationTrace  # at the recipe's rows

    @property
    def lora_state_bytes(self) -> int:
        return sum(LORA_COPIES.values()) * LORA_BYTES * self.lora_parameters

    @property
    def stack_bytes(self) -> int:
        """The K x D per-reward gradient stack in float32, as a solve step holds it."""
        return STACK_COPIES * self.recipe.rewards * LORA_BYTES * self.lora_parameters

    def transformer_resident(self, shards: int = 1) -> int:
        """The frozen transformer's bytes per GPU, sharded over ``shards`` GPUs by FSDP2
        (``model.shard: fsdp2``): its shard, plus two blocks all-gathered whole (the one
        running and the one prefetched) and the weights outside the blocks (gathered for
        the root's own layers)."""
        if shards == 1:
            return self.transformer_bytes
        outside = self.transformer_bytes - sum(self.block_bytes)
        shard = -(-self.transformer_bytes // shards)
        return shard + 2 * max(self.block_bytes) + outside

    def resident(self, encoders: bool, shards: int = 1) -> int:
        """Weights and LoRA state, with or without the text encoders on the GPU."""
        text = self.text_encoder_bytes if encoders else 0
        return self.transformer_resident(shards) + text + self.vae_bytes + self.lora_state_bytes

    def step_bytes(self, checkpointing: bool, solve: bool, batch: int | None = None) -> int:
        """A training step's peak above the resident state: activations, the backward's
        working set and, on a solve step, the K x D stack and the per-row captures.

        Activation terms scale with ``batch`` (default: the recipe's) in proportion:
        every saved tensor has a row axis but the rotary tables, which are small.
        """
        scale = (batch or self.recipe.batch) / self.recipe.batch
        rows = self.trace.activations(checkpointing) + self.trace.transient()
        if solve:
            rows += self.trace.captures(checkpointing)
        return int(scale * rows) + (self.stack_bytes if solve else 0)

    def total(
        self,
        checkpointing: bool,
        solve: bool,
        encoders: bool,
        batch: int | None = None,
        shards: int = 1,
    ) -> int:
        reserve = int(RUNTIME_RESERVE_GIB * GIB)
        step = self.step_bytes(checkpointing, solve, batch)
        return self.resident(encoders, shards) + step + reserve

    def largest_batch(
        self, capacity: int, checkpointing: bool, solve: bool, encoders: bool, shards: int = 1
    ) -> int:
        """The most samples per training forward that fit in ``capacity`` bytes (0: none)."""
        batch = 0
        while self.total(checkpointing, solve, encoders, batch + 1, shards) <= capacity:
            batch += 1
        return batch


def estimate(recipe: Recipe) -> MemoryEstimate:
    """Count ``recipe`` on the meta device."""
    family = family_named(recipe.family)
    encoders = {spec.name: spec.build() for spec in recipe.text_encoders}
    vae = recipe.vae.build()
    transformer = recipe.transformer.build().to(torch.bfloat16)
    transformer_parameters = parameter_count(transformer)
    transformer_bytes = module_bytes(transformer, WEIGHT_BYTES)
    blocks = tuple(module_bytes(b, WEIGHT_BYTES) for b in default_blocks(transformer))
    lora = add_lora(transformer, family, recipe.lora_rank, recipe.lora_targets)
    forward = training_forward(
        transformer, family, recipe.rows, recipe.resolution, recipe.text_tokens
    )
    return MemoryEstimate(
        recipe=recipe,
        transformer_parameters=transformer_parameters,
        transformer_bytes=transformer_bytes,
        block_bytes=blocks,
        text_encoder_parameters={name: parameter_count(m) for name, m in encoders.items()},
        text_encoder_bytes=sum(module_bytes(m, WEIGHT_BYTES) for m in encoders.values()),
        vae_parameters=parameter_count(vae),
        vae_bytes=module_bytes(vae, WEIGHT_BYTES),
        lora_parameters=lora,
        trace=trace_training_forward(transformer, forward),
    )


# ------------------------------------------------------------------------ GPUs
@dataclass(frozen=True)
class GPU:
    """A card class and the total memory nvidia-smi reports for it."""

    label: str
    total_mib: int

    @property
    def bytes(self) -> int:
        return self.total_mib * 2**20


# nvidia-smi's totals as printed in public logs for these cards.
GPUS = (
    GPU("24 GB (RTX 4090)", 24564),
    GPU("48 GB (L40S, A6000)", 46068),
    GPU("80 GB (H100)", 81559),
    GPU("141 GB (H200)", 143771),
)


def scaled_down(recipe: Recipe, heads: int, head_dim: int, layers: int) -> ModuleSpec:
    """The recipe's transformer config with widths and depth scaled down, structure kept
    (dual attention, single blocks, QK-norm, patching): small enough to run on a CPU."""
    width = heads * head_dim
    rope = [head_dim // 4, head_dim // 4, head_dim // 2]
    text = {"joint_attention_dim": 64}
    overrides: dict[str, dict[str, Any]] = {
        "sd3": {
            **text,
            "num_layers": layers,
            "caption_projection_dim": width,
            "pooled_projection_dim": 64,
            "pos_embed_max_size": 64,
            "dual_attention_layers": list(range((layers + 1) // 2)),
        },
        "flux": {
            **text,
            "num_layers": layers,
            "num_single_layers": 2 * layers,
            "pooled_projection_dim": 64,
            "axes_dims_rope": rope,
        },
        "qwen_image": {**text, "num_layers": layers, "axes_dims_rope": rope},
    }
    config = {
        **recipe.transformer.config,
        "attention_head_dim": head_dim,
        "num_attention_heads": heads,
        **overrides[recipe.family],
    }
    return replace(recipe.transformer, config=config)


__all__ = [
    "GIB",
    "GPUS",
    "LORA_COPIES",
    "RECIPES",
    "TRANSIENT_BLOCK_FRACTION",
    "ActivationTrace",
    "MemoryEstimate",
    "ModuleSpec",
    "Recipe",
    "add_lora",
    "estimate",
    "measured_cpu_peak",
    "module_bytes",
    "peak_bytes",
    "scaled_down",
    "trace_training_forward",
    "training_forward",
]
