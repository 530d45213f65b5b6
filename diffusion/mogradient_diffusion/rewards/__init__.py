"""Rewards: a validated interface, a registry by name, and the rewards that run offline.

Importing the package registers the built-in rewards: offline ones (``ocr``,
``jpeg_compressibility``, ``jpeg_incompressibility``, ``color_match``, ``count_match``)
model-based ones that load local weights (``pick_score``, ``clip_score``, ``hps_v21``,
``aesthetic``, ``image_reward``, ``geneval``, ``geneval_strict``), ``unified_reward``,
a client of a VLM served over HTTP, and ``remote``, a client of any reward server
(``remote/``); user rewards register with ``@register_reward``.
The old spellings ``pickscore``, ``clipscore`` and ``hpsv21`` still name theirs.
"""

from .aesthetic import Aesthetic
from .base import Reward, RewardError, to_uint8_images
from .clip_similarity import ClipScore, HpsV21, PickScore
from .color import ColorMatch, classify_pixels, colors_in_prompt
from .count import CountMatch, count_in_prompt, count_objects
from .geneval import GenEval, GenEvalStrict
from .image_reward import ImageReward
from .jpeg import JpegCompressibility, JpegIncompressibility, jpeg_kilobytes
from .local_weights import MissingWeightsError
from .ocr import OcrReward, levenshtein, normalize_text, quoted_text, text_match_score
from .registry import REWARDS, make_reward, register_reward
from .remote import RemoteReward, RewardServiceError
from .reward_set import RewardScores, RewardSet
from .unified_reward import UnifiedReward

__all__ = [
    "REWARDS",
    "Aesthetic",
    "ClipScore",
    "ColorMatch",
    "CountMatch",
    "GenEval",
    "GenEvalStrict",
    "HpsV21",
    "ImageReward",
    "JpegCompressibility",
    "JpegIncompressibility",
    "MissingWeightsError",
    "OcrReward",
    "PickScore",
    "RemoteReward",
    "Reward",
    "RewardError",
    "RewardScores",
    "RewardServiceError",
    "RewardSet",
    "UnifiedReward",
    "classify_pixels",
    "colors_in_prompt",
    "count_in_prompt",
    "count_objects",
    "jpeg_kilobytes",
    "levenshtein",
    "make_reward",
    "normalize_text",
    "quoted_text",
    "register_reward",
    "text_match_score",
    "to_uint8_images",
]
