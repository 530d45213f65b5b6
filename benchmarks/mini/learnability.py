"""Can each training reward of the miniature be learned? Measurements at the base model.

A group-relative RL method (DiffusionNFT here) learns only from reward differences
*within* a prompt's group of images. A reward that scores every image of a group alike
(all 0 on a weak base model, say) gives that group no signal, however many steps run.

``base`` mode samples the shared recipe's groups (``config.yaml``: images per prompt,
sampler, steps) from the base model for prompts of every source and reports per reward,
over the samples it applies to: the mean, the share of samples scoring > 0, the
zero-std group ratio, and the within-group vs between-group standard deviation.

``specialist`` mode trains, per reward, a single-reward specialist and a control trained
on a pure-noise reward (``mini_noise``, same prompts and applicability, same seed, so the
same first prompts and noise) with the shared recipe, then evaluates base, specialist and
control on the held-out prompts the reward applies to with the same evaluation seed, so
the comparison is paired image by image. Learning shows as specialist > control; drift
(any training moves every reward a little) shows in the control. Finished steps in
``--out``/work are reused. ``acceptance`` mode repeats that check over ``--seeds``
training seeds and gives each reward the verdict of the issue's acceptance test.

    python -m benchmarks.mini.learnability base --out benchmarks/results/mini
    python -m benchmarks.mini.learnability specialist --rewards mini_count
    python -m benchmarks.mini.learnability acceptance --seeds 3 --workers 2
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import random
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from benchmarks.mini.benchmark import EVAL_STEPS, NOISE, own_prompts_override, scored_by
from miniature.pretrain import MAX_SEQUENCE_LENGTH
from miniature.recipe import BASE_MODEL, CONFIG, TRAIN_REWARDS, write_prompt_files
from miniature.world import MiniPrompt, split_prompts
from mogradient_diffusion.runs import metric_keys as keys

HELD_OUT_OF = {  # the held-out metrics each training reward stands in for
    "mini_count": ("mini_count_strict",),
    "mini_binding": ("mini_binding_strict",),
    "mini_amount": ("mini_count", "mini_count_strict"),
    "mini_layout": ("mini_binding", "mini_binding_strict"),
    "mini_style": ("mini_alignment",),
    "mini_sign": ("mini_ocr", "mini_ocr_strict"),  # legibility stands in for reading
    "mini_ocr": ("mini_ocr_strict",),
    "ocr": ("mini_ocr_strict",),
}
ZERO_STD = 1e-6
# The acceptance test: a specialist must gain this share of the headroom (1 - base) on
# held-out prompts, and beat its noise control by this many pooled seed std.
ACCEPT_HEADROOM_SHARE = 0.2
ACCEPT_SEED_STDS = 2.0


def machine() -> str:
    """CPU model and core count, for the report."""
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores, torch {torch.__version__}"


def recipe(config: Path = CONFIG) -> dict[str, Any]:
    """The shared recipe's rollout section and reward list."""
    return yaml.safe_load(config.read_text())


def group_statistics(scores: np.ndarray) -> dict[str, float]:
    """Statistics of [groups, images] scores of one reward (NaN rows: not applicable)."""
    scores = scores[~np.isnan(scores).any(axis=1)]
    if not len(scores):
        return {"groups": 0}
    within = scores.std(axis=1)
    return {
        "groups": len(scores),
        "images": int(scores.size),
        "mean": float(scores.mean()),
        "share_positive": float((scores > 0).mean()),
        "zero_std_group_ratio": float((within < ZERO_STD).mean()),
        "within_group_std": float(np.sqrt((within**2).mean())),
        "between_group_std": float(scores.mean(axis=1).std()),
    }


def base_prompts(per_source: int, seed: int) -> list[MiniPrompt]:
    """``per_source`` training prompts of each source (the prompts RL trains on)."""
    train, _ = split_prompts(seed=0)
    rng = random.Random(seed)
    return [
        p for prompts in train.values() for p in rng.sample(prompts, min(per_source, len(prompts)))
    ]


