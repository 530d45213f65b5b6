"""Per-GPU memory of each family's reference recipe, and its activation count checked
against measured peaks on CPU.

Why: no GPU was at hand to measure SD3.5-M, FLUX.1-dev or Qwen-Image training, and the
question "which card does a recipe fit" is mostly a count. The estimate is
:mod:`benchmarks.memory_model` (meta-device counts at the released configs);
this script tabulates it per family for 24, 48, 80 and 141 GB cards and checks the part
that is a model rather than a count.

The check: transformers of each family's structure, scaled down (widths 64-256, 2-3
layers), run one training forward and backward on CPU in bf16 with the recipe's LoRA,
with and without gradient checkpointing, with and without the per-row engine's
recording. The measured peak is the high-water mark of the CPU allocator's
allocations during the step (``torch.profiler`` memory events); the estimate is the
same meta-device count the recipe table uses, plus the LoRA gradients the backward
allocates and the modelled transient. The table shows the error and the transient each
run needed (``TRANSIENT_BLOCK_FRACTION`` is the largest of them, rounded up).

Run: ``python benchmarks/bench_memory_estimate.py`` (about a minute on two cores);
writes ``benchmarks/results/memory_estimate.{json,md}``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path
from typing import Any

import torch
from common import machine_info, machine_markdown, markdown_table, write_results
from memory_model import (
    GIB,
    GPUS,
    LORA_COPIES,
    RECIPES,
    RUNTIME_RESERVE_GIB,
    STACK_COPIES,
    TRANSIENT_BLOCK_FRACTION,
    ActivationTrace,
    MemoryEstimate,
    Recipe,
    add_lora,
    estimate,
    measured_cpu_peak,
    scaled_down,
    trace_training_forward,
    training_forward,
    transformer_blocks,
)

from mogradient.engines import RowGradients
from mogradient_diffusion.model.families import family_named

# GPUs of one node that model.shard: fsdp2 shards the frozen transformer over
FSDP_GPUS = 8
# (heads, head_dim, layers, batch, resolution, text tokens): widths 64 to 256, up to 256
# image tokens; the first is also the test suite's quick case.
CASES = (
    (2, 32, 2, 2, 128, 32),
    (4, 32, 2, 2, 256, 64),
    (3, 64, 3, 2, 256, 32),
    (4, 64, 2, 1, 256, 64),
)
MODES = (
    ("plain", False, False),
    ("checkpointing", True, False),
    ("row engine", False, True),
    ("row engine + checkpointing", True, True),
)


def build(recipe: Recipe, case: tuple[int, ...], device: str) -> tuple[torch.nn.Module, int]:
    """A scaled-down transformer of ``recipe`` in bf16 with the recipe's LoRA targets, its
    rank scaled with the width (at least 2); returns it and D."""
    heads, head_dim, layers = case[:3]
    config = recipe.transformer.config
    rank = max(2, recipe.lora_rank * heads * head_dim // _width(config))
    torch.manual_seed(0)
    transformer = scaled_down(recipe, heads, head_dim, layers).build(device).to(torch.bfloat16)
    family = family_named(recipe.family)
    return transformer, add_lora(transformer, family, rank, recipe.lora_targets)


def _width(config: dict[str, Any]) -> int:
    return config["num_attention_heads"] * config["attention_head_dim"]


def validate(recipe: Recipe, case: tuple[int, ...]) -> dict[str, Any]:
    """Counted (meta) against measured (CPU) for one scaled-down case, in every mode."""
    heads, head_dim, layers, batch, resolution, text_tokens = case
    family = family_named(recipe.family)
    rows = batch * recipe.forward_copies

    def traced(device: str) -> tuple[torch.nn.Module, int, ActivationTrace]:
        transformer, lora = build(recipe, case, device)
        forward = training_forward(transformer, family, rows, resolution, text_tokens)
        return transformer, lora, trace_training_forward(transformer, forward)

    _, lora, counted = traced("meta")
    transformer, _, counted_cpu = traced("cpu")
    forward = training_forward(transformer, family, rows, resolution, text_tokens)
    lora_parameters = [p for p in transformer.parameters() if p.requires_grad]
    for parameter in lora_parameters:  # resident, as in training: not part of the step
        parameter.grad = torch.zeros_like(parameter)
    recorder = RowGradients(transformer, lora_parameters)
    modes = {}
    for label, checkpointing, rows_engine in MODES:
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        else:
            transformer.disable_gradient_checkpointing()

        def step(rows_engine: bool = rows_engine) -> None:
            if rows_engine:  # the forward recorded as a solve step records it
                with recorder.recording():
                    loss = forward()
            else:
                loss = forward()
            loss.backward()
            recorder._take()  # drop the recorded calls, as a solve step's contraction does

        measured = measured_cpu_peak(step)
        kept = counted.activations(checkpointing)
        if rows_engine:
            kept += counted.captures(checkpointing)
        estimated = kept + counted.transient()
        modes[label] = {
            "measured_bytes": measured,
            "estimated_bytes": estimated,
            "error": estimated / measured - 1,
            "transient_fraction_needed": (measured - kept) / max(counted.blocks),
        }
    width = heads * head_dim
    blocks = len(transformer_blocks(transformer))
    image_tokens = (resolution // 16) ** 2
    return {
        "family": recipe.family,
        "width": width,
        "heads": heads,
        "layers": layers,
        "blocks": blocks,
        "rows": rows,
        "image_tokens": image_tokens,
        "text_tokens": text_tokens,
        "lora_parameters": lora,
        "saved_bytes_meta": counted.saved,
        "saved_bytes_cpu": counted_cpu.saved,
        "meta_minus_cpu": counted.saved / counted_cpu.saved - 1,
        "bytes_per_row_token_channel_block": _density(
            counted.saved, rows, image_tokens + text_tokens, width, blocks
        ),
        "modes": modes,
    }


def _density(saved: int, rows: int, tokens: int, width: int, blocks: int) -> float:
    """Saved bytes per (row x token x channel x block): the activation model's one number."""
    return saved / (rows * tokens * width * blocks)


