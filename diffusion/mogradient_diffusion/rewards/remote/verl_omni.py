"""VeRL-Omni's HTTP scorer protocol: one sample per request, pickled both ways.

The request is ``pickle.dumps({"images": [JPEG bytes], "prompts": [text], "metadata":
{...}})`` POSTed to the URL as given; VeRL-Omni sends ``{}`` as metadata, this client the
sample's own metadata (``{}`` without), which servers that do not read it ignore. The
answer is a pickled ``{"scores": [score]}``, or ``{"error": text}`` (with 200 or a 5xx),
which is a failure, never a score. Answers are read with the restricted unpickler.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np

from ..base import Metadata
from .flow_grpo import PICKLE_PROTOCOL
from .images import jpeg_bytes
from .protocol import BadResponse, PickleProtocol, one_line, scores_from


class VerlOmni(PickleProtocol):
    """VeRL-Omni's ``http_scorer_client`` protocol: one image per request."""

    name = "verl_omni"
    images_per_request = 1

    def encode(self, images: np.ndarray, prompts: list[str], metadata: Metadata | None) -> bytes:
        body = {
            "images": [jpeg_bytes(images[0])],
            "prompts": [prompts[0]],
            "metadata": {} if metadata is None else dict(metadata[0]),
        }
        return pickle.dumps(body, protocol=PICKLE_PROTOCOL)

    def decode(self, body: bytes, source: str) -> Sequence[float | None]:
        answer = self.load(body, source)
        if "error" in answer:
            raise BadResponse(f"the server reported an error: {one_line(str(answer['error']))}")
        if "scores" not in answer:
            raise BadResponse(f"the answer has no 'scores' (its keys: {sorted(map(str, answer))})")
        return scores_from(answer["scores"], "the answer's 'scores'")
