"""A tiny Stable Diffusion 3 pipeline built offline, saved in the layout the real one has.

Model hubs are unreachable here, so tests and the ``tiny`` preset exercise the real
loading code (``StableDiffusion3Pipeline.from_pretrained``) on a pipeline this module
builds from configs: random weights, tokenizers trained on a word list (any other text
still tokenizes, character by character). Dimension rules that SD3 imposes: T5's width
equals ``joint_attention_dim``; the two CLIP hidden sizes sum to at most that width;
the two CLIP projection sizes sum to ``pooled_projection_dim``.
"""

from __future__ import annotations

import itertools
import json
import string
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

DEFAULT_WORDS = tuple(
    (
        "a an the of on in with and to at is are photo image picture painting drawing "
        "one two three four five six seven eight nine ten "
        "red green blue yellow orange purple pink brown black white gray "
        "cat dog bird car tree house sign flower apple ball cup book chair boat sun moon "
        "circle square triangle star heart shape shapes "
        "left right above below top bottom next near behind front "
        "saying says written text word letters reads "
        "big small large tiny bright dark sky sea grass city street room table "
        "hello world open stop love cafe mogradient"
    ).split()
)
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 256


@dataclass(frozen=True)
class TinySD3Spec:
    """Sizes of the tiny pipeline; defaults give ~0.1M transformer parameters at 64 px."""

    resolution: int = 64
    latent_channels: int = 4
    transformer_layers: int = 2
    heads: int = 2
    head_dim: int = 8
    clip_hidden: int = 16
    t5_width: int = 32
    vae_width: int = 8
    vae_blocks: int = 4  # 2 ** (vae_blocks - 1) pixels per latent: 8 like SD3's VAE
    clip_max_length: int = CLIP_MAX_LENGTH  # CLIP tokens per prompt (SD3 pads to this)
    seed: int = 0

    @property
    def latent_size(self) -> int:
        return self.resolution // 2 ** (self.vae_blocks - 1)

    # Latent pixels per transformer patch, as SD3's.
    patch_size = 2

    @property
    def positions(self) -> int:
        """Patches per side the position embedding covers: the largest grid it takes."""
        return max(self.latent_size, 16)


