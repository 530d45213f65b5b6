"""Rewards as services: the ``remote`` reward (a client of four wire protocols), the
restricted unpickler the pickle protocols need, and ``serve-reward``'s server (``server.py``,
imported on its own: it needs the ``serve`` extra)."""

from .client import PROTOCOLS, RemoteReward, RewardServiceError
from .safe_pickle import UnsafePickleError, safe_loads

__all__ = ["PROTOCOLS", "RemoteReward", "RewardServiceError", "UnsafePickleError", "safe_loads"]
