"""Guards that keep non-finite or diverged weights out of the optimizer and the checkpoints."""

from __future__ import annotations

import torch

from mogradient_diffusion.model.embeddings import PromptEmbeddings
from mogradient_diffusion.model.policy import Policy


class NonFiniteError(RuntimeError):
    """Training produced non-finite values it cannot skip; nothing of them was saved."""


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every entry of every tensor is finite (one device sync)."""
    return bool(torch.stack([t.detach().isfinite().all() for t in tensors]).all())


class DivergenceProbe:
    """Weights can be finite yet diverged (a huge learning rate or LoRA alpha): one
    velocity per adapter on a fixed input tells, before they are checkpointed.

    The input (seeded noise, the first training prompt) is built at the first check.
    """

    def __init__(
        self, policy: Policy, prompt: str, resolution: int, max_sequence_length: int
    ) -> None:
        self.policy = policy
        self.prompt = prompt
        self.resolution = resolution
        self.max_sequence_length = max_sequence_length
        self._input: tuple[torch.Tensor, PromptEmbeddings] | None = None

    def outputs_finite(self, device: torch.device) -> bool:
        """Whether both adapters give finite velocities on the probe's input."""
        if self._input is None:
            shape = self.policy.latent_shape(self.resolution)
            noise = torch.randn(1, *shape, generator=torch.Generator().manual_seed(0))
            embeds = self.policy.encode_prompts(
                [self.prompt], max_sequence_length=self.max_sequence_length
            )
            self._input = (noise.to(device), embeds)
        noise, embeds = self._input
        with torch.no_grad():
            outputs = [self.policy.velocity(noise, 1.0, embeds, a) for a in ("default", "old")]
        return all_finite(outputs)
