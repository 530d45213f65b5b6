"""``mogradient-diffusion train|plot|eval|compare|convert-*|serve-reward``: the command line.

Configuration problems are reported as one line naming the key and the fix, before any
model loads; no traceback for user errors. Ctrl-C (exit 130), SIGTERM (exit 143) and running
out of GPU memory end in one line too, saying what was kept.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from mogradient_diffusion.training_config import ConfigError, TrainingConfig, load_config, run_home


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mogradient-diffusion", description=plain_help(__doc__))
    commands = parser.add_subparsers(dest="command", required=True)
    train = commands.add_parser(
        "train",
        help="train a LoRA with an objective (DiffusionNFT, Flow-GRPO, SDPO) and a strategy",
    )
    train.add_argument("--config", type=Path, help="YAML recipe (see configs/)")
    train.add_argument(
        "--preset",
        choices=["tiny"],
        help="built-in preset, the layer under --config (default: tiny when no model.path "
        "is set, in the file or the overrides)",
    )
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume a run with settings that differ from its saved config (besides "
        "train.epochs); the new values apply from the resumed epoch on",
    )
    train.add_argument("overrides", nargs="*", help="section.key=value overrides")
    plot = commands.add_parser(
        "plot",
        help="plot a run's curves and diagnostics into <run>/plots/, or compare runs",
        description="Read <run>/metrics.jsonl and write PNGs to <run>/plots/: rewards.png "
        "(each reward's mean per epoch, one panel per reward, band ±1 std), weights.png "
        "(the harmonizer's weight shares per optimizer step, solve steps filled) and "
        "cosines.png (worst cosine between the step and a reward's gradient), the last two "
        "when the run logged them. Several runs are drawn into each figure once, a line per "
        "run labelled by its folder name (its strategy where names collide), into --out. "
        "Prints the paths written.",
    )
    plot.add_argument("run_dir", type=Path, nargs="+", help="run directories written by `train`")
    plot.add_argument("--out", type=Path, help="folder for the figures (needed for several runs)")
    _add_eval_parser(commands)
    compare = commands.add_parser(
        "compare",
        help="Table-1 style table over eval outputs",
        description="Print a table of `eval` outputs: each metric's headline number, best "
        "and second among the rows after the first marked (1) and (2), and a composite: the "
        "mean over the metrics every row has of the difference to the FIRST row (list the "
        "baseline first) in units of the metric's per-image std. A † marks a value that "
        "differs from the first row's by more than 1.96 combined standard errors. "
        "Evaluations made with different settings are refused.",
    )
    compare.add_argument(
        "eval_dirs", nargs="+", type=Path, help="eval --out folders; the first is the reference"
    )
    compare.add_argument(
        "--out",
        type=Path,
        help="also write the table to this file: markdown (best bold, second underlined) "
        "when it ends in .md, else plain text",
    )
    compare.add_argument(
        "--allow-mixed-settings",
        action="store_true",
        help="compare evaluations made with different prompts, steps, guidance, resolution, "
        "sequence length, dtype, images per prompt, seed or reward options (the table then "
        "lists the differences)",
    )
    convert = commands.add_parser(
        "convert-hps", help="open_clip checkpoint (HPS v2.1) -> transformers CLIP directory"
    )
    convert.add_argument("checkpoint", type=Path, help="e.g. HPS_v2.1_compressed.pt")
    convert.add_argument("processor_dir", type=Path, help="tokenizer + preprocessor of the CLIP")
    convert.add_argument("out_dir", type=Path)
    convert_ir = commands.add_parser(
        "convert-image-reward", help="ImageReward.pt -> transformers BLIP directory + MLP head"
    )
    convert_ir.add_argument("checkpoint", type=Path, help="ImageReward.pt")
    convert_ir.add_argument("tokenizer_dir", type=Path, help="bert-base-uncased tokenizer files")
    convert_ir.add_argument("out_dir", type=Path)
    convert_ir.add_argument("--med-config", type=Path, help="med_config.json of the release")
    _add_serve_parser(commands)
    args = parser.parse_args(argv)
    with _stop_signals(_forced_stop(args)):
        try:
            return _command(args)
        except KeyboardInterrupt as stop:  # where a command says nothing more of its own
            print(f"\nmogradient-diffusion {args.command}: {_stopped(stop)}", file=sys.stderr)
            return _exit_code(stop)


def plain_help(text: str) -> str:
    """A docstring as help text: reST roles and literals as plain words (``x`` and
    `` :func:`~a.x` `` read x, `` :doc:`text <page>` `` reads text)."""

    def role(match: re.Match) -> str:
        content = re.sub(r"\s*<[^>]*>$", "", match.group(1))
        return content[1:].rsplit(".", 1)[-1] if content.startswith("~") else content

    text = re.sub(r":[\w:.+-]+:`([^`]*)`", role, text)
    return re.sub(r"``([^`]+)``|`([^`]+)`", lambda m: m.group(1) or m.group(2), text)


def _command(args: argparse.Namespace) -> int:
    if args.command == "plot":
        return _plot(args.run_dir, args.out)
    if args.command == "eval":
        return _eval(args)
    if args.command == "compare":
        return _compare(args.eval_dirs, args.out, args.allow_mixed_settings)
    if args.command == "convert-hps":
        return _convert_hps(args.checkpoint, args.processor_dir, args.out_dir)
    if args.command == "convert-image-reward":
        return _convert_image_reward(args)
    if args.command == "serve-reward":
        return _serve_reward(args)
    return _train(args.config, args.preset, args.overrides, args.allow_config_change)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C would be, so that the same cleanup and report run."""


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _forced_stop(args: argparse.Namespace) -> str:
    """What stays safe when a second signal stops the command before its cleanup ends."""
    if args.command == "train":
        return "checkpoints are never half-written: the same command resumes from the last one"
    if args.command == "eval":
        return (
            f"an unfinished evaluation may remain in {Path(args.out) / '.eval-in-progress'} "
            "(the next eval there removes it); the evaluations that finished are whole"
        )
    return "its cleanup did not finish"