def measure_base(
    model: Path, rewards: list[str], per_source: int, seed: int, config: Path = CONFIG
) -> dict[str, Any]:
    """Sample the recipe's groups at the base model and score them with every reward."""
    import miniature  # noqa: F401  (registers the miniature's rewards)
    from mogradient_diffusion.model.policy import LoraSpec, Policy
    from mogradient_diffusion.rewards.registry import make_reward
    from mogradient_diffusion.sampling.rollout import rollout

    settings = recipe(config)["rollout"]
    prompts = base_prompts(per_source, seed)
    group = settings["images_per_prompt"]
    started = time.perf_counter()
    policy = Policy.load(model, LoraSpec(rank=4, alpha=4))
    batch = rollout(
        policy,
        [p.text for p in prompts],
        images_per_prompt=group,
        steps=settings["steps"],
        resolution=settings["resolution"],
        sampler=settings["sampler"],
        guidance_scale=settings["guidance_scale"],
        generator=torch.Generator().manual_seed(seed),
        adapter="default",
        batch_size=64,
        max_sequence_length=settings["max_sequence_length"],
    )
    sampling = time.perf_counter() - started
    texts = [p.text for p in prompts for _ in range(group)]
    metadata = [p.metadata for p in prompts for _ in range(group)]
    report: dict[str, Any] = {
        "prompts": len(prompts),
        "images_per_prompt": group,
        "sampling_seconds": round(sampling, 1),
        "rewards": {},
    }
    for name in rewards:
        started = time.perf_counter()
        scores = make_reward(name)(batch.images, texts, metadata).numpy().reshape(-1, group)
        stats = group_statistics(scores)
        stats["seconds"] = round(time.perf_counter() - started, 1)
        report["rewards"][name] = stats
    return report


# --- specialist vs noise control ------------------------------------------------------------


def _run(command: list[str], log: Path) -> float:
    """Run a CLI child with one thread; returns seconds; raises with the log tail on failure."""
    env = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if code != 0:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command[:4])} failed ({log}):\n{tail}")
    return time.perf_counter() - started


def applicable_held_out(reward: str) -> list[MiniPrompt]:
    """The held-out prompts ``reward`` scores (NaN elsewhere)."""
    _, held_out = split_prompts(seed=0)
    return scored_by(reward, [p for source in held_out.values() for p in source])


def specialist_overrides(reward: str, control: bool = False) -> list[str]:
    """Train ``reward``'s specialist on the prompts it scores or, with ``control``, its
    pure-noise control (``mini_noise`` where ``reward`` applies) on the same prompts."""
    trained = NOISE if control else reward
    rewards = (
        f"{{name: {NOISE}, options: {{like: {reward}}}}}" if control else f"{{name: {reward}}}"
    )
    return [
        f"rewards=[{rewards}]",
        "strategy.name=single",
        f"strategy.reward={trained}",
        own_prompts_override(reward),
    ]


