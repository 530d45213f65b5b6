"""Sampling SD3's flow from noise to data: schedules, ODE and SDE steps, the chunked CFG sampler."""