def build_tiny_pipeline(spec: TinySD3Spec = TinySD3Spec(), words: tuple[str, ...] = ()):
    """Return a randomly initialised ``StableDiffusion3Pipeline`` of the given sizes."""
    from diffusers import (
        FlowMatchEulerDiscreteScheduler,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModelWithProjection

    vocabulary = _vocabulary(words)
    torch.manual_seed(spec.seed)
    clip_tokenizer = _clip_tokenizer(vocabulary, spec.clip_max_length)
    t5_tokenizer = _t5_tokenizer(vocabulary)
    clip_config = _clip_text_config(
        clip_tokenizer, spec.clip_hidden, spec.clip_max_length, projection_dim=spec.t5_width // 2
    )
    text_encoder = CLIPTextModelWithProjection(clip_config)
    text_encoder_2 = CLIPTextModelWithProjection(clip_config)
    text_encoder_3 = _t5_encoder(t5_tokenizer, spec.t5_width)
    transformer = SD3Transformer2DModel(
        sample_size=spec.latent_size,
        patch_size=spec.patch_size,
        in_channels=spec.latent_channels,
        out_channels=spec.latent_channels,
        num_layers=spec.transformer_layers,
        attention_head_dim=spec.head_dim,
        num_attention_heads=spec.heads,
        joint_attention_dim=spec.t5_width,
        caption_projection_dim=spec.heads * spec.head_dim,
        pooled_projection_dim=spec.t5_width,
        pos_embed_max_size=spec.positions,
        dual_attention_layers=(0,),
        qk_norm="rms_norm",
    )
    vae = _tiny_vae(
        spec.latent_channels, spec.vae_width, spec.vae_blocks, scaling=1.5305, shift=0.0609
    )
    return StableDiffusion3Pipeline(
        transformer=transformer,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=clip_tokenizer,
        text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )


def save_tiny_pipeline(
    directory: str | Path, spec: TinySD3Spec = TinySD3Spec(), words: tuple[str, ...] = ()
) -> Path:
    """Build a tiny pipeline and ``save_pretrained`` it (safetensors) to ``directory``."""
    directory = Path(directory)
    build_tiny_pipeline(spec, words).save_pretrained(directory)
    return directory


def _vocabulary(words: tuple[str, ...]) -> tuple[str, ...]:
    """The tokenizers' known words: the defaults, then ``words`` (lower-cased), once each."""
    return tuple(dict.fromkeys(DEFAULT_WORDS + tuple(w.lower() for w in words)))


def _clip_text_config(tokenizer, hidden: int, max_length: int, projection_dim: int):
    """A one-layer CLIP text tower's config over ``tokenizer``'s vocabulary (SD3's, FLUX's)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=max_length,
        projection_dim=projection_dim,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def _tiny_vae(latent_channels: int, width: int, blocks: int, scaling: float, shift: float):
    """An ``AutoencoderKL`` halving the image ``blocks - 1`` times, with the family's latent
    scaling and shift (SD3's and FLUX's VAE share the architecture, not the constants)."""
    from diffusers import AutoencoderKL

    return AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=["DownEncoderBlock2D"] * blocks,
        up_block_types=["UpDecoderBlock2D"] * blocks,
        block_out_channels=[width] * blocks,
        layers_per_block=1,
        latent_channels=latent_channels,
        norm_num_groups=min(4, width),
        use_quant_conv=False,
        use_post_quant_conv=False,
        scaling_factor=scaling,
        shift_factor=shift,
    )


def _t5_encoder(tokenizer, width: int):
    """A one-layer T5 encoder of ``width`` over ``tokenizer``'s vocabulary (SD3's and FLUX's)."""
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(
        T5Config(
            vocab_size=len(tokenizer.get_vocab()),
            d_model=width,
            d_kv=width // 4,
            d_ff=2 * width,
            num_layers=1,
            num_heads=4,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            decoder_start_token_id=tokenizer.pad_token_id,
        )
    )


def _clip_tokenizer(vocabulary: tuple[str, ...], max_length: int = CLIP_MAX_LENGTH):
    """Byte-pair tokenizer: single characters plus merges that make each known word one token.

    BPE applies the lowest-ranked merge present first, so merges written for one word can
    split another (an early ``e n</w>`` turns green into ``g re e n</w>``). Each word is
    therefore first segmented with the merges so far, and its leftover parts are joined by
    new merges ranked after them: the earlier words' segmentations stay as they were.
    """
    from transformers import CLIPTokenizer

    symbols = string.ascii_lowercase + string.digits + string.punctuation
    vocab: dict[str, int] = {}
    for char in symbols:
        vocab.setdefault(char, len(vocab))
        vocab.setdefault(char + "</w>", len(vocab))
    ranks: dict[tuple[str, str], int] = {}
    for word in vocabulary:
        parts = _bpe([*word[:-1], word[-1] + "</w>"], ranks)
        while len(parts) > 1:
            ranks.setdefault((parts[0], parts[1]), len(ranks))
            parts = [parts[0] + parts[1], *parts[2:]]
            vocab.setdefault(parts[0], len(vocab))
    merges = [f"{a} {b}" for (a, b), _ in sorted(ranks.items(), key=lambda item: item[1])]
    for special in ("<|startoftext|>", "<|endoftext|>"):
        vocab[special] = len(vocab)
    with TemporaryDirectory() as folder:
        vocab_file, merges_file = Path(folder) / "vocab.json", Path(folder) / "merges.txt"
        vocab_file.write_text(json.dumps(vocab))
        merges_file.write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
        return CLIPTokenizer(str(vocab_file), str(merges_file), model_max_length=max_length)


def _bpe(parts: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's byte-pair loop: join every occurrence of the lowest-ranked known pair, repeat."""
    while len(parts) > 1:
        pair = min(itertools.pairwise(parts), key=lambda p: ranks.get(p, len(ranks)))
        if pair not in ranks:
            return parts
        joined: list[str] = []
        for part in parts:
            if joined and (joined[-1], part) == pair:
                joined[-1] += part
            else:
                joined.append(part)
        parts = joined
    return parts


def _t5_tokenizer(vocabulary: tuple[str, ...]):
    """Unigram tokenizer over whole known words, with single characters as fallback."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [("\u2581" + word, -1.0) for word in vocabulary]
    symbols = string.ascii_lowercase + string.ascii_uppercase + string.digits + string.punctuation
    pieces += [(char, -5.0) for char in symbols]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=T5_MAX_LENGTH)
