"""Sampling every model family's flow: schedules, ODE and SDE steps, the chunked CFG sampler."""
