"""Shared fixtures: a tiny SD3 pipeline saved once per session in the real on-disk layout."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("diffusers", reason="the diffusion extra is not installed")

from mogradient_diffusion.model.tiny import save_tiny_pipeline


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Directory of a saved tiny pipeline, loadable with ``from_pretrained``."""
    return save_tiny_pipeline(tmp_path_factory.mktemp("tiny_sd3"))
