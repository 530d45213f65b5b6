"""Scalarization tests, one file per module of mogradient/scalarizations/."""
