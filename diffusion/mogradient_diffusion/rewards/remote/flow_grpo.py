"""Flow-GRPO's reward-server protocol: pickle over HTTP POST, as its DeQA and GenEval
servers (yifan123/reward-server) and the services built like them speak it.

The request is ``pickle.dumps`` of ``{"images": [JPEG bytes], "prompts": [...],
"meta_datas": [...], "only_strict": bool}``, POSTed to the URL as given (the reference
servers listen on ``/``). Each server reads only the keys it knows: DeQA the images,
GenEval the images, ``meta_datas`` (sent when the batch has metadata) and ``only_strict``.
The answer is a pickled dict; the scores are under ``score_key``: by default ``outputs``
(DeQA, UnifiedReward) when present, else ``scores`` (GenEval's partial credit, what
Flow-GRPO trains on; GenEval's other keys are ignored). It is read with the restricted
unpickler: an answer naming any global but plain data is refused. An error is answered
as the traceback's text with HTTP 500.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

import numpy as np

from ..base import Metadata
from .images import jpeg_bytes
from .protocol import BadResponse, PickleProtocol, scores_from

# Protocol 4 is what Python 3.8-3.13 write by default: servers in their own, older
# environments (reward-server's conda env) read it.
PICKLE_PROTOCOL = 4


class FlowGrpo(PickleProtocol):
    """Flow-GRPO's pickle protocol; 64 images per request by default, as its client."""

    name = "flow_grpo"
    default_batch_size = 64

    def __init__(self, score_key: str | None = None, only_strict: bool = True):
        if score_key is not None and not (isinstance(score_key, str) and score_key):
            raise ValueError(
                f"score_key must be the name of the answer's score list, got {score_key!r}"
            )
        if not isinstance(only_strict, bool):
            raise ValueError(f"only_strict must be true or false, got {only_strict!r}")
        self.score_key = score_key
        self.only_strict = only_strict

    def encode(self, images: np.ndarray, prompts: list[str], metadata: Metadata | None) -> bytes:
        body = {
            "images": [jpeg_bytes(image) for image in images],
            "prompts": prompts,
            "only_strict": self.only_strict,
        }
        if metadata is not None:
            body["meta_datas"] = [dict(item) for item in metadata]
        return pickle.dumps(body, protocol=PICKLE_PROTOCOL)

    def decode(self, body: bytes, source: str) -> Sequence[float | None]:
        answer = self.load(body, source)
        key = self.score_key or ("outputs" if "outputs" in answer else "scores")
        if key not in answer:
            keys = sorted(map(str, answer))
            raise BadResponse(f"the answer has no {key!r} (its keys: {keys}); set score_key")
        return scores_from(answer[key], f"the answer's {key!r}")
