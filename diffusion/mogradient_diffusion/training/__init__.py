"""The training loop and its parts: strategies, advantages, gradient engines, collectives."""
