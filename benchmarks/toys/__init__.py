"""Toy multi-objective problems, every harmonizer run on them, and their plots."""
