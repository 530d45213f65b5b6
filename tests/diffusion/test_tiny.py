"""The offline tiny SD3 pipeline goes through the real loading and sampling code."""

from __future__ import annotations

from pathlib import Path

import torch


def test_tiny_pipeline_round_trips_and_generates(tiny_pipeline_dir: Path) -> None:
    from diffusers import StableDiffusion3Pipeline

    pipeline = StableDiffusion3Pipeline.from_pretrained(tiny_pipeline_dir)
    pipeline.set_progress_bar_config(disable=True)
    images = pipeline(
        ["a red cat", 'a sign saying "hello"'],
        num_inference_steps=2,
        guidance_scale=1.0,
        height=64,
        width=64,
        output_type="pt",
        max_sequence_length=32,
        generator=torch.Generator().manual_seed(0),
    ).images
    assert images.shape == (2, 3, 64, 64)
    assert torch.isfinite(images).all() and images.min() >= 0 and images.max() <= 1
    # Unknown words still tokenize (character fallback) instead of mapping to <unk>.
    assert pipeline.tokenizer_3.unk_token_id not in pipeline.tokenizer_3("zqx").input_ids


def test_clip_tokenizer_keeps_every_known_word_whole() -> None:
    """BPE merges of one word must not split another (green was g/re/e/n</w>)."""
    from miniature.world import vocabulary
    from mogradient_diffusion.model.tiny import DEFAULT_WORDS, _clip_tokenizer

    words = tuple(dict.fromkeys(DEFAULT_WORDS + vocabulary()))
    tokenizer = _clip_tokenizer(words)
    split = {word: tokenizer.tokenize(word) for word in words}
    assert {word: parts for word, parts in split.items() if len(parts) != 1} == {}
    assert tokenizer.tokenize("zqx") == ["z", "q", "x</w>"]  # unknown text still spells out


def test_every_mini_prompt_fits_the_shipped_text_context() -> None:
    """No miniature prompt is truncated by the shipped CLIP or T5 tokenizers."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    from miniature.pretrain import MAX_SEQUENCE_LENGTH, SPEC
    from miniature.recipe import BASE_MODEL
    from miniature.world import all_prompts

    clip = CLIPTokenizer.from_pretrained(BASE_MODEL / "tokenizer")
    t5 = T5TokenizerFast.from_pretrained(BASE_MODEL / "tokenizer_3")
    assert clip.model_max_length == SPEC.clip_max_length
    for prompt in (p for prompts in all_prompts().values() for p in prompts):
        clip_ids, t5_ids = clip(prompt.text).input_ids, t5(prompt.text).input_ids
        assert len(clip_ids) <= SPEC.clip_max_length, prompt.text
        assert len(t5_ids) <= MAX_SEQUENCE_LENGTH, prompt.text
        assert clip.unk_token_id not in clip_ids[1:-1] and t5.unk_token_id not in t5_ids
        assert len(clip_ids) == len(prompt.text.replace('"', ' " ').split()) + 2, prompt.text
