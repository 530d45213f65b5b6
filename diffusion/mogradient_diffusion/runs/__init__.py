"""A run's directory: atomic checkpoints, resume rules, the lock, the metrics log and its plots."""
