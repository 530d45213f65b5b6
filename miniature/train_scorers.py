"""Train the mini world's learned scorers from scratch (``mini/scorers.py`` defines them).

The shipped checkpoints in ``miniature/weights/`` were made with::

    python -m miniature.train_scorers --out miniature/weights

(defaults: ``--seed 0 --threads 1``; about 4.5 minutes on one CPU core). Everything is
generated on the fly from the world, deterministically given the seed and thread count:

- quality data: a render of a random prompt's scene with random degradations of known
  severity s_k in [0, 1] (``DEGRADATIONS``: Gaussian blur, pixel noise, color washout
  and contrast loss, downscale-upscale blockiness, blotches and smears, partial erasure
  of the shapes or the sign's word), the kinds of damage a small diffusion model does.
  Target quality ``q = prod_k (1 - w_k s_k)`` (clean = 1): ``PREFERENCE_WEIGHTS`` for
  ``mini_preference``, ``HELDOUT_WEIGHTS`` for ``mini_preference_heldout``, which also
  differs in seed and architecture. Loss: MSE of the sigmoid output against q.
- alignment data: batches of distinct prompts (drawn from all world prompts, train and
  held-out split alike, as CLIP's training set covers any evaluation prompt), one
  satisfying scene each, lightly degraded as augmentation; symmetric InfoNCE, where a
  prompt that is also true of another image in the batch (a position scene satisfies
  its "a ... and a ..." sibling) is masked out instead of used as a negative, plus
  one-edit hard negatives per image (``hard_negatives``).

Held-out metrics use fresh scenes from seeds that training never draws and are printed
and written to ``training_report.json`` next to the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageDraw
from torch import Tensor

from . import world
from .scorers import AlignmentNet, QualityNet, count_parameters, save_scorer
from .world import MiniPrompt, Scene

DEGRADATIONS = ("blur", "noise", "washout", "blocky", "blotches", "erasure")
PREFERENCE_WEIGHTS = {
    "blur": 0.8,
    "noise": 0.8,
    "washout": 0.6,
    "blocky": 0.7,
    "blotches": 0.6,
    "erasure": 0.7,
}
HELDOUT_WEIGHTS = {
    "blur": 0.6,
    "noise": 0.9,
    "washout": 0.8,
    "blocky": 0.5,
    "blotches": 0.8,
    "erasure": 0.5,
}
QUALITY_ARCHS: dict[str, dict[str, Any]] = {
    "mini_preference": {"widths": [16, 32, 64, 64], "first_kernel": 3, "downsample": "pool"},
    "mini_preference_heldout": {
        "widths": [12, 24, 48, 96],
        "first_kernel": 5,
        "downsample": "stride",
        "pool": "mean_max",
    },
}
DEFAULT_STEPS = {"mini_preference": 500, "mini_preference_heldout": 500, "mini_alignment": 600}
# Seed offsets: training streams use seed * 1000 + small offsets; evaluation streams use
# a disjoint range so held-out metrics are on scenes training never drew.
EVAL_OFFSET = 500


# --- rendering and degradations ------------------------------------------------------------


def to_tensor(image: Image.Image) -> Tensor:
    """PIL RGB -> [3, H, W] float in [0, 1]."""
    return torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1) / 255


def render_erased(scene: Scene, severity: float, rng: random.Random) -> Image.Image:
    """Render ``scene`` with a fraction ``severity`` of each shape (or of the word) cut away.

    The cut is a band from a random side painted in the color underneath, the way a
    generator drops part of an object; at severity 1 about 90% of each is gone.
    """
    image = world.render(scene)
    if severity <= 0:
        return image
    draw = ImageDraw.Draw(image)
    cut = 0.9 * severity
    boxes = [
        (s.x - s.size / 2 - 1, s.y - s.size / 2 - 1, s.x + s.size / 2 + 1, s.y + s.size / 2 + 1)
        for s in scene.shapes
    ]
    fills = [scene.background] * len(boxes)
    if scene.text is not None:
        boxes.append((10.0, 22.0, 54.0, 42.0))
        fills.append(world.SIGN_COLOR)
    for (x0, y0, x1, y1), fill in zip(boxes, fills, strict=True):
        side = rng.randrange(4)
        if side == 0:
            x1 = x0 + cut * (x1 - x0)
        elif side == 1:
            x0 = x1 - cut * (x1 - x0)
        elif side == 2:
            y1 = y0 + cut * (y1 - y0)
        else:
            y0 = y1 - cut * (y1 - y0)
        draw.rectangle((x0, y0, x1, y1), fill=fill)
    return image


def _gaussian_blur(image: Tensor, sigma: float) -> Tensor:
    """Separable Gaussian blur of one [3, H, W] image (reflect padding: no dark rims)."""
    radius = 6
    offsets = torch.arange(-radius, radius + 1, dtype=image.dtype)
    kernel = torch.exp(-(offsets**2) / (2 * sigma**2))
    kernel = (kernel / kernel.sum()).repeat(3, 1)
    x = F.pad(image[None], (radius, radius, radius, radius), mode="reflect")
    x = F.conv2d(x, kernel[:, None, None, :], groups=3)
    return F.conv2d(x, kernel[:, None, :, None], groups=3)[0]


def _blotches(image: Tensor, severity: float, gen: torch.Generator) -> Tensor:
    """Soft elliptical blobs; half take a color from elsewhere in the image (smears)."""
    _, h, w = image.shape
    ys, xs = torch.meshgrid(
        torch.arange(h, dtype=image.dtype), torch.arange(w, dtype=image.dtype), indexing="ij"
    )
    for _ in range(1 + round(4 * severity)):
        u = torch.rand(8, generator=gen)
        cy, cx = u[0] * h, u[1] * w
        ry = 2 + 7 * severity * (0.5 + u[2])
        rx = 2 + 7 * severity * (0.5 + u[3])
        angle = u[4] * math.pi
        dx, dy = xs - cx, ys - cy
        a = (dx * math.cos(angle) + dy * math.sin(angle)) / rx
        b = (-dx * math.sin(angle) + dy * math.cos(angle)) / ry
        alpha = (0.5 + 0.5 * severity) * torch.exp(-(a**2 + b**2))
        if u[5] < 0.5:
            color = torch.rand(3, generator=gen)
        else:
            color = image[:, int(u[6] * h) % h, int(u[7] * w) % w].clone()
        image = image * (1 - alpha) + color[:, None, None] * alpha
    return image


def _washout(image: Tensor, severity: float, gen: torch.Generator) -> Tensor:
    """Desaturate, flatten contrast and haze toward a random grey."""
    grey = (image * torch.tensor([0.299, 0.587, 0.114])[:, None, None]).sum(0, keepdim=True)
    image = image + (grey - image) * 0.8 * severity
    mean = image.mean()
    image = mean + (image - mean) * (1 - 0.7 * severity)
    haze = 0.3 + 0.5 * torch.rand((), generator=gen)
    return image + (haze - image) * 0.25 * severity


def _blocky(image: Tensor, severity: float, gen: torch.Generator) -> Tensor:
    """Downscale by up to 8x, upscale back (nearest: blocks; bilinear: mush)."""
    size = max(8, round(world.SIZE / (1 + 7 * severity)))
    if size >= image.shape[-1]:
        return image
    small = F.interpolate(image[None], size=(size, size), mode="area")
    mode = "nearest" if torch.rand((), generator=gen) < 0.5 else "bilinear"
    kwargs = {} if mode == "nearest" else {"align_corners": False}
    return F.interpolate(small, size=image.shape[-2:], mode=mode, **kwargs)[0]


def degrade(images: Tensor, severities: Tensor, gen: torch.Generator) -> Tensor:
    """Apply the pixel-level degradations (all but ``erasure``) at per-image severities.

    ``images`` [b, 3, H, W] in [0, 1]; ``severities`` [b, len(DEGRADATIONS)] in [0, 1].
    Order: blotches, washout, blur, blockiness, then noise, so noise stays visible.
    """
    k = {name: i for i, name in enumerate(DEGRADATIONS)}
    out = []
    for image, s in zip(images, severities.tolist(), strict=True):
        if s[k["blotches"]] > 0:
            image = _blotches(image, s[k["blotches"]], gen)
        if s[k["washout"]] > 0:
            image = _washout(image, s[k["washout"]], gen)
        if s[k["blur"]] > 0:
            image = _gaussian_blur(image, 2.5 * s[k["blur"]])
        if s[k["blocky"]] > 0:
            image = _blocky(image, s[k["blocky"]], gen)
        if s[k["noise"]] > 0:
            noise = torch.randn(image.shape, generator=gen)
            image = image + 0.25 * s[k["noise"]] * noise
        out.append(image.clamp(0, 1))
    return torch.stack(out)


def quality_target(severities: Tensor, weights: dict[str, float]) -> Tensor:
    """q = prod_k (1 - w_k s_k): 1 for a clean render, multiplicative in the damage."""
    w = torch.tensor([weights[name] for name in DEGRADATIONS])
    return (1 - severities * w).prod(-1)


def sample_severities(
    n: int, gen: torch.Generator, p_active: float = 0.35, p_clean: float = 0.1, high: float = 1.0
) -> Tensor:
    """Each kind is active with ``p_active`` at a uniform severity; ``p_clean`` untouched."""
    active = torch.rand(n, len(DEGRADATIONS), generator=gen) < p_active
    active &= torch.rand(n, 1, generator=gen) >= p_clean
    return torch.rand(n, len(DEGRADATIONS), generator=gen) * high * active


def make_images(
    scenes: Sequence[Scene], severities: Tensor, rng: random.Random, gen: torch.Generator
) -> Tensor:
    """Render ``scenes`` (with erasure) and apply the pixel degradations: [b, 3, 64, 64]."""
    erase = severities[:, DEGRADATIONS.index("erasure")].tolist()
    clean = torch.stack(
        [to_tensor(render_erased(scene, s, rng)) for scene, s in zip(scenes, erase, strict=True)]
    )
    return degrade(clean, severities, gen)


def flat_prompts() -> list[MiniPrompt]:
    """Every world prompt of every source: the scorers must cover any of them."""
    return [prompt for prompts in world.all_prompts().values() for prompt in prompts]


def sample_scenes(prompts: Sequence[MiniPrompt], rng: random.Random) -> list[Scene]:
    """One random scene satisfying each prompt."""
    return [world.sample_scene(prompt, rng) for prompt in prompts]


# --- prompt truth and mismatches -----------------------------------------------------------


def satisfies(scene: Scene, prompt: MiniPrompt) -> bool:
    """Whether ``prompt`` truthfully describes ``scene`` (exact objects, no extras).

    Relations count as true when their axis dominates; used to mask false negatives in
    InfoNCE and to grade retrieval, where a borderline case should not count as wrong.
    """
    meta = prompt.metadata
    if meta["tag"] == "text":
        return scene.text == meta["text"] and not scene.shapes
    if scene.text is not None:
        return False
    wanted = world.STYLES[meta["style"]] if meta["tag"] == "general" else world.PLAIN_BACKGROUND
    if scene.background != wanted:
        return False
    objects = sorted((s.shape, s.color) for s in scene.shapes)
    expected = sorted(
        (entry["class"], entry["color"]) for entry in meta["include"] for _ in range(entry["count"])
    )
    if objects != expected:
        return False
    for entry in meta["include"]:
        if "position" in entry:
            relation, target = entry["position"]
            other = meta["include"][target]
            subject = _find(scene, entry["class"], entry["color"])
            anchor = _find(scene, other["class"], other["color"])
            dx, dy = subject.x - anchor.x, subject.y - anchor.y
            holds = {
                "left of": -dx > abs(dy),
                "right of": dx > abs(dy),
                "above": -dy > abs(dx),
                "below": dy > abs(dx),
            }[relation]
            if not holds:
                return False
    return True


def _find(scene: Scene, shape: str, color: str) -> world.Shape:
    return next(s for s in scene.shapes if s.shape == shape and s.color == color)


_OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


# The kind whose color was changed, spelled as the committed weights/training_report.json
# keys its win rates.
COLOR_KIND = "colour"


def mismatched_prompts(prompt: MiniPrompt, rng: random.Random) -> dict[str, str]:
    """Prompts that differ from ``prompt`` in one respect, keyed by what was changed.

    Kinds: ``COLOR_KIND``, ``shape``, ``style``, ``count``, ``word``, ``binding`` (colors
    swapped between the two objects) and ``relation`` (the opposite relation).
    """
    meta = prompt.metadata
    colors, shapes = list(world.COLORS), list(world.SHAPES)

    def other(options: Sequence[str], *taken: str) -> str:
        return rng.choice([o for o in options if o not in taken])

    if meta["tag"] == "text":
        return {"word": f'a sign that says "{other(world.WORDS, meta["text"])}"'}
    if meta["tag"] == "general":
        entry = meta["include"][0]
        style, color, shape = meta["style"], entry["color"], entry["class"]
        return {
            COLOR_KIND: f"a {style} scene with a {other(colors, color)} {shape}",
            "shape": f"a {style} scene with a {color} {other(shapes, shape)}",
            "style": f"a {other(list(world.STYLES), style)} scene with a {color} {shape}",
        }
    if meta["tag"] == "counting":
        entry = meta["include"][0]
        count, color, shape = entry["count"], entry["color"], entry["class"]

        def counted(n: int, c: str, s: str) -> str:
            return f"{world.NUMBERS[n - 1]} {c} {s if n == 1 else s + 's'}"

        numbers = [n for n in range(1, len(world.NUMBERS) + 1) if n != count]
        return {
            "count": counted(rng.choice(numbers), color, shape),
            COLOR_KIND: counted(count, other(colors, color), shape),
            "shape": counted(count, color, other(shapes, shape)),
        }
    if meta["tag"] == "color_attr":
        first, second = meta["include"]
        a, ca, b, cb = first["class"], first["color"], second["class"], second["color"]
        return {
            COLOR_KIND: f"a {other(colors, ca, cb)} {a} and a {cb} {b}",
            "shape": f"a {ca} {other(shapes, a, b)} and a {cb} {b}",
            "binding": f"a {cb} {a} and a {ca} {b}",
        }
    anchor, subject = meta["include"]
    a, ca, b, cb = subject["class"], subject["color"], anchor["class"], anchor["color"]
    relation = subject["position"][0]
    return {
        COLOR_KIND: f"a {other(colors, ca, cb)} {a} {relation} a {cb} {b}",
        "shape": f"a {ca} {other(shapes, a, b)} {relation} a {cb} {b}",
        "relation": f"a {ca} {a} {_OPPOSITE[relation]} a {cb} {b}",
    }


# --- metrics -------------------------------------------------------------------------------


def spearman(a: Tensor, b: Tensor) -> float:
    """Spearman rank correlation (ties broken by order; targets here are continuous)."""

    def ranks(x: Tensor) -> Tensor:
        return x.argsort().argsort().double()

    ra, rb = ranks(a), ranks(b)
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def heavy_severities(n: int, gen: torch.Generator) -> Tensor:
    """One kind per image (cycling through all) at severity in [0.6, 1]: clearly damaged."""
    severities = torch.zeros(n, len(DEGRADATIONS))
    rows = torch.arange(n)
    severities[rows, rows % len(DEGRADATIONS)] = 0.6 + 0.4 * torch.rand(n, generator=gen)
    return severities


@torch.no_grad()
def evaluate_quality(model: QualityNet, seed: int, n: int = 384) -> dict[str, Any]:
    """Spearman vs both targets on randomly degraded renders; clean-vs-heavy win rates."""
    model.eval()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = rng.choices(flat_prompts(), k=n)
    scenes = sample_scenes(prompts, rng)
    severities = sample_severities(n, gen)
    predicted = torch.sigmoid(model(make_images(scenes, severities, rng, gen)))
    clean = torch.sigmoid(model(make_images(scenes, torch.zeros(n, len(DEGRADATIONS)), rng, gen)))
    heavy = heavy_severities(n, gen)
    damaged = torch.sigmoid(model(make_images(scenes, heavy, rng, gen)))
    wins = (clean > damaged).float()
    kind = heavy.argmax(1)
    return {
        "spearman_vs_preference_target": spearman(
            predicted, quality_target(severities, PREFERENCE_WEIGHTS)
        ),
        "spearman_vs_heldout_target": spearman(
            predicted, quality_target(severities, HELDOUT_WEIGHTS)
        ),
        "clean_over_heavy_win_rate": float(wins.mean()),
        "clean_over_heavy_by_kind": {
            name: float(wins[kind == i].mean()) for i, name in enumerate(DEGRADATIONS)
        },
        "mean_score_clean": float(clean.mean()),
        "mean_score_heavy": float(damaged.mean()),
        "n_images": n,
    }


@torch.no_grad()
def evaluate_alignment(model: AlignmentNet, seed: int, scenes_per_prompt: int = 2) -> dict:
    """Top-1 retrieval among all world prompts and matched-vs-mismatched win rates."""
    model.eval()
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = flat_prompts() * scenes_per_prompt
    scenes = sample_scenes(prompts, rng)
    n = len(prompts)
    report: dict[str, Any] = {"n_images": n}
    texts = model.encode_text([p.text for p in flat_prompts()])
    for label, severities in [
        ("clean", torch.zeros(n, len(DEGRADATIONS))),
        ("degraded", sample_severities(n, gen, p_active=0.3, p_clean=0.0, high=0.5)),
    ]:
        images = model.encode_images(make_images(scenes, severities, rng, gen))
        best = (images @ texts.T).argmax(1).tolist()
        top1 = [satisfies(scene, flat_prompts()[j]) for scene, j in zip(scenes, best, strict=True)]
        report[f"top1_all_prompts_{label}"] = sum(top1) / n
        wins: dict[str, list[float]] = {}
        for i, prompt in enumerate(prompts):
            mismatches = mismatched_prompts(prompt, rng)
            scores = images[i] @ model.encode_text([prompt.text, *mismatches.values()]).T
            for kind, s in zip(mismatches, scores[1:].tolist(), strict=True):
                wins.setdefault(kind, []).append(float(scores[0] > s))
        report[f"win_rate_{label}"] = sum(sum(v) for v in wins.values()) / sum(
            len(v) for v in wins.values()
        )
        report[f"win_rate_{label}_by_kind"] = {k: sum(v) / len(v) for k, v in sorted(wins.items())}
    return report


# --- training ------------------------------------------------------------------------------


def _cosine_lr(optimizer: torch.optim.Optimizer, base: float, step: int, total: int) -> None:
    warmup = min(50, total // 10 + 1)
    if step < warmup:
        lr = base * (step + 1) / warmup
    else:
        lr = base * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))
    for group in optimizer.param_groups:
        group["lr"] = lr


def train_quality(
    name: str, weights: dict[str, float], seed: int, steps: int, batch: int = 64, log=print
) -> QualityNet:
    """Regress the sigmoid output on q for fresh degraded renders every step."""
    torch.manual_seed(seed)
    model = QualityNet(**QUALITY_ARCHS[name])
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = flat_prompts()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    model.train()
    for step in range(steps):
        _cosine_lr(optimizer, 2e-3, step, steps)
        scenes = sample_scenes(rng.choices(prompts, k=batch), rng)
        severities = sample_severities(batch, gen)
        images = make_images(scenes, severities, rng, gen)
        loss = F.mse_loss(torch.sigmoid(model(images)), quality_target(severities, weights))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            log(f"[{name}] step {step:4d}  mse {loss.item():.4f}")
    return model.eval()


def hard_negatives(prompt: MiniPrompt, rng: random.Random, k: int) -> list[str]:
    """``k`` one-edit mismatches of ``prompt`` (kinds cycled), each false for its scenes.

    A random batch almost never holds the prompt with the opposite relation or the
    colors swapped (the world writes one relation per pair), so without these the
    contrastive loss never asks for binding, relations, or exact counts and words.
    """
    negatives: list[str] = []
    while len(negatives) < k:
        negatives += list(mismatched_prompts(prompt, rng).values())
    return negatives[:k]


def train_alignment(
    seed: int, steps: int, batch: int = 64, negatives: int = 3, log=print
) -> AlignmentNet:
    """Symmetric InfoNCE over batches of distinct prompts, false negatives masked.

    The image-to-text side also scores each image against ``negatives`` hard negatives
    of its own prompt (see ``hard_negatives``).
    """
    torch.manual_seed(seed)
    model = AlignmentNet(world.vocabulary())
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    prompts = flat_prompts()
    batch = min(batch, len(prompts))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=1e-4)
    model.train()
    for step in range(steps):
        _cosine_lr(optimizer, 2e-3, step, steps)
        chosen = rng.sample(prompts, batch)
        scenes = sample_scenes(chosen, rng)
        severities = sample_severities(batch, gen, p_active=0.3, p_clean=0.2, high=0.6)
        images = model.encode_images(make_images(scenes, severities, rng, gen))
        texts = model.encode_text([p.text for p in chosen])
        extra = [text for p in chosen for text in hard_negatives(p, rng, negatives)]
        extra_texts = model.encode_text(extra).view(batch, negatives, -1) if negatives else None
        also_true = torch.tensor(
            [
                [i != j and satisfies(s, p) for j, p in enumerate(chosen)]
                for i, s in enumerate(scenes)
            ]
        )
        scale = model.logit_scale.clamp(max=math.log(100)).exp()
        logits = (scale * images @ texts.T).masked_fill(also_true, -1e4)
        rows = logits
        if extra_texts is not None:
            rows = torch.cat([logits, scale * torch.einsum("bd,bkd->bk", images, extra_texts)], 1)
        target = torch.arange(batch)
        loss = 0.5 * (F.cross_entropy(rows, target) + F.cross_entropy(logits.T, target))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 0 or step == steps - 1:
            accuracy = (rows.argmax(1) == target).float().mean().item()
            log(f"[mini_alignment] step {step:4d}  loss {loss.item():.3f}  top1 {accuracy:.2f}")
    return model.eval()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="directory for the checkpoints")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=None, help=f"steps for every scorer (default {DEFAULT_STEPS})"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--eval-size", type=int, default=384, help="images per quality evaluation")
    parser.add_argument(
        "--eval-scenes", type=int, default=2, help="scenes per prompt in the alignment evaluation"
    )
    args = parser.parse_args(argv)
    steps = {name: args.steps or default for name, default in DEFAULT_STEPS.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        report = train_all(args.out, args.seed, steps, args.eval_size, args.eval_scenes)
    finally:
        torch.set_num_threads(threads)  # main() may run inside a test process
    report["command"] = "python -m miniature.train_scorers " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    report["threads"] = args.threads
    (args.out / "training_report.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out} in {report['total_seconds']:.0f}s")
    return report


def train_all(
    out: Path, seed: int, steps: dict[str, int], eval_size: int = 384, eval_scenes: int = 2
) -> dict[str, Any]:
    """Train, evaluate and save the three scorers into ``out``; returns the report."""
    report: dict[str, Any] = {
        "seed": seed,
        "steps": steps,
        "torch": torch.__version__,
        "scorers": {},
    }
    started = time.perf_counter()
    eval_seed = seed * 1000 + EVAL_OFFSET
    for offset, (name, weights) in enumerate(
        [("mini_preference", PREFERENCE_WEIGHTS), ("mini_preference_heldout", HELDOUT_WEIGHTS)]
    ):
        t0 = time.perf_counter()
        model = train_quality(name, weights, seed * 1000 + 1 + offset, steps[name])
        seconds = time.perf_counter() - t0
        metrics = evaluate_quality(model, eval_seed, eval_size)
        print(f"[{name}] {seconds:.0f}s  " + json.dumps(metrics))
        config = {
            "target": "q = prod_k (1 - w_k s_k) over DEGRADATIONS severities",
            "target_weights": weights,
            "output": "sigmoid(logit) in [0, 1]",
            "trained_by": "miniature.train_scorers",
            "seed": seed,
            "steps": steps[name],
        }
        path = save_scorer(model, out, name, config)
        report["scorers"][name] = {
            "parameters": count_parameters(model),
            "bytes": path.stat().st_size,
            "train_seconds": round(seconds, 1),
            "metrics": metrics,
        }
    t0 = time.perf_counter()
    model = train_alignment(seed * 1000 + 3, steps["mini_alignment"])
    seconds = time.perf_counter() - t0
    metrics = evaluate_alignment(model, eval_seed + 1, eval_scenes)
    print(f"[mini_alignment] {seconds:.0f}s  " + json.dumps(metrics))
    config = {
        "output": "cosine(image embedding, prompt embedding) in [-1, 1]",
        "trained_by": "miniature.train_scorers",
        "seed": seed,
        "steps": steps["mini_alignment"],
    }
    path = save_scorer(model, out, "mini_alignment", config)
    report["scorers"]["mini_alignment"] = {
        "parameters": count_parameters(model),
        "bytes": path.stat().st_size,
        "train_seconds": round(seconds, 1),
        "metrics": metrics,
    }
    report["total_seconds"] = round(time.perf_counter() - started, 1)
    return report


if __name__ == "__main__":
    main()
