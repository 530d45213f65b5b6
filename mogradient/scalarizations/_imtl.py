"""IMTL: learned loss scales (IMTL-L) and impartial weights on the shared gradients (IMTL-G)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mogradient.harmonizers._imtl_g import IMTLG
from mogradient.scalarizations._base import Scalarization, ScalarizedLoss
from mogradient.scalarizations._imtl_l import IMTLL, check_scalable
from mogradient.scalarizations._shared import redirect_shared, shared_gradients, shared_parameters


class IMTL(Scalarization):
    """Impartial multi-task learning, both halves (Liu et al. 2021, ICLR, the hybrid IMTL).

    IMTL-L scales each loss by a learned exp(s_k): the scaled losses are
    l_k = exp(s_k) L_k - s_k (the composed [`IMTLL`][mogradient.scalarizations.IMTLL], whose
    log-scales s are this module's parameters). IMTL-G then weighs the scaled losses' gradients on
    the shared parameters, g_k = exp(s_k) grad_shared L_k, with the closed form of the
    [`IMTLG`][mogradient.harmonizers.IMTLG] harmonizer: alpha summing to 1 such that d = sum_k
    alpha_k g_k has the same projection on every unit gradient g_k / ||g_k||.

    The returned loss is the surrogate sum_k l_k + <d - sum_k g_k, theta_shared> (the added
    term detached, its value zero): its backward gives the shared parameters d, each head
    its scaled loss's gradient exp(s_k) grad L_k, and s its IMTL-L gradient
    exp(s_k) L_k - 1: how the paper's hybrid updates the shared parameters, the task
    parameters and the scales. The paper may take the gradients on the shared features
    instead of the parameters, to save time; here they are on ``shared``. ``weights`` is
    d loss / d L_k = exp(s_k); ``extras["shared_weights"]`` holds alpha_k exp(s_k), the
    weights d gives the raw shared gradients, and ``extras["alpha"]`` and
    ``extras["fallback"]`` IMTL-G's. I could not check the paper's section, equation and
    algorithm numbers, so none are cited.

    Add ``parameters()`` to the optimizer (without weight decay); ``init`` is the
    log-scales' start (0). Losses must be non-negative. State in ``state_dict``: the
    log-scales (``loss_scales.log_scales``). ``shared`` is held by reference.
    """

    def __init__(self, num_tasks: int, shared: Iterable[torch.Tensor], init: float = 0.0) -> None:
        super().__init__(num_tasks)
        self._shared = shared_parameters("IMTL", shared)
        self.loss_scales = IMTLL(num_tasks, init)
        self._gradient_weighting = IMTLG()

    def check_domain(self, values: torch.Tensor) -> None:
        check_scalable("IMTL", values)

    def scalarize(self, losses: torch.Tensor) -> ScalarizedLoss:
        log_scales = self.loss_scales.log_scales.to(losses.dtype)
        scales = torch.exp(log_scales)
        scaled = scales * losses - log_scales
        gradients = shared_gradients("IMTL", scaled, self._shared)
        harmonization = self._gradient_weighting(gradients)
        alpha = harmonization.weights.to(gradients)
        correction = harmonization.direction.to(gradients) - gradients.sum(0)
        loss = redirect_shared(scaled.sum(), self._shared, correction)
        scales = scales.detach().clone()
        extras = {
            "alpha": alpha,
            "shared_weights": alpha.to(scales) * scales,
            "fallback": harmonization.fallback,
        }
        return ScalarizedLoss(loss, scales, extras)
