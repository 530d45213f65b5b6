"""MARBLE in miniature: a procedural image world, its rewards, a small SD3 trained on it.

``world`` renders scenes and writes the three prompt sources (general, text,
compositional) with GenEval-style metadata; ``vision`` finds the shapes in an image;
``rewards`` turns that (and Tesseract, and learned scorers) into the paper's reward mix.
``recipe`` is the shared training setup; the experiments on it live in ``benchmarks/mini``.
Importing the package registers the miniature's rewards.
"""

from miniature import color_rewards as color_rewards
from miniature import rewards as rewards
from miniature import scorers as scorers
