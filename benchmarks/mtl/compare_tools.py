"""What the comparisons of ``compare`` and ``compare_losses`` share: LibMTL's weightings bound
to one parameter, in float64, and the task weights a direction implies."""

from __future__ import annotations

import torch

from benchmarks.mtl.methods import libmtl_weighting_module


def libmtl_weighting(name: str, parameter: torch.Tensor, task_num: int):
    """LibMTL's weighting ``name`` bound to one shared parameter, as its trainer binds it."""
    weighting = getattr(libmtl_weighting_module(), name)()
    weighting.task_num = task_num
    weighting.device = torch.device("cpu")
    weighting.rep_grad = False
    weighting.get_share_params = lambda: [parameter]
    weighting.zero_grad_share_params = lambda: parameter.grad.zero_()
    weighting.init_param()
    parameter.grad = torch.zeros_like(parameter)
    return weighting


def implied_weights(jacobian: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """The w with J^T w = d (least squares in float64; exact for independent task gradients),
    for one direction d (D,) or for each column of ``directions`` (D, n): then (K, n).

    Weights expose what a relative direction difference hides: with task norms 1e-2 and
    1e3, a wrong weight on the small task barely moves d.
    """
    columns = directions.double().reshape(len(directions), -1)
    solution = torch.linalg.lstsq(jacobian.double().T, columns).solution
    return solution.reshape(-1) if directions.ndim == 1 else solution
