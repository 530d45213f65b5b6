"""A run's settings: the typed sections, YAML reading, device parsing.

A leaf room: it imports nothing else of the package, so every part may read it. The
loader that assembles and validates a whole config is ``mogradient_diffusion.training_config``.
"""
