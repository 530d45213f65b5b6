"""Evaluation: fixed-seed generation scored by rewards, grids, few-step curves, comparison."""
