"""Hypothesis profiles: derandomized by default (CI), many random examples under `make fuzz`.

Property tests set no ``max_examples`` of their own, so the profile decides. ``ci``
(the default) replays the same examples on every machine; ``fuzz`` explores with fresh
randomness. A counterexample fuzzing finds is pinned with ``@example`` next to its test.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, max_examples=50, deadline=None)
settings.register_profile(
    "fuzz",
    max_examples=int(os.environ.get("FUZZ_EXAMPLES", "4000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
