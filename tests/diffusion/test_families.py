"""Model families: detection from a saved pipeline, the model.family setting, and the
embeddings every family's conditioning travels in."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mogradient_diffusion.cli import main
from mogradient_diffusion.config.settings import ConfigError
from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.families import (
    FAMILIES,
    detect_family,
    family_named,
    family_of_pipeline_class,
)
from mogradient_diffusion.model.pipeline_files import pipeline_family
from mogradient_diffusion.model.policy import LoraSpec, Policy
from mogradient_diffusion.training_config import load_config


def test_a_saved_pipeline_names_its_family(tiny_pipeline_dir: Path) -> None:
    assert detect_family(tiny_pipeline_dir).name == "sd3"
    assert family_of_pipeline_class("StableDiffusion3Pipeline") is FAMILIES["sd3"]


def test_unknown_families_are_refused_with_the_choices(tiny_pipeline_dir, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"unknown model family 'sdxl'; choose one of: .*sd3"):
        family_named("sdxl")
    with pytest.raises(ValueError, match=r"did you mean 'qwen_image'"):
        family_named("qwenimage")
    other = tmp_path / "other"
    shutil.copytree(tiny_pipeline_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanPipeline"}))
    with pytest.raises(ValueError, match="no model family trains a WanPipeline"):
        Policy.load(other, LoraSpec(rank=2, alpha=2.0))


def test_training_an_unsupported_pipeline_is_a_config_error_before_it_loads(
    tiny_pipeline_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The family is read from model_index.json first: the LoRA targets the run records
    depend on it, so an unknown class is one line, exit 2, and no run is written."""
    other = tmp_path / "other"
    shutil.copytree(tiny_pipeline_dir, other)
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "WanPipeline"}))
    run = tmp_path / "run"
    arguments = ["train", "--preset", "tiny", f"model.path={other}", f"run.directory={run}"]
    assert main([*arguments, "run.quiet=true"]) == 2
    error = capsys.readouterr().err
    assert "no model family trains a WanPipeline" in error and "Traceback" not in error
    assert not (run / "config.yaml").exists() and not (run / "checkpoints").exists()


def test_a_hub_id_that_cannot_be_fetched_is_one_clear_error(monkeypatch) -> None:
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(FileNotFoundError, match="could not be loaded as a hub model"):
        pipeline_family("someone/no-such-pipeline")


def test_the_family_can_be_named_instead_of_detected(tiny_pipeline_dir: Path) -> None:
    policy = Policy.load(tiny_pipeline_dir, LoraSpec(rank=2, alpha=2.0), family="sd3")
    assert policy.family is FAMILIES["sd3"]
    sigmas = policy.sigmas(4, 64)
    assert sigmas[0] == 1 and sigmas[-1] == 0 and len(sigmas) == 5


def test_guidance_is_refused_where_the_model_has_none(tiny_pipeline_dir: Path) -> None:
    with pytest.raises(ValueError, match="sd3 models have no embedded guidance"):
        Policy.load(tiny_pipeline_dir, LoraSpec(rank=2, alpha=2.0), guidance=3.5)
    with pytest.raises(ConfigError, match=r"model\.guidance must be > 0"):
        load_config(preset="tiny", overrides=["model.guidance=0"])


def test_model_family_is_checked_before_any_model_loads() -> None:
    assert load_config(preset="tiny").model.family == "auto"
    with pytest.raises(ConfigError, match=r"model.family must be one of \['auto', 'sd3'"):
        load_config(preset="tiny", overrides=["model.family=flux2"])


def test_masked_embeddings_of_different_lengths_stack_padded() -> None:
    short = PromptEmbeddings(torch.ones(1, 2, 3), mask=torch.ones(1, 2, dtype=torch.long))
    long = PromptEmbeddings(torch.full((2, 4, 3), 2.0), mask=torch.ones(2, 4, dtype=torch.long))
    both = PromptEmbeddings.cat([short, long])
    assert both.prompt_embeds.shape == (3, 4, 3)
    assert torch.equal(both.mask[0], torch.tensor([1, 1, 0, 0]))
    assert torch.equal(both.prompt_embeds[0, 2:], torch.zeros(2, 3))
    assert torch.equal(both.prompt_embeds[1:], long.prompt_embeds)
    assert both.pooled is None
    assert torch.equal(both.repeat_interleave(2).index([5]).mask, both.mask[[2]])
    with pytest.raises(ValueError, match="need masks"):
        unmasked = [PromptEmbeddings(torch.ones(1, n, 3)) for n in (2, 3)]
        PromptEmbeddings.cat(unmasked)
    with pytest.raises(ValueError, match="with and without"):
        PromptEmbeddings.cat([short, PromptEmbeddings(torch.ones(1, 2, 3))])
    with pytest.raises(ValueError, match=r"mask must be \[B, L\]"):
        PromptEmbeddings(torch.ones(1, 2, 3), mask=torch.ones(1, 3))


def test_a_non_sd3_family_without_a_model_path_is_a_config_error(tmp_path: Path, capsys) -> None:
    from mogradient_diffusion.cli import main

    arguments = ["train", "--preset", "tiny", f"run.directory={tmp_path / 'run'}"]
    assert main([*arguments, "model.family=flux"]) == 2
    assert "model.family=flux needs model.path" in capsys.readouterr().err
