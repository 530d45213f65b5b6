"""MARBLE in miniature, the experiments: the head-to-head (``benchmark``, ``report``), the
learnability checks and the gradient-noise probe. The world, its rewards and the base model
they run on stay in the installed package, ``miniature``."""
