"""Text conditioning as the rollout and the objectives carry it: rows that follow the images.

Every family has token embeddings [B, L, D]. SD3 and FLUX add pooled embeddings [B, P];
Qwen-Image adds a token mask [B, L] instead (its prompts keep their own lengths).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PromptEmbeddings:
    """Token embeddings [B, L, D], optional pooled embeddings [B, P] and token mask [B, L]."""

    prompt_embeds: torch.Tensor
    pooled: torch.Tensor | None = None
    mask: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.prompt_embeds.ndim != 3:
            raise ValueError(
                f"expected prompt_embeds [B, L, D], got {tuple(self.prompt_embeds.shape)}"
            )
        rows, length = self.prompt_embeds.shape[:2]
        if self.pooled is not None and (self.pooled.ndim != 2 or len(self.pooled) != rows):
            raise ValueError(
                f"pooled must be [B, P] with B = {rows} prompt rows, got {tuple(self.pooled.shape)}"
            )
        if self.mask is not None and tuple(self.mask.shape) != (rows, length):
            raise ValueError(
                f"mask must be [B, L] = {(rows, length)}, got {tuple(self.mask.shape)}"
            )

    def __len__(self) -> int:
        return len(self.prompt_embeds)

    def _map(self, function) -> PromptEmbeddings:
        return PromptEmbeddings(
            function(self.prompt_embeds),
            None if self.pooled is None else function(self.pooled),
            None if self.mask is None else function(self.mask),
        )

    def index(self, rows: torch.Tensor | slice | Sequence[int]) -> PromptEmbeddings:
        """Select rows (a slice, an index list or tensor, or a boolean mask)."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, device=self.prompt_embeds.device)
        return self._map(lambda tensor: tensor[rows])

    def repeat_interleave(self, n: int) -> PromptEmbeddings:
        """Each row ``n`` times in a row: per-prompt embeddings to per-image embeddings."""
        return self._map(lambda tensor: tensor.repeat_interleave(n, dim=0))

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        """Move, and cast the embeddings (the mask keeps its dtype)."""
        return PromptEmbeddings(
            self.prompt_embeds.to(device=device, dtype=dtype),
            None if self.pooled is None else self.pooled.to(device=device, dtype=dtype),
            None if self.mask is None else self.mask.to(device=device),
        )

    @staticmethod
    def cat(parts: Sequence[PromptEmbeddings]) -> PromptEmbeddings:
        """Stack along the batch (e.g. unconditional and conditional rows for CFG).

        Masked parts of different lengths are padded at the end, masked out.
        """
        kinds = {(p.pooled is None, p.mask is None) for p in parts}
        if len(kinds) != 1:
            raise ValueError("cannot stack embeddings with and without pooled rows or masks")
        lengths = [p.prompt_embeds.shape[1] for p in parts]
        if parts[0].mask is None and len(set(lengths)) > 1:
            raise ValueError("embeddings of different lengths need masks to be stacked")
        pads = [max(lengths) - length for length in lengths]
        embeds = [F.pad(p.prompt_embeds, (0, 0, 0, n)) for p, n in zip(parts, pads, strict=True)]
        masks = None
        if parts[0].mask is not None:
            masks = torch.cat([F.pad(p.mask, (0, n)) for p, n in zip(parts, pads, strict=True)])
        pooled = None if parts[0].pooled is None else torch.cat([p.pooled for p in parts])
        return PromptEmbeddings(torch.cat(embeds), pooled, masks)


__all__ = ["PromptEmbeddings"]
