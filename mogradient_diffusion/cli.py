"""``mogradient-diffusion train|plot``: the command-line entry point.

Configuration problems are reported as one line naming the key and the fix, before any
model loads; no traceback for user errors.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from mogradient_diffusion.config import ConfigError, load_config


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mogradient-diffusion", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a LoRA with DiffusionNFT + a strategy")
    train.add_argument("--config", type=Path, help="YAML recipe (see configs/)")
    train.add_argument(
        "--preset", choices=["tiny"], help="built-in preset (default without a model path: tiny)"
    )
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    plot = commands.add_parser("plot", help="plot a run's curves and diagnostics")
    plot.add_argument("run_dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "plot":
        return _plot(args.run_dir)
    return _train(args.config, args.preset, args.overrides)


def _train(config_path: Path | None, preset: str | None, overrides: list[str]) -> int:
    from mogradient_diffusion.distributed import World

    world_size = World.size_from_environment()
    if preset is None and config_path is None:
        preset = "tiny"
    try:
        config = load_config(config_path, overrides, preset=preset, world_size=world_size)
    except ConfigError as error:
        print(f"mogradient-diffusion: configuration error: {error}", file=sys.stderr)
        return 2
    from mogradient_diffusion.trainer import Trainer

    world = World.from_environment(config.model.device)
    try:
        run_dir = Trainer(config, world).run()
    except (ConfigError, FileNotFoundError) as error:
        print(f"mogradient-diffusion: {error}", file=sys.stderr)
        return 2
    finally:
        world.close()
    if world.is_main:
        print(f"run finished: {run_dir} (metrics.jsonl, tensorboard/, lora/, lora_ema/)")
    return 0


def _plot(run_dir: Path) -> int:
    from mogradient_diffusion.plots import plot_run

    if not (run_dir / "metrics.jsonl").exists():
        print(
            f"mogradient-diffusion: {run_dir} has no metrics.jsonl; is it a run directory?",
            file=sys.stderr,
        )
        return 2
    for path in plot_run(run_dir):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
