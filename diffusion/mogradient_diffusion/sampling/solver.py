"""The loop from noise to data: one ODE or SDE step per noise level, recording on request.

Every sampler runs through [`integrate`][mogradient_diffusion.sampling.solver.integrate]: ``euler``
and ``dpm2`` (the deterministic steps of ``ode``) and ``sde``, Flow-GRPO's SDE step of ``sde`` on
its ``sde_steps`` and Euler elsewhere (Flow-GRPO-Fast's window: the ODE steps have no density and
are not trained). What likelihood-ratio objectives train on is recorded here: for each of the
``recorded_steps`` x_t, x_next and log p_old(x_next | x_t); optionally the predicted clean
sample x0_hat = x_t - t v at every step (SDPO's dense rewards).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from mogradient_diffusion.sampling.ode import dpm2_step, euler_step
from mogradient_diffusion.sampling.sde import gaussian_log_prob, sde_sample, sde_step_statistics

SAMPLERS = ("euler", "dpm2", "sde")
VelocityFn = Callable[[Tensor, Tensor], Tensor]


@dataclass
class Trajectories:
    """Per-sample trajectories; S recorded steps, T sampling steps.

    final: [B, C, H, W] the sampled clean latents.
    latents, next_latents: [B, S, C, H, W] x_t and x_next of each recorded step.
    log_probs: [B, S] float32 log p_old(x_next | x_t), averaged over C x H x W.
    steps: [S] schedule indices of the recorded steps (0 is the noisiest).
    predicted_x0: [B, T, C, H, W] x_t - t v at every step, or None when not asked for.
    """

    final: Tensor
    latents: Tensor
    next_latents: Tensor
    log_probs: Tensor
    steps: Tensor
    predicted_x0: Tensor | None = None


def integrate(
    velocity: VelocityFn,
    noise: Tensor,
    sigmas: Tensor,
    sampler: str = "euler",
    eta: float = 0.7,
    generator: torch.Generator | None = None,
    *,
    sde_steps: Sequence[int] | None = None,
    recorded_steps: Sequence[int] = (),
    record_x0: bool = False,
    on_step: Callable[[], object] | None = None,
) -> Trajectories:
    """Solve from x_T = ``noise`` at sigmas[0] down to sigmas[-1]; the state is kept in float32.

    ``velocity(x, sigma)`` gets the state and a [B] float32 noise level and returns v (no
    grad needed). ``sde`` takes the SDE step with noise level ``eta`` on ``sde_steps`` (all
    by default), its noise drawn from ``generator``, and Euler's elsewhere; eta = 0 is the
    Euler step. ``recorded_steps`` must be SDE steps (none: plain sampling).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    levels = sigmas.detach().float().cpu()
    values = levels.tolist()
    num_steps = len(levels) - 1
    if sde_steps is None:
        sde_steps = range(num_steps) if sampler == "sde" else ()
    elif sampler != "sde":
        raise ValueError(f"sde_steps need the sde sampler, got {sampler!r}")
    _check_steps(num_steps, sde_steps, recorded_steps, eta)
    sde_set, recorded = set(sde_steps), sorted(recorded_steps)
    x = noise.float()
    sigma_max = float(levels[1])  # stands in for t at t = 1 (0 for a single step)
    kept: dict[str, list[Tensor]] = {"latents": [], "next": [], "log_probs": []}
    x0_hats = []
    previous_x0 = None
    for i in range(num_steps):
        sigma = levels[i].expand(len(x)).to(x.device)
        sigma_next = levels[i + 1].expand(len(x)).to(x.device)
        with torch.no_grad():
            v = velocity(x, sigma).float()
        if record_x0:
            x0_hats.append(x - sigma.reshape(-1, *[1] * (x.ndim - 1)) * v)
        if i in sde_set and eta != 0:
            mean, std, _ = sde_step_statistics(x, v, sigma, sigma_next, sigma_max, eta)
            x_next = sde_sample(mean, std, generator)
        elif sampler == "dpm2":
            x_next, previous_x0 = dpm2_step(x, v, values, i, previous_x0)
        else:
            x_next = euler_step(x, v, values[i], values[i + 1])
        if i in recorded:
            kept["latents"].append(x)
            kept["next"].append(x_next)
            kept["log_probs"].append(gaussian_log_prob(x_next, mean, std))
        x = x_next
        if on_step is not None:
            on_step()
    return Trajectories(
        final=x,
        latents=_stack_steps(kept["latents"], x),
        next_latents=_stack_steps(kept["next"], x),
        log_probs=_stack_steps(kept["log_probs"], x.new_zeros(len(x))),
        steps=torch.tensor(recorded, dtype=torch.long),
        predicted_x0=torch.stack(x0_hats, dim=1) if record_x0 else None,
    )


def concatenate(parts: list[Trajectories]) -> Trajectories:
    """Trajectories of chunks of one batch (same recorded steps) as one."""

    def cat(name: str) -> Tensor | None:
        values = [getattr(part, name) for part in parts]
        return None if values[0] is None else torch.cat(values)

    return Trajectories(
        final=cat("final"),
        latents=cat("latents"),
        next_latents=cat("next_latents"),
        log_probs=cat("log_probs"),
        steps=parts[0].steps,
        predicted_x0=cat("predicted_x0"),
    )


def _stack_steps(values: list[Tensor], like: Tensor) -> Tensor:
    """[B, S, ...] from S tensors shaped like ``like``; S may be 0."""
    if not values:
        return like.new_zeros(len(like), 0, *like.shape[1:])
    return torch.stack(values, dim=1)


def _check_steps(
    num_steps: int, sde_steps: Sequence[int], recorded_steps: Sequence[int], eta: float
) -> None:
    if num_steps < 1:
        raise ValueError("sigmas must hold at least two levels (one step)")
    outside = [i for i in sde_steps if not 0 <= i < num_steps]
    if outside:
        raise ValueError(f"sde_steps {outside} are outside the {num_steps} sampling steps")
    not_sde = sorted(set(recorded_steps) - set(sde_steps))
    if not_sde:
        raise ValueError(
            f"recorded steps {not_sde} are not SDE steps: an ODE step has no log-probability"
        )
    if recorded_steps and eta <= 0:
        raise ValueError(f"eta must be > 0 for SDE steps with a log-probability, got {eta}")


__all__ = ["SAMPLERS", "Trajectories", "VelocityFn", "concatenate", "integrate"]