@contextmanager
def _stop_signals(forced: str) -> Iterator[None]:
    """The first Ctrl-C raises KeyboardInterrupt, the first SIGTERM ``Terminated``; a second
    one, during the cleanup the first began, ends the process at once with one line
    (``forced``: what is safe then), not a second traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread may set handlers; Python's defaults stay
        return
    received: list[int] = []

    def on_signal(number: int, frame: object) -> None:
        if received:
            name = signal.Signals(number).name
            line = f"\nmogradient-diffusion: {name} again: stopped at once; {forced}"
            print(line, file=sys.stderr, flush=True)
            os._exit(128 + number)
        received.append(number)
        raise Terminated() if number == signal.SIGTERM else KeyboardInterrupt()

    previous = {number: signal.signal(number, on_signal) for number in STOP_SIGNALS}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


@contextmanager
def quiet_libraries(quiet: bool) -> Iterator[None]:
    """Under ``run.quiet``: diffusers' and transformers' loading bars off and their logging
    down to errors, restored afterwards (``eval --quiet``: ``library_progress_bars``)."""
    if not quiet:
        yield
        return
    import diffusers.utils.logging as diffusers_logging
    import transformers.utils.logging as transformers_logging

    saved = [
        (library, library.get_verbosity(), library.is_progress_bar_enabled())
        for library in (diffusers_logging, transformers_logging)
    ]
    for library, _, _ in saved:
        library.set_verbosity_error()
        library.disable_progress_bar()
    try:
        yield
    finally:
        for library, verbosity, bars in saved:
            library.set_verbosity(verbosity)
            if bars:
                library.enable_progress_bar()


def _stopped(stop: KeyboardInterrupt) -> str:
    return "stopped by SIGTERM" if isinstance(stop, Terminated) else "interrupted"


def _exit_code(stop: KeyboardInterrupt) -> int:
    """128 + the signal, as the shell reports a process it ended: 143 SIGTERM, 130 Ctrl-C."""
    return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)


# Where `train` and `eval` run out of GPU memory (a function on the traceback, the stage)
# and what to lower there (docs/diffusion/memory.md).
Stage = tuple[str, str, str]
TRAIN_MEMORY: tuple[Stage, ...] = (
    (
        "_train_on",
        "in the training step",
        "lower train.batch_size (raise train.gradient_accumulation to keep the step's "
        "size) or set model.gradient_checkpointing=true",
    ),
    ("rollout", "while sampling", "lower rollout.batch_size (images sampled at once)"),
    (
        "load",
        "while loading the model",
        "set model.dtype=bfloat16, or shard it with model.shard=fsdp2 under torchrun",
    ),
)
TRAIN_MEMORY_ELSEWHERE = (
    "lower rollout.batch_size or train.batch_size, or set model.gradient_checkpointing=true"
)
EVAL_MEMORY: tuple[Stage, ...] = (
    (
        "generate_and_score",
        "while generating",
        "lower --batch-size (images generated at once; the results do not depend on it)",
    ),
    ("load_pipeline", "while loading the model", "use --dtype bfloat16"),
)
EVAL_MEMORY_ELSEWHERE = "lower --batch-size, or use --dtype bfloat16"


def _out_of_memory(error: BaseException, stages: Sequence[Stage], elsewhere: str) -> str:
    """``out of GPU memory <stage> (tried to allocate N GiB): <what to lower>``; the stage is
    the first of ``stages`` whose function is on the traceback."""
    names = _functions_on(error)
    where, advice = next(
        ((f" {where}", advice) for function, where, advice in stages if function in names),
        ("", elsewhere),
    )
    size = re.search(r"Tried to allocate ([\d.]+ \w+)", str(error))
    tried = "" if size is None else f" (tried to allocate {size.group(1)})"
    return f"out of GPU memory{where}{tried}: {advice}"


def _functions_on(error: BaseException) -> set[str]:
    """The names of this package's functions on ``error``'s traceback."""
    names, entry = set(), error.__traceback__
    while entry is not None:
        if entry.tb_frame.f_globals.get("__name__", "").startswith("mogradient_diffusion."):
            names.add(entry.tb_frame.f_code.co_name)
        entry = entry.tb_next
    return names


def _add_eval_parser(commands) -> None:
    from mogradient_diffusion.evaluation.evaluate import PROMPT_SETS, EvalSettings
    from mogradient_diffusion.evaluation.few_step import FEW_STEPS

    sets = ", ".join(PROMPT_SETS)
    fallback = {name: field.default for name, field in EvalSettings.__dataclass_fields__.items()}

    def from_run(key: str, otherwise: str) -> str:
        return (
            f"default: the run's {key} when --lora is in a run directory or --model names "
            f"a run, else {otherwise}"
        )

    evaluate = commands.add_parser(
        "eval",
        help="generate on a prompt set and score it",
        description="Generate images for a prompt set with fixed seeds, score them and write "
        "images/, samples.jsonl, summary.json, summary.md and grid.png to --out (a previous "
        "evaluation there is replaced). A --lora inside a run directory (<run>/lora, "
        "<run>/lora_ema) takes the model, steps, resolution, guidance, sequence length and "
        "dtype from the run's config.yaml, and so does --model <run> (or <run>/tiny_model) "
        "without --lora, for the base model as the run sampled it; a flag given here wins.",
    )
    evaluate.add_argument(
        "--model",
        help="saved diffusers pipeline directory, or a run directory for the run's base "
        "model with the run's settings (" + from_run("model.path", "required") + ")",
    )
    evaluate.add_argument(
        "--lora", help="LoRA directory written by `train` (a run's lora/ or lora_ema/); none: base"
    )
    evaluate.add_argument("--prompts", required=True, help=f"shipped set ({sets}) or a file")
    evaluate.add_argument("--metrics", required=True, help="comma-separated reward names")
    evaluate.add_argument(
        "--metric-option",
        action="append",
        default=[],
        metavar="NAME.KEY=VALUE",
        help="reward option, e.g. pickscore.path=/weights/pickscore (repeatable)",
    )
    evaluate.add_argument("--out", required=True, help="output folder")
    step_counts = evaluate.add_mutually_exclusive_group()
    step_counts.add_argument(
        "--steps",
        type=int,
        help="sampling steps (" + from_run("rollout.steps", str(fallback["steps"])) + ")",
    )
    step_counts.add_argument(
        "--steps-sweep",
        nargs="?",
        const=",".join(map(str, FEW_STEPS)),
        metavar="N,N,...",
        help="evaluate at each of these step counts instead of --steps (alone: "
        f"{','.join(map(str, FEW_STEPS))}), one folder per count and a table by count in "
        "few_steps.md/json: whether reward holds at few steps, SDPO's claim",
    )
    evaluate.add_argument(
        "--guidance-scale",
        type=float,
        help="CFG scale ("
        + from_run("rollout.guidance_scale", str(fallback["guidance_scale"]))
        + ")",
    )
    evaluate.add_argument(
        "--guidance",
        type=float,
        help="embedded guidance of models that have one, FLUX.1-dev ("
        + from_run("model.guidance", "the model's default, 3.5 for FLUX.1-dev")
        + ")",
    )
    evaluate.add_argument(
        "--resolution",
        type=int,
        help="image side in pixels (" + from_run("rollout.resolution", "the model's own") + ")",
    )
    evaluate.add_argument(
        "--max-sequence-length",
        type=int,
        help="T5 tokens per prompt ("
        + from_run("rollout.max_sequence_length", str(fallback["max_sequence_length"]))
        + ")",
    )
    evaluate.add_argument(
        "--images-per-prompt", type=int, default=fallback["images_per_prompt"], help="(default: 1)"
    )
    evaluate.add_argument("--max-prompts", type=int, help="first N prompts (default: all)")
    evaluate.add_argument(
        "--seed", type=int, default=fallback["seed"], help="image i gets seed + i (default: 0)"
    )
    evaluate.add_argument(
        "--batch-size",
        type=int,
        default=fallback["batch_size"],
        help="images generated at once; results do not depend on it (default: 8)",
    )
    evaluate.add_argument(
        "--device", default=fallback["device"], help="auto, cpu, cuda, cuda:1, ... (default: auto)"
    )
    evaluate.add_argument(
        "--dtype",
        help="float32, bfloat16 or float16 ("
        + from_run("model.dtype", str(fallback["dtype"]))
        + ")",
    )
    evaluate.add_argument("--label", help="row name in `compare` (default: the folder name)")
    evaluate.add_argument("--quiet", action="store_true", help="no progress bars")
    evaluate.add_argument(
        "--reward-module",
        action="append",
        default=[],
        help="module to import for user-registered rewards (repeatable)",
    )


# Flags whose default comes from the LoRA's run when it has one (EvalSettings field names).
RUN_FLAGS = (
    "model",
    "steps",
    "guidance_scale",
    "guidance",
    "resolution",
    "max_sequence_length",
    "dtype",
)


def _eval(args: argparse.Namespace) -> int:
    import torch

    from mogradient_diffusion.evaluation.evaluate import EvalSettings, evaluate
    from mogradient_diffusion.evaluation.few_step import evaluate_at_steps
    from mogradient_diffusion.rewards import MissingWeightsError, RewardError

    try:
        settings = EvalSettings(
            **_run_flags(args),
            lora=args.lora,
            prompts=args.prompts,
            metrics=[m.strip() for m in args.metrics.split(",") if m.strip()],
            metric_options=_metric_options(args.metric_option),
            out=args.out,
            images_per_prompt=args.images_per_prompt,
            max_prompts=args.max_prompts,
            seed=args.seed,
            batch_size=args.batch_size,
            device=args.device,
            label=args.label,
            progress=not args.quiet,
            reward_modules=args.reward_module,
        )
        if args.steps_sweep is None:
            out = evaluate(settings)  # validates before any model loads
        else:
            out = evaluate_at_steps(settings, _step_counts(args.steps_sweep))
    except (ValueError, FileNotFoundError, MissingWeightsError, RewardError) as error:
        # ConfigError (a bad --reward-module) is a ValueError too.
        print(f"mogradient-diffusion eval: {error}", file=sys.stderr)
        return 2
    except torch.cuda.OutOfMemoryError as error:
        memory = _out_of_memory(error, EVAL_MEMORY, EVAL_MEMORY_ELSEWHERE)
        print(f"mogradient-diffusion eval: {memory}; {_eval_kept(args.out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        stopped = f"{_stopped(stop)}; {_eval_kept(args.out)}"
        print(f"\nmogradient-diffusion eval: {stopped}", file=sys.stderr)
        return _exit_code(stop)
    if args.steps_sweep is None:
        print(f"evaluation written to {out} (summary.md, summary.json, samples.jsonl, grid.png)")
        return 0
    print((out / "few_steps.md").read_text(), end="")
    print(
        f"few-step table written to {out / 'few_steps.md'} and {out / 'few_steps.json'}; "
        f"one evaluation per count in {out}/steps_NN/"
    )
    return 0


def _eval_kept(out: str) -> str:
    """What a stopped evaluation leaves: it writes into a staging folder, published whole."""
    return (
        f"nothing is half-written: the unfinished evaluation was discarded, and {out} "
        "holds only evaluations that finished (if any)"
    )


def _run_flags(args: argparse.Namespace) -> dict:
    """``RUN_FLAGS`` values: a given flag, else the LoRA's run's setting (announced), else
    EvalSettings' default; ValueError when no model is named either way."""
    from mogradient_diffusion.evaluation.inputs import run_defaults

    given = {name: getattr(args, name) for name in RUN_FLAGS if getattr(args, name) is not None}
    config_path, from_run = run_defaults(args.lora, args.model)
    if args.lora is None and "model" in from_run:  # --model named a run: its base model
        given.pop("model")
    taken = {name: value for name, value in from_run.items() if name not in given}
    if args.steps_sweep is not None:  # the sweep's counts replace the run's steps
        taken.pop("steps", None)
    if taken:
        listed = ", ".join(f"{name}={value}" for name, value in taken.items())
        print(f"mogradient-diffusion eval: from {config_path}: {listed}")
    values = taken | given
    if "model" not in values:
        raise ValueError(
            "--model is required (it can be left out when --lora lies in a run directory "
            "whose config.yaml names the model)"
        )
    return values