def specialist_check(
    reward: str,
    work: Path,
    model: Path,
    epochs: int,
    seed: int,
    eval_images: int,
    overrides: tuple[str, ...] = (),
    base_work: Path | None = None,
    base_lock: threading.Lock | None = None,
) -> dict[str, Any]:
    """Train ``reward``'s specialist and its noise control (both on the prompts ``reward``
    scores, with the recipe's ``overrides``), evaluate both and the base.

    The base evaluation does not depend on the training seed: checks that share
    ``base_work`` (default ``work``) evaluate it once (concurrent checks share
    ``base_lock`` too).
    """
    prompts_dir = write_prompt_files(work / "prompts")
    held_out = applicable_held_out(reward)
    eval_file = work / f"heldout_{reward}.jsonl"
    eval_file.write_text(
        "".join(json.dumps({"prompt": p.text, **p.metadata}) + "\n" for p in held_out)
    )
    metrics = [reward, *HELD_OUT_OF.get(reward, ())]
    cli = [sys.executable, "-m", "mogradient_diffusion.cli"]
    runs = {"specialist": reward, "control": NOISE}  # each run's trained reward
    result: dict[str, Any] = {"reward": reward, "held_out_prompts": len(held_out), "seconds": {}}
    rows: dict[str, np.ndarray] = {}

    def _train_and_evaluate(label: str) -> None:
        run_dir = ((base_work or work) if label == "base" else work) / reward / label
        run_dir.mkdir(parents=True, exist_ok=True)
        if (run_dir / "eval" / "summary.json").is_file():  # finished earlier: reuse
            rows[label] = _per_prompt_scores(run_dir / "eval", metrics)
            if label in runs:
                result[f"{label}_curve"] = _curve(run_dir / "run", runs[label])
            return
        if label in runs and not (run_dir / "run" / "lora").is_dir():  # else: trained earlier
            command = [
                *cli, "train", "--config", str(CONFIG), f"model.path={model}",
                f"prompts.directory={prompts_dir}", f"run.directory={run_dir / 'run'}",
                f"run.seed={seed}", f"train.epochs={epochs}",
                *specialist_overrides(reward, control=label == "control"), *overrides,
            ]  # fmt: skip
            result["seconds"][f"train_{label}"] = round(_run(command, run_dir / "train.log"), 1)
        if label in runs:
            result[f"{label}_curve"] = _curve(run_dir / "run", runs[label])
        command = [
            *cli, "eval", "--model", str(model), "--prompts", str(eval_file),
            "--metrics", ",".join(metrics), "--reward-module", "miniature",
            "--out", str(run_dir / "eval"), "--steps", str(EVAL_STEPS), "--seed", "1000",
            "--images-per-prompt", str(eval_images), "--batch-size", "16", "--device", "cpu",
            "--max-sequence-length", str(MAX_SEQUENCE_LENGTH), "--label", label, "--quiet",
        ]  # fmt: skip
        if label in runs:
            command += ["--lora", str(run_dir / "run" / "lora")]
        result["seconds"][f"eval_{label}"] = round(_run(command, run_dir / "eval.log"), 1)
        rows[label] = _per_prompt_scores(run_dir / "eval", metrics)

    for label in ("base", *runs):
        with base_lock if label == "base" and base_lock else contextlib.nullcontext():
            _train_and_evaluate(label)
    result["metrics"] = {}
    for k, metric in enumerate(metrics):
        seen = ~np.isnan(rows["base"][:, k])  # the prompts this metric applies to
        base, special, control = (rows[label][seen, k] for label in ("base", *runs))
        diff = special - control  # paired per prompt
        headroom = 1.0 - base.mean()
        result["metrics"][metric] = {
            "prompts": int(seen.sum()),
            "base": float(base.mean()),
            "specialist": float(special.mean()),
            "control": float(control.mean()),
            "specialist_minus_control": float(diff.mean()),
            "paired_standard_error": float(diff.std(ddof=1) / math.sqrt(len(diff))),
            "gain_over_base_share_of_headroom": float(
                (special.mean() - base.mean()) / headroom if headroom > 0 else 0.0
            ),
        }
    return result


def _per_prompt_scores(eval_dir: Path, metrics: list[str]) -> np.ndarray:
    """[prompts, metrics] mean score per prompt from an eval's per-sample rows (NaN: n/a)."""
    rows = [json.loads(line) for line in (eval_dir / "samples.jsonl").read_text().splitlines()]
    by_prompt: dict[str, list[list[float]]] = {}
    for row in rows:
        values = [math.nan if row.get(m) is None else float(row[m]) for m in metrics]
        by_prompt.setdefault(row["prompt"], []).append(values)
    means = []
    for _, values in sorted(by_prompt.items()):
        scores = np.array(values)
        seen = ~np.isnan(scores)
        total = np.where(seen, scores, 0.0).sum(axis=0)
        means.append(np.where(seen.any(axis=0), total / np.maximum(seen.sum(axis=0), 1), math.nan))
    return np.array(means)


def _curve(run_dir: Path, reward: str) -> list[float]:
    """The trained reward's mean per epoch on the training rollouts (``metrics.jsonl``)."""
    key = keys.reward_mean(reward)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [round(float(r[key]), 4) for r in map(json.loads, lines) if key in r]


def acceptance(per_seed: list[dict[str, Any]], metric: str) -> dict[str, Any]:
    """The acceptance verdict for ``metric`` from one specialist check per seed.

    Gain: the specialist's held-out mean minus the base's, as a share of the headroom
    1 - base (mean over seeds). Separation: specialist minus control (mean over seeds) in
    units of the pooled seed std sqrt((s_specialist^2 + s_control^2) / 2).
    """
    rows = [check["metrics"][metric] for check in per_seed]
    specialist = np.array([row["specialist"] for row in rows])
    control = np.array([row["control"] for row in rows])
    base = rows[0]["base"]  # the base evaluation does not depend on the training seed
    headroom = 1.0 - base
    gain_share = float((specialist.mean() - base) / headroom) if headroom > 0 else 0.0
    difference = float(specialist.mean() - control.mean())
    pooled = (
        math.sqrt((specialist.var(ddof=1) + control.var(ddof=1)) / 2) if len(rows) > 1 else math.nan
    )
    separation = difference / pooled if pooled > 0 else math.nan
    return {
        "seeds": len(rows),
        "base": base,
        "specialist": specialist.tolist(),
        "control": control.tolist(),
        "gain_share_of_headroom": gain_share,
        "specialist_minus_control": difference,
        "pooled_seed_std": pooled,
        "separation_in_seed_std": separation,
        "passed": bool(
            gain_share >= ACCEPT_HEADROOM_SHARE
            and math.isfinite(separation)
            and separation >= ACCEPT_SEED_STDS
        ),
    }


