"""Issue 39, items 8-10: a config file without a model path trains the tiny model with
the tiny preset under it, quietly under ``run.quiet``; a misspelt harmonizer option is a
config error; the tiny model's evaluations say nothing of truncation; a run's base model is
evaluated with the run's settings, so ``compare`` takes the pair; ``compare`` prints plain
text and does not rank its reference; the top-level help is plain text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from mogradient_diffusion.cli import main, plain_help
from mogradient_diffusion.training_config import ConfigError, load_config

from .conftest import train_arguments
from .test_compare_composite import _entry, _summary


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


# ---------------------------------------------------------------- item 8: the tiny preset


def test_a_config_file_without_a_model_path_has_the_tiny_preset_under_it(tmp_path: Path):
    recipe = tmp_path / "my.yaml"
    recipe.write_text("rewards:\n  - name: jpeg_incompressibility\ntrain:\n  epochs: 1\n")
    config = load_config(recipe, default_preset="tiny")
    assert config.rollout.resolution == 64 and config.lora.rank == 4  # the preset's
    assert [reward.name for reward in config.rewards] == ["jpeg_incompressibility"]  # the file's
    assert config.train.epochs == 1


def test_a_model_path_in_the_file_or_the_overrides_keeps_the_full_size_defaults(
    tmp_path: Path, tiny_pipeline_dir: Path
):
    recipe = tmp_path / "my.yaml"
    rewards = "rewards:\n  - name: jpeg_incompressibility\n"
    recipe.write_text(f"model:\n  path: {tiny_pipeline_dir}\nrollout:\n  resolution: 64\n{rewards}")
    assert load_config(recipe, default_preset="tiny").lora.rank == 32
    override = [f"model.path={tiny_pipeline_dir}", "rollout.resolution=64"]
    bare = tmp_path / "bare.yaml"
    bare.write_text(rewards)
    assert load_config(bare, override, default_preset="tiny").lora.rank == 32


def test_train_with_a_file_and_no_model_path_trains_the_tiny_model_quietly(tmp_path: Path, capsys):
    """The help's promise (item 8), and run.quiet silences the libraries' loading bars
    (item 10a), their settings restored afterwards."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    recipe = tmp_path / "my.yaml"
    recipe.write_text("train:\n  epochs: 1\nrun:\n  quiet: true\n")
    run = tmp_path / "run"
    verbosity = diffusers_logging.get_verbosity()
    assert main(["train", "--config", str(recipe), f"run.directory={run}"]) == 0
    captured = capsys.readouterr()
    assert "Loading" not in captured.err and "pos_embed_max_size" not in captured.err
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["rollout"]["resolution"] == 64 and saved["lora"]["rank"] == 4
    assert diffusers_logging.get_verbosity() == verbosity
    assert diffusers_logging.is_progress_bar_enabled()
    assert transformers_logging.is_progress_bar_enabled()


# ------------------------------------------------------ item 9: harmonizer options


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("cc=0.4", "strategy.options.cc: harmonizer 'cagrad' (CAGrad) has no option 'cc' "
         "(did you mean 'c'?); its options: c, rescale"),
        ("zz=1", "has no option 'zz'; its options: c, rescale"),
    ],
)  # fmt: skip
def test_a_misspelt_harmonizer_option_is_a_config_error(option: str, expected: str):
    with pytest.raises(ConfigError) as error:
        load_config(preset="tiny", overrides=["strategy.name=cagrad", f"strategy.options.{option}"])
    assert expected in str(error.value)


def test_train_refuses_a_misspelt_harmonizer_option_before_the_model_loads(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
):
    overrides = ("strategy.name=cagrad", "strategy.options.cc=0.4")
    assert main(train_arguments(tmp_path, tiny_pipeline_dir, *overrides)) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("mogradient-diffusion: configuration error: strategy.options.cc")
    assert "did you mean 'c'?" in line


# ------------------------------------------- item 10 (b, c): evaluating a run and its base


def _eval(out: Path, *source: str) -> int:
    return main(
        ["eval", *source, "--prompts", "general", "--metrics", "jpeg_incompressibility",
         "--max-prompts", "2", "--quiet", "--out", str(out)]
    )  # fmt: skip


def test_a_runs_base_model_is_evaluated_with_the_runs_settings_and_compares(
    trained_run: Path, tiny_pipeline_dir: Path, tmp_path: Path, capsys
):
    assert _eval(tmp_path / "tuned", "--lora", str(trained_run / "lora")) == 0
    assert _eval(tmp_path / "base", "--model", str(trained_run)) == 0
    captured = capsys.readouterr()
    assert "cut short" not in captured.err  # the tiny tokenizer spells words out: no note
    summaries = [json.loads((tmp_path / n / "summary.json").read_text()) for n in ("base", "tuned")]
    base, tuned = (summary["settings"] for summary in summaries)
    assert base["steps"] == tuned["steps"] == 4 and base["max_sequence_length"] == 32
    assert base["model"] == str(tiny_pipeline_dir) and base["lora"] is None
    assert all(summary["truncated_prompts"] == 0 for summary in summaries)
    assert main(["compare", str(tmp_path / "base"), str(tmp_path / "tuned")]) == 0


def test_truncation_is_still_noted_when_a_prompts_words_overrun_the_limit(
    tiny_pipeline_dir: Path, tmp_path: Path, capsys
):
    arguments = ("--model", str(tiny_pipeline_dir), "--steps", "1", "--resolution", "64")
    assert _eval(tmp_path / "out", *arguments, "--max-sequence-length", "4") == 0
    note = [line for line in capsys.readouterr().err.splitlines() if "cut short" in line]
    assert len(note) == 1 and "2 of 2 prompts" in note[0]


# ------------------------------------------------------------- item 10 (d): compare


def test_compare_prints_plain_text_and_does_not_rank_the_reference(tmp_path: Path, capsys):
    rows = [
        _summary(tmp_path / "base", {"jpeg": _entry(3.0)}),
        _summary(tmp_path / "one", {"jpeg": _entry(2.0)}),
        _summary(tmp_path / "two", {"jpeg": _entry(2.5)}),
    ]
    table_md = tmp_path / "table.md"
    assert main(["compare", *map(str, rows), "--out", str(table_md)]) == 0
    printed = capsys.readouterr().out
    assert "<u>" not in printed and "**" not in printed and "|" not in printed
    lines = {line.split()[0]: line for line in printed.splitlines() if line.strip()}
    assert lines["base"].split()[1:] == ["3.000", "0.000"]  # the reference: not ranked
    assert "2.500† (1)" in lines["two"] and "2.000† (2)" in lines["one"]
    markdown = table_md.read_text()
    assert "| base | 3.000 | 0.000 |" in markdown and "**2.500†**" in markdown
    assert "<u>2.000†</u>" in markdown
    table_txt = tmp_path / "table.txt"
    assert main(["compare", *map(str, rows), "--out", str(table_txt)]) == 0
    assert table_txt.read_text() == capsys.readouterr().out


# ------------------------------------------------------------- item 10 (e): help


def test_the_top_level_help_is_plain_text(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":func:" not in text
    assert "mogradient-diffusion train|plot|eval|compare|convert-*|serve-reward: the" in text
    roles = "see :func:`~mogradient.step.apply`, :class:`Foo`, :doc:`the guide <x/y>`, ``a b``"
    assert plain_help(roles) == "see apply, Foo, the guide, a b"