def _step_counts(text: str) -> list[int]:
    """``"1,2,4"`` -> [1, 2, 4]; anything but distinct positive integers is refused."""
    items = [item.strip() for item in text.split(",")]
    if not all(item.isascii() and item.isdigit() and int(item) > 0 for item in items):
        raise ValueError(
            f"bad --steps-sweep {text!r}: expected comma-separated positive integers, "
            "e.g. --steps-sweep 1,2,4,8,16"
        )
    counts = [int(item) for item in items]
    if len(set(counts)) != len(counts):
        raise ValueError(f"bad --steps-sweep {text!r}: a step count is repeated")
    return counts


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser(
        "serve-reward",
        help="serve a registered reward over HTTP, for the `remote` reward (needs the serve extra)",
        description="Serve one reward (built in, or registered by --reward-module) over the "
        "`ours` protocol: POST /score, GET /health. Training runs name it as a `remote` reward "
        "with url http://HOST:PORT. One log line per request.",
    )
    serve.add_argument("--reward", required=True, help="the registered reward's name")
    serve.add_argument(
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="reward option, e.g. quality=90 (repeatable; values read as YAML scalars)",
    )
    serve.add_argument(
        "--reward-module",
        action="append",
        default=[],
        help="module to import for user-registered rewards (repeatable)",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (default: 127.0.0.1, this machine only: the server has "
        "no authentication)",
    )
    serve.add_argument("--port", type=int, default=18090, help="(default: 18090)")
    serve.add_argument(
        "--max-batch", type=int, default=16, help="images per reward call at most (default: 16)"
    )
    serve.add_argument(
        "--device", default="auto", help="auto, cpu, cuda, cuda:1, ... (default: auto)"
    )


def _serve_reward(args: argparse.Namespace) -> int:
    """Exit 2 for what the user must fix: a missing extra, a bad option, an unknown reward."""
    name = "mogradient-diffusion serve-reward"
    try:
        import uvicorn  # noqa: F401  (the server's, imported here to check the extra)

        from mogradient_diffusion.rewards.remote.server import serve
    except ModuleNotFoundError as error:
        if error.name not in ("fastapi", "uvicorn", "starlette", "pydantic"):
            raise
        print(
            f"{name}: needs FastAPI and uvicorn ({error.name} is missing): "
            "pip install 'mogradient-diffusion[serve]'",
            file=sys.stderr,
        )
        return 2
    from mogradient_diffusion.evaluation.inputs import resolve_device
    from mogradient_diffusion.rewards import MissingWeightsError, make_reward
    from mogradient_diffusion.training_config import import_reward_modules

    try:
        if args.max_batch < 1:
            raise ValueError(f"--max-batch must be >= 1, got {args.max_batch}")
        options = _reward_options(args.option)
        import_reward_modules(args.reward_module)
        reward = make_reward(args.reward, **options).to(resolve_device(args.device))
    except (ValueError, TypeError, MissingWeightsError) as error:  # ConfigError, unknown names
        print(f"{name}: {error}", file=sys.stderr)
        return 2
    serve(reward, args.host, args.port, args.max_batch)
    return 0


def _reward_options(items: list[str]) -> dict[str, object]:
    """``key=value`` strings -> {key: value}; values parsed as YAML scalars."""
    import yaml

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"bad --option {item!r}: expected KEY=VALUE, e.g. quality=90")
        try:
            options[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(f"bad --option {item!r}: {value!r} is not a YAML value") from None
    return options


def _metric_options(items: list[str]) -> dict[str, dict]:
    """``name.key=value`` strings -> {name: {key: value}}; values parsed as YAML scalars."""
    import yaml

    options: dict[str, dict] = {}
    for item in items:
        target, sep, value = item.partition("=")
        name, dot, key = target.partition(".")
        if not sep or not dot or not name or not key:
            raise ValueError(
                f"bad --metric-option {item!r}: "
                "expected NAME.KEY=VALUE, e.g. pickscore.path=/weights/pickscore"
            )
        try:
            options.setdefault(name, {})[key] = yaml.safe_load(value)
        except yaml.YAMLError:
            raise ValueError(
                f"bad --metric-option {item!r}: {value!r} is not a YAML value"
            ) from None
    return options


def _compare(eval_dirs: list[Path], out: Path | None, allow_mixed: bool) -> int:
    from mogradient_diffusion.evaluation.compare import comparison_table

    try:  # markdown for a .md file, plain text for the terminal and other files
        table = comparison_table(eval_dirs, allow_mixed_settings=allow_mixed, markdown=False)
        if out is not None:
            markdown = out.suffix.lower() in (".md", ".markdown")
            text = comparison_table(eval_dirs, allow_mixed, markdown=True) if markdown else table
            out.write_text(text)
    except (OSError, ValueError) as error:  # FileNotFoundError is an OSError
        print(f"mogradient-diffusion compare: {error}", file=sys.stderr)
        return 2
    print(table, end="")
    return 0


def _convert_hps(checkpoint: Path, processor_dir: Path, out_dir: Path) -> int:
    from mogradient_diffusion.rewards.open_clip_conversion import convert_open_clip_checkpoint

    for path in (checkpoint, processor_dir):
        if not path.exists():
            print(f"mogradient-diffusion convert-hps: {path} does not exist", file=sys.stderr)
            return 2
    try:
        out = convert_open_clip_checkpoint(checkpoint, processor_dir, out_dir)
    except ValueError as error:  # not an open_clip checkpoint: the message names the file
        print(f"mogradient-diffusion convert-hps: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


def _train(
    config_path: Path | None, preset: str | None, overrides: list[str], allow_change: bool
) -> int:
    """Exit 2 for what the user must fix (config, lock, files), 1 for a run that failed."""
    from mogradient_diffusion.training.distributed import World

    if preset is None and config_path is None:
        preset = "tiny"
    try:
        world_size = World.size_from_environment()  # torchrun's variables, checked first
        config = load_config(
            config_path, overrides, preset=preset, world_size=world_size, default_preset="tiny"
        )
    except ConfigError as error:
        print(f"mogradient-diffusion: configuration error: {error}", file=sys.stderr)
        return 2
    if config_path is not None and run_home(config_path) == Path(config.run.directory):
        _note_moved_run(config_path)
    import torch

    from mogradient_diffusion.rewards import RewardError
    from mogradient_diffusion.rewards.base import RewardTimeout
    from mogradient_diffusion.runs.checkpoint import CorruptCheckpointError
    from mogradient_diffusion.runs.lock import RunDirectoryLocked, RunLock, describe_holder
    from mogradient_diffusion.training.finite import NonFiniteError
    from mogradient_diffusion.training.trainer import RunComplete, Trainer

    world = World.from_environment(config.model.device)
    lock = RunLock(config.run.directory)
    try:
        if world.is_main:  # one process writes the directory; it holds the lock
            lock.acquire()
            if lock.previous:
                holder = describe_holder(lock.previous)
                print(f"mogradient-diffusion: taking over the lock left by {holder} (not running)")
        with quiet_libraries(config.run.quiet):
            run_dir = Trainer(config, world, allow_config_change=allow_change).run()
    except (ConfigError, FileNotFoundError, RunDirectoryLocked) as error:
        print(f"mogradient-diffusion: {error}", file=sys.stderr)
        return 2
    except RunComplete as done:
        print(f"mogradient-diffusion: {done}", file=sys.stderr)
        return 0
    except RewardError as error:
        slow = "; if it is only slow, raise rollout.reward_timeout"
        hint = slow if isinstance(error, RewardTimeout) else ""
        print(
            f"mogradient-diffusion: training stopped: {error}{hint}; {_saved(config)}",
            file=sys.stderr,
        )
        return 1
    except (NonFiniteError, CorruptCheckpointError) as error:
        print(f"mogradient-diffusion: training stopped: {error}", file=sys.stderr)
        return 1
    except torch.cuda.OutOfMemoryError as error:
        memory = _out_of_memory(error, TRAIN_MEMORY, TRAIN_MEMORY_ELSEWHERE)
        stopped = f"training stopped: {memory}; {_saved(config)}"
        print(f"mogradient-diffusion: {stopped}", file=sys.stderr)
        return 1
    except OSError as error:  # a full disk, a lost mount: say which file, and what is safe
        where = f" ({error.filename})" if error.filename else ""
        reason = error.strerror or str(error)
        print(
            f"mogradient-diffusion: training stopped: {reason}{where}; {_saved(config)}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM as Terminated
        print(f"\nmogradient-diffusion: {_stopped(stop)}; {_saved(config)}", file=sys.stderr)
        return _exit_code(stop)
    finally:
        lock.release()
        world.close()
    if world.is_main:
        print(f"run finished: {run_dir} (metrics.jsonl, tensorboard/, lora/, lora_ema/)")
    return 0


def _note_moved_run(config_path: Path) -> None:
    """Say so when a run's own config resumes it where it is now, not where it started."""
    import yaml

    recorded = (yaml.safe_load(config_path.read_text()).get("run") or {}).get("directory")
    here = config_path.parent
    if recorded is None or Path(recorded).resolve() != here.resolve():
        print(
            f"mogradient-diffusion: resuming the run in {here} ({config_path.name} records "
            f"{recorded}, where it started)"
        )


def _saved(config: TrainingConfig) -> str:
    """What an interrupted run keeps, and how to go on from it."""
    from mogradient_diffusion.runs.checkpoint import latest_checkpoint

    latest = latest_checkpoint(config.run.directory)
    if latest is None:
        return "no checkpoint was saved yet: the same command starts the run again"
    return f"the last checkpoint, {latest}, is intact: the same command resumes from it"


def _plot(run_dirs: list[Path], out: Path | None) -> int:
    from mogradient_diffusion.runs.plots import plot_runs

    for run_dir in run_dirs:
        if not (run_dir / "metrics.jsonl").is_file():
            print(
                f"mogradient-diffusion plot: {run_dir} has no metrics.jsonl; "
                "is it a run directory?",
                file=sys.stderr,
            )
            return 2
    try:
        paths = plot_runs(run_dirs, out)
    except (OSError, ValueError) as error:  # damaged metrics.jsonl, unwritable plots/
        print(f"mogradient-diffusion plot: {error}", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0


def _convert_image_reward(args: argparse.Namespace) -> int:
    from mogradient_diffusion.rewards.image_reward import convert_image_reward_checkpoint

    for path in (args.checkpoint, args.tokenizer_dir, args.med_config):
        if path is not None and not path.exists():
            print(
                f"mogradient-diffusion convert-image-reward: {path} does not exist", file=sys.stderr
            )
            return 2
    try:
        out = convert_image_reward_checkpoint(
            args.checkpoint, args.out_dir, args.tokenizer_dir, med_config=args.med_config
        )
    except ValueError as error:  # not an ImageReward checkpoint: the message names the file
        print(f"mogradient-diffusion convert-image-reward: {error}", file=sys.stderr)
        return 2
    print(out)
    return 0


def entry() -> None:
    """The program: ``main``'s exit code, and after a stop with worker threads still busy,
    the end of the process without Python's shutdown.

    Overlapped and remote scoring run on daemon threads so that a stop never waits on them.
    Python's shutdown ends such a thread where it next takes the GIL; inside torch's C++
    code that aborts the process (``terminate called without an active exception``, exit
    -6 instead of 130, seen about one stop in four). By then the command has saved what it
    keeps and said so, so the streams and log handlers are flushed and the process ends."""
    code = main()
    if code in {128 + signal.SIGINT, 128 + signal.SIGTERM} and any(
        thread.daemon and thread.is_alive() for thread in threading.enumerate()
    ):
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    raise SystemExit(code)


if __name__ == "__main__":
    entry()
