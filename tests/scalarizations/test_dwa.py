"""DWA (dynamic weight average): the epoch averages it follows, TorchJD and LibMTL over
epochs, misuse and bad settings."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tolerances import chain_atol

from mogradient.scalarizations import DWA

from .helpers import (
    F64,
    LOSS_SEQUENCE,
    assert_close,
    both_gradients,
    loss_gradient,
    softmax,
    torchjd_scalarization,
)
from .libmtl import (
    DTYPES,
    LR,
    TASKS,
    Model,
    batches,
    check,
    flat,
    heads,
    libmtl,
    needs_libmtl,
    run_libmtl,
)


def test_dwa_follows_the_epoch_averages() -> None:
    method = DWA(3, temperature=2.0)
    history: list[np.ndarray] = []
    for epoch in range(4):
        epoch_rows = LOSS_SEQUENCE[epoch : epoch + 2] * (1.0 + 0.1 * epoch)
        for values in epoch_rows:
            if len(history) < 2:
                expected = np.ones(3)
            else:
                expected = 3 * softmax(history[-1] / history[-2] / 2.0)
            loss, gradient, weights = loss_gradient(method, values)
            assert_close(weights, expected)
            assert_close(gradient, expected)
            assert_close(loss, expected @ values)
        method.end_epoch()
        history.append(epoch_rows.mean(axis=0))
    method.end_epoch()  # an empty epoch changes nothing
    assert_close(method.averages, np.stack(history[-2:]))


def test_same_as_torchjd_dwa_over_epochs() -> None:
    ours, theirs = DWA(3), torchjd_scalarization().DWA(2.0)
    for epoch in range(4):
        for values in LOSS_SEQUENCE[epoch : epoch + 2] * (1.0 + 0.1 * epoch):
            our_loss, their_loss, our_grad, their_grad = both_gradients(ours, theirs, values)
            # Weights: a ratio, a 3-term softmax and the factor K from the same epoch
            # sums (ours sum in float64 as TorchJD does here): a few ulps of K.
            torch.testing.assert_close(our_grad, their_grad, rtol=0, atol=chain_atol(F64, 3, 16))
            assert abs(our_loss - their_loss) <= chain_atol(F64, 3 * our_loss, 16)
        ours.end_epoch()
        theirs.step()


@needs_libmtl
@pytest.mark.parametrize("dtype", DTYPES)
def test_dwa_matches_libmtl_over_epochs(dtype: torch.dtype) -> None:
    epochs, per_epoch = 4, 2
    ours, theirs = Model(dtype), Model(dtype)
    method = DWA(TASKS, temperature=2.0)
    driver = libmtl("DWA", theirs, dtype, T=2.0)
    driver._weighting.train_loss_buffer = np.zeros((TASKS, epochs))
    ours_optimizer = torch.optim.SGD(ours.parameters(), lr=LR)
    their_optimizer = torch.optim.SGD(theirs.parameters(), lr=LR)
    data = batches(dtype, epochs * per_epoch)
    for epoch in range(epochs):
        driver._weighting.epoch = epoch
        their_sum = np.zeros(TASKS)
        for batch in data[epoch * per_epoch : (epoch + 1) * per_epoch]:
            ours_optimizer.zero_grad()
            their_optimizer.zero_grad()
            their_losses = theirs.losses(batch)
            their_sum += their_losses.detach().double().numpy()
            their_weights = run_libmtl(driver, theirs, their_losses)
            result = method(ours.losses(batch))
            result.loss.backward()

            check(result.weights, their_weights, dtype, epoch, "weights")
            shared, their_shared = flat(ours.shared_parameters()), flat(theirs.shared_parameters())
            check(shared, their_shared, dtype, epoch, "W")
            check(heads(ours), heads(theirs), dtype, epoch, "heads")
            ours_optimizer.step()
            their_optimizer.step()
        driver._weighting.train_loss_buffer[:, epoch] = their_sum / per_epoch
        method.end_epoch()
    assert float(np.ptp(their_weights.numpy())) > 0.01  # the last epoch reweighed


def test_a_negative_epoch_average_and_bad_settings_raise() -> None:
    dwa = DWA(2)
    dwa(torch.tensor([1.0, -3.0]))
    with pytest.raises(ValueError, match=r"task 1's average loss this epoch is -3\.0"):
        dwa.end_epoch()
    with pytest.raises(ValueError, match="temperature"):
        DWA(2, temperature=-1.0)