def recipe_payload(result: MemoryEstimate, high_resolution: ActivationTrace) -> dict[str, Any]:
    """One recipe's components, totals and fits, in GiB."""
    recipe = result.recipe
    width = _width(recipe.transformer.config)
    blocks = len(result.trace.blocks)
    image_tokens = (recipe.resolution // 16) ** 2
    settings = [
        (checkpointing, solve, encoders, 1)
        for checkpointing in (False, True)
        for solve in (False, True)
        for encoders in (False, True)
    ]
    # model.shard: fsdp2 on one node, in the setting a large model trains in
    settings += [(True, solve, False, FSDP_GPUS) for solve in (False, True)]
    totals = {}
    for checkpointing, solve, encoders, shards in settings:
        key = _setting(checkpointing, solve, encoders, shards)
        total = result.total(checkpointing, solve, encoders, shards=shards)
        totals[key] = {
            "gib": total / GIB,
            "fits": [gpu.label for gpu in GPUS if total <= gpu.bytes],
            "largest_batch": {
                gpu.label: result.largest_batch(gpu.bytes, checkpointing, solve, encoders, shards)
                for gpu in GPUS
            },
        }
    trace = result.trace
    return {
        "recipe": {
            "label": recipe.label,
            "family": recipe.family,
            "resolution": recipe.resolution,
            "batch": recipe.batch,
            "rows": recipe.rows,
            "image_tokens": image_tokens,
            "text_tokens": recipe.text_tokens,
            "lora_rank": recipe.lora_rank,
            "lora_targets": list(recipe.lora_targets),
            "rewards": recipe.rewards,
            "source": recipe.source,
        },
        "parameters": {
            "transformer": result.transformer_parameters,
            "text_encoders": result.text_encoder_parameters,
            "vae": result.vae_parameters,
            "lora": result.lora_parameters,
        },
        "gib": {
            "transformer": result.transformer_bytes / GIB,
            f"transformer_fsdp{FSDP_GPUS}": result.transformer_resident(FSDP_GPUS) / GIB,
            "text_encoders": result.text_encoder_bytes / GIB,
            "vae": result.vae_bytes / GIB,
            "lora_state": result.lora_state_bytes / GIB,
            "stack": result.stack_bytes / GIB,
            "activations": trace.activations(False) / GIB,
            "activations_checkpointed": trace.activations(True) / GIB,
            "largest_block": max(trace.blocks) / GIB,
            "transient": trace.transient() / GIB,
            "row_captures": trace.captures(False) / GIB,
            "row_captures_checkpointed": trace.captures(True) / GIB,
        },
        "bytes_per_row_token_channel_block": {
            f"{recipe.resolution} px": _density(
                trace.saved, recipe.rows, image_tokens + recipe.text_tokens, width, blocks
            ),
            "1024 px, 1 sample": _density(
                high_resolution.saved,
                recipe.forward_copies,
                (1024 // 16) ** 2 + recipe.text_tokens,
                width,
                blocks,
            ),
            f"{recipe.resolution} px, checkpointing (kept)": _density(
                trace.kept, recipe.rows, image_tokens + recipe.text_tokens, width, blocks
            ),
        },
        "totals": totals,
    }


def _setting(checkpointing: bool, solve: bool, encoders: bool, shards: int) -> str:
    return (
        (f"FSDP2 over {shards} GPUs, " if shards > 1 else "")
        + f"checkpointing {'on' if checkpointing else 'off'}, "
        f"{'solve' if solve else 'combined'} step, "
        f"text encoders {'resident' if encoders else 'offloaded'}"
    )


def high_resolution_trace(recipe: Recipe) -> ActivationTrace:
    """One sample at 1024 px (4096 image tokens): does the count stay linear in tokens?"""
    family = family_named(recipe.family)
    transformer = recipe.transformer.build().to(torch.bfloat16)
    add_lora(transformer, family, recipe.lora_rank, recipe.lora_targets)
    forward = training_forward(transformer, family, recipe.forward_copies, 1024, recipe.text_tokens)
    return trace_training_forward(transformer, forward)


def _gib(value: float) -> str:
    return f"{value:.1f}"


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def render(payload: dict[str, Any]) -> str:
    """The markdown result file."""
    recipes = payload["recipes"]
    lines = [
        "# Memory estimate per model family (bf16, one GPU)",
        "",
        machine_markdown(payload["machine"]),
        "",
        "Estimated, not measured on a GPU: parameters, LoRA and the tensors a training "
        "forward saves are counted exactly on the meta device from the released configs "
        "(`benchmarks/memory_model.py`); the backward's transient "
        f"({TRANSIENT_BLOCK_FRACTION} x the largest block's saved bytes) is calibrated on "
        f"CPU below; {RUNTIME_RESERVE_GIB} GiB for the CUDA context and workspaces is "
        "assumed. Frozen weights in bf16; LoRA, its gradient, EMA and Adam moments in "
        f"float32 ({sum(LORA_COPIES.values())} copies of D: "
        f"{', '.join(f'{k} {v}' for k, v in LORA_COPIES.items())}); the K x D stack "
        f"{STACK_COPIES} times (running sum and current piece). The per-row engine keeps "
        "each LoRA Linear call's input (its contraction needs it; without checkpointing "
        "autograd keeps the same tensor). Under `model.shard: fsdp2` each GPU holds its "
        "shard of the frozen transformer, two blocks all-gathered whole (the running one "
        "and the prefetched one) and the weights outside the blocks; the LoRA state stays "
        "whole on every GPU.",
        "",
        "## Recipes",
        "",
        markdown_table(
            [
                "family",
                "px",
                "samples/GPU (rows)",
                "image + text tokens",
                "LoRA",
                "K",
                "source",
            ],
            [
                [
                    r["recipe"]["label"],
                    str(r["recipe"]["resolution"]),
                    f"{r['recipe']['batch']} ({r['recipe']['rows']})",
                    f"{r['recipe']['image_tokens']} + {r['recipe']['text_tokens']}",
                    f"r{r['recipe']['lora_rank']}, {len(r['recipe']['lora_targets'])} targets",
                    str(r["recipe"]["rewards"]),
                    r["recipe"]["source"],
                ]
                for r in recipes.values()
            ],
        ),
        "",
        "## Components (GiB)",
        "",
        markdown_table(
            [
                "family",
                "transformer (params)",
                f"transformer per GPU, FSDP2 over {FSDP_GPUS}",
                "text encoders (params)",
                "VAE",
                "LoRA D",
                "LoRA state",
                "K x D stack",
                "activations: no ckpt / ckpt",
                "transient",
                "row-engine captures: no ckpt / ckpt",
            ],
            [_component_row(r) for r in recipes.values()],
        ),
        "",
        "## Which GPUs fit (GiB at the recipe's batch; largest samples per GPU)",
        "",
        "A combined step is a weighted-sum step or a cached MARBLE step (one backward); "
        "a solve step takes the K per-reward gradients with the per-row engine.",
        "",
        markdown_table(
            ["family", "setting", "total GiB", *[gpu.label for gpu in GPUS]],
            [
                [
                    r["recipe"]["label"],
                    setting,
                    _gib(total["gib"]),
                    *[
                        ("fits" if gpu.label in total["fits"] else "no")
                        + f" ({total['largest_batch'][gpu.label]})"
                        for gpu in GPUS
                    ],
                ]
                for r in recipes.values()
                for setting, total in r["totals"].items()
            ],
        ),
        "",
        "## Activation model against measured CPU peaks",
        "",
        "Scaled-down transformers of each family (same blocks, narrower and shallower), "
        "bf16 with the recipe's LoRA targets (rank scaled with the width, at least 2), one "
        "forward + backward on CPU with the LoRA gradients already allocated (in training "
        "they stay between micro-batches). Measured: peak bytes allocated during the step "
        "(`torch.profiler` memory events). Estimated: the meta-device count + the "
        "transient (+ the row engine's captures in its modes). `needed`: the "
        "transient, in largest-block units, that would make the estimate exact. The "
        "meta-device count and the count of the same forward run on CPU differ by at most "
        f"{100 * payload['meta_minus_cpu_largest']:.2f}% of the saved bytes.",
        "",
        markdown_table(
            [
                "family",
                "width",
                "blocks",
                "rows x (image + text) tokens",
                *[label for label, _, _ in MODES],
            ],
            [
                [
                    case["family"],
                    str(case["width"]),
                    str(case["blocks"]),
                    f"{case['rows']} x ({case['image_tokens']} + {case['text_tokens']})",
                    *[
                        f"{m['measured_bytes'] / 2**20:.2f} / "
                        f"{m['estimated_bytes'] / 2**20:.2f} MiB "
                        f"({_pct(m['error'])}; needed {m['transient_fraction_needed']:.2f})"
                        for m in case["modes"].values()
                    ],
                ]
                for case in payload["validation"]
            ],
        ),
        "",
        "Cells: measured / estimated (estimate's error; transient needed). Error range: "
        f"{_pct(payload['error_range'][0])} to {_pct(payload['error_range'][1])}.",
        "",
        "## Activation density: the model as a function of tokens, width and batch",
        "",
        "Saved bytes per (row x token x channel x block): activations ~ density x rows x "
        "(image + text tokens) x width x blocks. Without checkpointing the density is "
        "near-constant across widths, token counts and rows, so the count scales linearly "
        "in each; with checkpointing what stays is the blocks' inputs (the last column; "
        "plus one block recomputed at a time).",
        "",
        markdown_table(
            [
                "family",
                "scaled-down CPU cases (width)",
                "recipe (512 px)",
                "1024 px, 1 sample",
                "checkpointing, 512 px",
            ],
            [
                [
                    r["recipe"]["label"],
                    ", ".join(
                        f"{c['bytes_per_row_token_channel_block']:.1f} ({c['width']})"
                        for c in payload["validation"]
                        if c["family"] == r["recipe"]["family"]
                    ),
                    *[f"{v:.1f}" for v in r["bytes_per_row_token_channel_block"].values()],
                ]
                for r in recipes.values()
            ],
        ),
    ]
    return "\n".join(lines)


def _component_row(r: dict[str, Any]) -> list[str]:
    gib, params = r["gib"], r["parameters"]
    encoders = ", ".join(
        f"{name} {count / 1e9:.2f} B" for name, count in params["text_encoders"].items()
    )
    return [
        r["recipe"]["label"],
        f"{_gib(gib['transformer'])} ({params['transformer'] / 1e9:.2f} B)",
        _gib(gib[f"transformer_fsdp{FSDP_GPUS}"]),
        f"{_gib(gib['text_encoders'])} ({encoders})",
        f"{gib['vae']:.2f}",
        f"{params['lora'] / 1e6:.1f} M",
        _gib(gib["lora_state"]),
        _gib(gib["stack"]),
        f"{_gib(gib['activations'])} / {_gib(gib['activations_checkpointed'])}",
        _gib(gib["transient"]),
        f"{_gib(gib['row_captures'])} / {_gib(gib['row_captures_checkpointed'])}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="one scaled-down case per family")
    parser.add_argument("--out", type=Path, help="default benchmarks/results")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    started = time.perf_counter()
    load_start = list(os.getloadavg())
    cases = CASES[:1] if args.quick else CASES
    validation = [validate(recipe, case) for recipe in RECIPES.values() for case in cases]
    recipes = {
        name: recipe_payload(estimate(recipe), high_resolution_trace(recipe))
        for name, recipe in RECIPES.items()
    }
    errors = [m["error"] for case in validation for m in case["modes"].values()]
    payload = {
        "benchmark": "memory_estimate",
        "machine": {**machine_info(), "loadavg_1_5_15_start": load_start},
        "gpus": {gpu.label: gpu.total_mib for gpu in GPUS},
        "assumptions": {
            "transient_block_fraction": TRANSIENT_BLOCK_FRACTION,
            "runtime_reserve_gib": RUNTIME_RESERVE_GIB,
            "lora_copies": LORA_COPIES,
            "stack_copies": STACK_COPIES,
        },
        "recipes": recipes,
        "validation": validation,
        "meta_minus_cpu_largest": max(abs(c["meta_minus_cpu"]) for c in validation),
        "error_range": [min(errors), max(errors)],
        "seconds": time.perf_counter() - started,
    }
    json_path, md_path = write_results("memory_estimate", payload, render(payload), args.out)
    print(f"wrote {json_path} and {md_path} in {payload['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
