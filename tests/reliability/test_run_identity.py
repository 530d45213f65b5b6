"""A run is where its files are and what its files say: a moved run resumes in place,
refusals point at the settings the run last ran with, changed prompt files and damaged
run configs are refused in one line, and asking for fewer epochs writes nothing."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mogradient_diffusion.cli import main
from mogradient_diffusion.runs.metrics_log import read_metrics

from .conftest import train_arguments


def _error_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in lines[0], lines
    return lines[0]


def _files(run_dir: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(run_dir)): p.read_bytes()
        for p in sorted(run_dir.rglob("*"))
        if p.is_file() and "tensorboard" not in p.parts and p.name != ".lock"
    }


def test_a_moved_run_resumes_where_it_is_now(
    trained_run: Path, tiny_pipeline_dir: Path, tmp_path: Path, capsys
) -> None:
    moved = Path(shutil.copytree(trained_run, tmp_path / "moved"))
    config = moved / "config.yaml"
    assert main(["train", "--config", str(config), "train.epochs=3", "run.quiet=true"]) == 0
    assert f"resuming the run in {moved}" in capsys.readouterr().out
    assert [record["step"] for record in read_metrics(moved)] == [0, 1, 2]
    assert (moved / "checkpoints" / "step_00000003").is_dir()
    assert len(read_metrics(trained_run)) == 2  # the old place is left alone


def test_an_explicit_run_directory_still_wins_over_the_config_files_place(
    trained_run: Path, tiny_pipeline_dir: Path, tmp_path: Path
) -> None:
    config = trained_run / "config.yaml"
    elsewhere = tmp_path / "fresh"
    arguments = ["--config", str(config), f"run.directory={elsewhere}", "train.epochs=1"]
    assert main(["train", *arguments, "run.quiet=true"]) == 0
    assert [record["step"] for record in read_metrics(elsewhere)] == [0]


def test_after_an_allowed_change_refusals_point_at_the_latest_settings(
    run_copy: Path, tiny_pipeline_dir: Path, capsys
) -> None:
    changed = train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=3", "train.grad_clip=2")
    assert main(["train", "--allow-config-change", *changed[1:]]) == 0
    capsys.readouterr()
    again = train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=4")  # grad_clip back
    assert main(again) == 2
    error = _error_line(capsys.readouterr().err)
    assert "train.grad_clip" in error and f"({run_copy / 'resume-1.yaml'};" in error
    latest = run_copy / "resume-1.yaml"
    assert main(["train", "--config", str(latest), "train.epochs=4", "run.quiet=true"]) == 0


@pytest.mark.parametrize(
    ("content", "problem"),
    [("", "is empty"), ("- 1\n- 2\n", "holds a list"), ("a: [b\n", "cannot be read")],
)
def test_a_damaged_run_config_without_checkpoints_is_one_line(
    tmp_path: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model, content, problem
) -> None:
    tmp_path.joinpath("config.yaml").write_text(content)
    assert main(train_arguments(tmp_path, tiny_pipeline_dir)) == 2
    error = _error_line(capsys.readouterr().err)
    assert problem in error and "config.yaml" in error
    assert tmp_path.joinpath("config.yaml").read_text() == content


def test_fewer_epochs_than_done_say_so_and_write_nothing(
    run_copy: Path, tiny_pipeline_dir: Path, capsys, never_load_the_model
) -> None:
    before = _files(run_copy)
    assert main(train_arguments(run_copy, tiny_pipeline_dir, "train.epochs=1")) == 0
    assert "already at epoch 2 (train.epochs=1): nothing to train" in capsys.readouterr().err
    assert _files(run_copy) == before


@pytest.fixture(scope="module")
def prompt_run(tiny_pipeline_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-epoch run (``run/``) on a prompt file of its own (``prompts/train.txt``)."""
    root = tmp_path_factory.mktemp("prompt_run")
    (root / "prompts").mkdir()
    (root / "prompts" / "train.txt").write_text(PROMPTS)
    arguments = train_arguments(root / "run", tiny_pipeline_dir, *_prompt_overrides(root))
    assert main([*arguments, "train.epochs=1"]) == 0
    return root


PROMPTS = "a red cube\na blue ball\na green cone\n"


def _prompt_overrides(root: Path) -> list[str]:
    directory = f"prompts.directory={root / 'prompts'}"
    return [directory, "prompts.sources=[{name: mine, file: train.txt}]"]


@pytest.fixture
def edit_prompts(prompt_run: Path) -> Iterator[Callable[[str], Path]]:
    """Rewrite the prompt file (restored after the test); gives a copy of the run."""
    copies: list[Path] = []

    def edit(text: str) -> Path:
        (prompt_run / "prompts" / "train.txt").write_text(text)
        copies.append(Path(shutil.copytree(prompt_run / "run", prompt_run / f"copy{len(copies)}")))
        return copies[-1]

    yield edit
    (prompt_run / "prompts" / "train.txt").write_text(PROMPTS)
    for copy in copies:
        shutil.rmtree(copy)


@pytest.mark.parametrize(
    ("new_text", "message"),
    [
        (PROMPTS + "a pink star\n", "prompt files changed"),
        (PROMPTS.replace("green", "yellow"), "text of prompt source(s) ['mine'] changed"),
    ],
    ids=["grew", "edited"],
)
def test_changed_prompt_files_are_refused_in_one_line(
    prompt_run: Path, tiny_pipeline_dir: Path, edit_prompts, capsys, new_text, message
) -> None:
    run = edit_prompts(new_text)
    arguments = train_arguments(run, tiny_pipeline_dir, *_prompt_overrides(prompt_run))
    assert main([*arguments, "train.epochs=2"]) == 2
    assert message in _error_line(capsys.readouterr().err)
    assert len(read_metrics(run)) == 1


def test_edited_prompts_resume_when_the_change_is_allowed(
    prompt_run: Path, tiny_pipeline_dir: Path, edit_prompts, capsys
) -> None:
    run = edit_prompts(PROMPTS.replace("green", "yellow"))
    arguments = train_arguments(run, tiny_pipeline_dir, *_prompt_overrides(prompt_run))
    assert main(["train", "--allow-config-change", *arguments[1:], "train.epochs=2"]) == 0
    assert "prompt source 'mine' was edited" in capsys.readouterr().err
    assert len(read_metrics(run)) == 2