def verdict_with_context(per_seed: list[dict[str, Any]], reward: str) -> dict[str, Any]:
    """``acceptance`` on the trained reward, with the same comparison on its held-out
    metrics (not part of the verdict) and each seed's training curve."""
    verdict = acceptance(per_seed, reward)
    verdict["held_out"] = {
        metric: acceptance(per_seed, metric)
        for metric in per_seed[0]["metrics"]
        if metric != reward
    }
    verdict["curves"] = [check.get("specialist_curve", []) for check in per_seed]
    return verdict


# --- report -----------------------------------------------------------------------------------


def markdown(report: dict[str, Any]) -> str:
    """The learnability tables of a report (base statistics, then specialist checks)."""
    lines = [
        "# Learnability of the miniature's rewards",
        "",
        f"Machine: {report['machine']}. Written by `python -m benchmarks.mini.learnability`.",
        "",
    ]
    for key, part in report.get("base", {}).items():
        lines += [
            f"## At the base model: {key}",
            "",
            f"{part['prompts']} training prompts x {part['images_per_prompt']} images "
            f"(the recipe's groups); sampling took {part['sampling_seconds']} s. Targets for "
            "the specialist rewards: > 0 on 25-75% of samples, zero-std groups < 30%.",
            "",
            "| reward | groups | mean | share > 0 | zero-std groups | within-group std "
            "| between-group std |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, s in part["rewards"].items():
            if not s.get("groups"):
                lines.append(f"| {name} | 0 | | | | | |")
                continue
            lines.append(
                f"| {name} | {s['groups']} | {s['mean']:.3f} | {s['share_positive']:.0%} "
                f"| {s['zero_std_group_ratio']:.0%} | {s['within_group_std']:.3f} "
                f"| {s['between_group_std']:.3f} |"
            )
        lines.append("")
    checks = report.get("specialist", {})
    if checks:
        lines += [
            "## Specialist vs pure-noise control (1 seed, paired on held-out prompts)",
            "",
            "| reward | metric | base | specialist | control | specialist - control "
            "(paired s.e.) | gain / headroom |",
            "|---|---|---|---|---|---|---|",
        ]
        for reward, check in checks.items():
            for metric, m in check["metrics"].items():
                lines.append(
                    f"| {reward} | {metric} | {m['base']:.3f} | {m['specialist']:.3f} "
                    f"| {m['control']:.3f} | {m['specialist_minus_control']:+.3f} "
                    f"({m['paired_standard_error']:.3f}) "
                    f"| {m['gain_over_base_share_of_headroom']:+.0%} |"
                )
        lines += [
            "",
            "Specialist's own training reward on its rollouts (the curve, mean of 10 epochs):",
            "",
            "| run | epochs | first 10 | last 10 | per epoch |",
            "|---|---|---|---|---|",
        ]
        for reward, check in checks.items():
            curve = check.get("specialist_curve", [])
            if len(curve) >= 10:
                lines.append(
                    f"| {reward} | {len(curve)} | {np.mean(curve[:10]):.3f} "
                    f"| {np.mean(curve[-10:]):.3f} | {' '.join(f'{v:.2f}' for v in curve)} |"
                )
        lines.append("")
    verdicts = report.get("acceptance", {})
    if verdicts:
        lines += [
            f"## Acceptance test ({verdicts['seeds']} seeds, {verdicts['epochs']} epochs, "
            f"overrides {verdicts['overrides'] or 'none'})",
            "",
            f"Passes when the specialist gains >= {ACCEPT_HEADROOM_SHARE:.0%} of the headroom "
            f"(1 - base) on held-out prompts and beats its noise control by >= "
            f"{ACCEPT_SEED_STDS:g} pooled seed std.",
            "",
            "| reward | base | specialist (per seed) | control (per seed) | gain / headroom "
            "| specialist - control | in seed std | passed |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for reward, v in verdicts["rewards"].items():
            lines.append(
                f"| {reward} | {v['base']:.3f} | {' '.join(f'{x:.3f}' for x in v['specialist'])} "
                f"| {' '.join(f'{x:.3f}' for x in v['control'])} "
                f"| {v['gain_share_of_headroom']:+.0%} | {v['specialist_minus_control']:+.3f} "
                f"| {v['separation_in_seed_std']:+.1f} | {'yes' if v['passed'] else 'no'} |"
            )
        lines += ["", "The same comparison on the held-out metrics each reward stands in for "
                  "(no part of the verdict), and the specialists' training curves (their reward "
                  "on their own rollouts, mean over seeds of each 10 epochs):", ""]  # fmt: skip
        for reward, v in verdicts["rewards"].items():
            for metric, h in v.get("held_out", {}).items():
                lines.append(
                    f"- {reward} -> {metric}: base {h['base']:.3f}, specialist "
                    f"{' '.join(f'{x:.3f}' for x in h['specialist'])}, control "
                    f"{' '.join(f'{x:.3f}' for x in h['control'])} "
                    f"({h['gain_share_of_headroom']:+.0%} of the headroom)"
                )
            curves = [c for c in v.get("curves", []) if c]
            if curves:
                length = min(len(c) for c in curves)
                mean = np.mean([c[:length] for c in curves], axis=0)
                tens = [float(np.mean(mean[i : i + 10])) for i in range(0, length, 10)]
                lines.append(f"- {reward} curve: " + " -> ".join(f"{t:.3f}" for t in tens))
        lines.append("")
    for note in report.get("notes", []):
        lines.append(note)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("base", "specialist", "acceptance"))
    parser.add_argument("--model", type=Path, default=BASE_MODEL)
    parser.add_argument("--out", type=Path, default=Path("results/learnability"))
    parser.add_argument("--label", default="shipped", help="key of this measurement")
    parser.add_argument("--rewards", default=",".join(TRAIN_REWARDS))
    parser.add_argument("--prompts-per-source", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--eval-images", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=3, help="acceptance: seeds 0 .. n-1")
    parser.add_argument(
        "--workers", type=int, default=1, help="acceptance: checks run at once (one core each)"
    )
    parser.add_argument(
        "--override", action="append", default=[], help="recipe key=value for both runs"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rewards = args.rewards.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "learnability.json"
    report = json.loads(path.read_text()) if path.is_file() else {}
    report["machine"] = machine()
    started = time.perf_counter()
    if args.mode == "base":
        part = measure_base(args.model, rewards, args.prompts_per_source, args.seed)
        part["seconds"] = round(time.perf_counter() - started, 1)
        report.setdefault("base", {})[args.label] = part
    elif args.mode == "acceptance":
        verdicts = {"seeds": args.seeds, "epochs": args.epochs, "overrides": args.override}
        base_locks = {reward: threading.Lock() for reward in rewards}

        def check(reward: str, seed: int) -> dict[str, Any]:
            return specialist_check(
                reward,
                args.out / "work" / f"acceptance_s{seed}",
                args.model,
                args.epochs,
                seed,
                args.eval_images,
                tuple(args.override),
                base_work=args.out / "work",
                base_lock=base_locks[reward],
            )

        with ThreadPoolExecutor(args.workers) as pool:
            futures = {
                reward: [pool.submit(check, reward, seed) for seed in range(args.seeds)]
                for reward in rewards
            }
            verdicts["rewards"] = {
                reward: verdict_with_context([f.result() for f in per_seed], reward)
                for reward, per_seed in futures.items()
            }
        earlier = report.get("acceptance", {})
        if all(earlier.get(key) == verdicts[key] for key in ("seeds", "epochs", "overrides")):
            verdicts["rewards"] = earlier.get("rewards", {}) | verdicts["rewards"]  # same recipe
        report["acceptance"] = verdicts
    else:
        for reward in rewards:
            work = args.out / "work"
            check = specialist_check(
                reward, work, args.model, args.epochs, args.seed, args.eval_images,
                tuple(args.override),
            )  # fmt: skip
            check["epochs"] = args.epochs
            check["overrides"] = args.override
            check["eval_images_per_prompt"] = args.eval_images
            report.setdefault("specialist", {})[reward] = check
            path.write_text(json.dumps(report, indent=1) + "\n")
    path.write_text(json.dumps(report, indent=1) + "\n")
    (args.out / "learnability.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
