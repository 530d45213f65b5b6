"""What the per-row engine must refuse rather than return wrong rows (issue 35, item 9).

Rows are exact only when they do not interact and every trained parameter is reached
through its Linear's recorded calls. Each case that breaks that (BatchNorm with batch
statistics, a weight also used through ``F.linear``, a mean over the batch, parameters of
other modules) must raise a RowGradientError that names the cause; the forwards that keep
the premise must still give the rows of an independent reference: a plain loop of
``autograd.grad`` over single-row forwards, in float32 and float64.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn
from torch.nn import functional

from mogradient.combinable import CombinableLoss, RowValues
from mogradient.engines import RowGradientError, RowGradients

ROWS, TOKENS, WIDTH = 6, 4, 8
DTYPES = [torch.float32, torch.float64]
PerRowLoss = Callable[[torch.Tensor], torch.Tensor]


def _per_row(output: torch.Tensor) -> torch.Tensor:
    """One loss per row, from that row only."""
    return output.square().flatten(1).mean(dim=1)


def _centered(output: torch.Tensor) -> torch.Tensor:
    """Each row's loss against the batch mean: every loss depends on every row."""
    return (output - output.mean(dim=0)).square().flatten(1).mean(dim=1)


def _inputs(dtype: torch.dtype, tokens: int | None = None) -> torch.Tensor:
    shape = (ROWS, WIDTH) if tokens is None else (ROWS, tokens, WIDTH)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


def _trained(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _recorded(
    engine: RowGradients, model: nn.Module, x: torch.Tensor, loss: PerRowLoss = _per_row
) -> CombinableLoss:
    with engine.recording():
        return CombinableLoss.instance_wise(loss(model(x)))


def _reference_rows(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Row r's gradient of its own loss, from a forward of row r alone."""
    params = _trained(model)
    rows = []
    for r in range(len(x)):
        grads = torch.autograd.grad(_per_row(model(x[r : r + 1]))[0], params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
    return torch.stack(rows)


def _assert_rows(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal up to round-off of the dtype: 100 eps of the largest entry."""
    scale = float(expected.abs().max())
    assert scale > 0
    error = float((actual.to(expected.dtype) - expected).abs().max())
    assert error <= 100 * torch.finfo(expected.dtype).eps * scale, f"{error / scale:.3g}"


# ------------------------------------------------------------------ BatchNorm


def _batch_norm_net(dtype: torch.dtype, first: bool = False) -> nn.Sequential:
    """Linear -> BatchNorm (frozen affine) -> Linear, or the BatchNorm on the raw input."""
    torch.manual_seed(0)
    layers = [nn.Linear(WIDTH, WIDTH), nn.BatchNorm1d(WIDTH), nn.Linear(WIDTH, 3)]
    if first:
        layers[:2] = layers[1::-1]
    model = nn.Sequential(*layers).to(dtype)
    for layer in model:
        if isinstance(layer, nn.BatchNorm1d):
            layer.requires_grad_(False)
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_with_batch_statistics_is_refused(dtype: torch.dtype) -> None:
    """Measured before the fix: supported, and rows 73% off (float64)."""
    model = _batch_norm_net(dtype)
    engine = RowGradients(model, _trained(model))
    x = _inputs(dtype)
    assert not engine.supported
    for result in (engine.stack, engine.gram, engine.stack):
        loss = _recorded(engine, model, x)
        model.eval()  # after the forward: what the forward ran with counts
        with pytest.raises(RowGradientError, match=r"'1' \(BatchNorm1d\).*mixes rows"):
            result(loss)
        model.train()
    with pytest.raises(RowGradientError, match="mixes rows"):
        engine.accumulate((1.0, CombinableLoss.instance_wise(_per_row(model(x)))) for _ in range(1))

    model.eval()  # running statistics: rows apart again
    assert engine.supported
    _assert_rows(engine.stack(_recorded(engine, model, x)), _reference_rows(model, x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_norm_on_the_raw_input_does_not_mix_trained_rows(dtype: torch.dtype) -> None:
    """Batch statistics of a constant input are constants: the rows stay exact (only
    ``supported``, which cannot see where a BatchNorm sits, says no)."""
    model = _batch_norm_net(dtype, first=True)
    engine = RowGradients(model, _trained(model))
    x = _inputs(dtype)
    assert not engine.supported
    stack = engine.stack(_recorded(engine, model, x))
    model.eval()  # the reference's single-row forwards need the batch's statistics
    model[0].running_mean.copy_(x.mean(dim=0))
    model[0].running_var.copy_(x.var(dim=0, unbiased=False))
    _assert_rows(stack, _reference_rows(model, x))


# ----------------------------------------------- a weight used outside its Linear


class _Tied(nn.Module):
    """``first.weight`` is used by ``first`` and again through ``F.linear``."""

    def __init__(self, outside: bool = True) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.last = nn.Linear(WIDTH, 3)
        self.outside = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        if self.outside:
            h = h + functional.linear(h, self.first.weight)
        return self.last(h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_also_used_through_functional_linear_is_refused(dtype: torch.dtype) -> None:
    """Measured before the fix: supported, and rows 21% off (float64)."""
    torch.manual_seed(0)
    model = _Tied().to(dtype)
    engine = RowGradients(model, _trained(model))
    x = _inputs(dtype, TOKENS)
    assert engine.supported
    for result in (engine.stack, engine.gram):
        with pytest.raises(RowGradientError, match=r"first\.weight is reached outside its"):
            result(_recorded(engine, model, x))
    assert not engine.supported  # what the forward showed


def test_weight_used_only_through_functional_linear_is_named() -> None:
    """Not the unused-parameter error, which asks whether the forward was recorded."""

    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first, self.last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.last(functional.linear(x, self.first.weight, self.first.bias))

    model = Functional().double()
    engine = RowGradients(model, _trained(model))
    with pytest.raises(RowGradientError, match=r"first\.weight is reached outside its"):
        engine.stack(_recorded(engine, model, _inputs(torch.float64)))


# ------------------------------------------------------- a mean over the batch


class _Centering(nn.Module):
    """Subtracts the batch mean of a hidden layer: every row reads every other row."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        return self.last(h - h.mean(dim=0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("make_model", "loss"),
    [(_Centering, _per_row), (lambda: _Tied(outside=False), _centered)],
    ids=["in-the-forward", "in-the-loss"],
)
def test_mean_over_the_batch_is_refused(make_model, loss: PerRowLoss, dtype: torch.dtype) -> None:
    """Measured before the fix: supported, and rows 37% (forward) and 82% (loss) off."""
    torch.manual_seed(0)
    model = make_model().to(dtype)
    x = _inputs(dtype)
    for result in ("stack", "gram"):
        engine = RowGradients(model, _trained(model))
        with pytest.raises(RowGradientError, match="rows interact"):
            getattr(engine, result)(_recorded(engine, model, x, loss))
        assert not engine.supported


def test_a_mean_over_the_batch_as_the_row_value_is_refused() -> None:
    """One scalar for the whole batch is not one value per row: refused by the row count,
    with a message that says so (before: only about ``copies``)."""
    model = _Centering().double()
    engine = RowGradients(model, _trained(model))
    with engine.recording():
        mean = _per_row(model(_inputs(torch.float64))).mean().reshape(1, 1)
    loss = CombinableLoss(mean, torch.ones(1, 1, 1, dtype=torch.float64), rows=RowValues(mean))
    with pytest.raises(RowGradientError, match="one row value per forward row"):
        engine.stack(loss)


# ------------------------------------------ parameters of other module types


@pytest.mark.parametrize(
    ("module", "named"),
    [
        (nn.Conv1d(1, 1, 3, padding=1), r"0\.weight \(Conv1d\), 0\.bias \(Conv1d\)"),
        (nn.LayerNorm(WIDTH), r"0\.weight \(LayerNorm\), 0\.bias \(LayerNorm\)"),
        (nn.GroupNorm(1, 1), r"0\.weight \(GroupNorm\), 0\.bias \(GroupNorm\)"),
    ],
    ids=["conv", "layer-norm", "group-norm"],
)
def test_parameters_of_other_modules_are_named(module: nn.Module, named: str) -> None:
    """Measured before the fix: UnusedParameterError, asking whether the forward was
    recorded."""
    model = nn.Sequential(module, nn.Flatten(), nn.Linear(WIDTH, 3)).double()
    engine = RowGradients(model, list(model.parameters()))
    x = _inputs(torch.float64)[:, None]
    assert not engine.supported
    for result in (engine.stack, engine.gram):
        with pytest.raises(RowGradientError, match=f"nn.Linear modules only.*{named}"):
            result(_recorded(engine, model, x))


def test_an_embedding_is_named() -> None:
    model = nn.Sequential(nn.Embedding(10, WIDTH), nn.Linear(WIDTH, 3)).double()
    engine = RowGradients(model, list(model.parameters()))
    tokens = torch.randint(10, (ROWS, TOKENS), generator=torch.Generator().manual_seed(0))
    with pytest.raises(RowGradientError, match=r"0\.weight \(Embedding\)"):
        engine.stack(_recorded(engine, model, tokens))
    with pytest.raises(RowGradientError, match=r"0\.weight \(Embedding\)"):
        engine.accumulate([])


# -------------------------------------- the checks pass where the rows are exact


class _Attention(nn.Module):
    """Self-attention over each row's tokens with biased projections and a LayerNorm:
    the key bias gets no gradient at all (softmax ignores a shift), the LayerNorm output
    is orthogonal to ones; both are traps for a check of the rows' sum."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, elementwise_affine=False)
        self.query, self.key, self.value = (nn.Linear(WIDTH, WIDTH) for _ in range(3))
        self.out = nn.Linear(WIDTH, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        attended = functional.scaled_dot_product_attention(
            self.query(h), self.key(h), self.value(h)
        )
        return self.out(attended + h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_forwards_pass_the_checks(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = _Attention().to(dtype)
    engine = RowGradients(model, _trained(model))
    x = _inputs(dtype, TOKENS)
    reference = _reference_rows(model, x)
    _assert_rows(engine.stack(_recorded(engine, model, x)), reference)
    _assert_rows(engine.stack(_recorded(engine, model, x)), reference)  # after the check
    gram = engine.gram(_recorded(engine, model, x))
    _assert_rows(gram, reference @ reference.T)
    assert engine.supported


@pytest.mark.parametrize(
    ("setting", "rounding"),
    [("highest", torch.float32), ("high", torch.float16), ("medium", torch.bfloat16)],
)
def test_the_checks_allow_for_tf32_on_cuda(setting: str, rounding: torch.dtype) -> None:
    """float32 matmuls on CUDA round to TF32 (float16's mantissa) at precision "high": the
    checks' tolerance must follow, or exact rows would be refused on a GPU."""
    from mogradient.engines._rows import _matmul_precision

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(setting)
    try:
        assert _matmul_precision(torch.float32, torch.device("cuda")) == rounding
        assert _matmul_precision(torch.float32, torch.device("cpu")) == torch.float32
        assert _matmul_precision(torch.float64, torch.device("cuda")) == torch.float64
    finally:
        torch.set_float32_matmul_precision(previous)


# ------------------- a bfloat16 model around float32 adapters (the GPU's setting)


class _Bf16Backbone(nn.Module):
    """A frozen bfloat16 network around trainable float32 Linears that cast their input
    up and their output back down, as peft's LoRA layers do on a bfloat16 model. Rows are
    exact, but the two passes of the interaction check back-propagate through bfloat16
    and differ by its round-off; ``center`` mixes the rows through a batch mean."""

    def __init__(self, center: bool = False) -> None:
        super().__init__()
        self.center = center
        self.frozen_in = nn.Linear(WIDTH, WIDTH).bfloat16().requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, WIDTH)
        self.frozen_out = nn.Linear(WIDTH, 3).bfloat16().requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen_in(x.bfloat16()))
        h = h + self.adapter(h.float()).bfloat16()
        if self.center:
            h = h - h.mean(dim=0)
        return self.frozen_out(torch.tanh(h)).float()


def test_a_bfloat16_model_with_float32_adapters_passes_the_checks() -> None:
    """Measured on the H100 before the fix (SD3.5-M shape, bf16, LoRA in float32): the
    rows refused as interacting, off by 0.38% of the largest entry against a float32
    tolerance of 0.035%; the same on this CPU in bfloat16 (0.59% off)."""
    torch.manual_seed(0)
    model = _Bf16Backbone()
    engine = RowGradients(model, _trained(model))
    x = _inputs(torch.float32, TOKENS)
    for _ in range(2):  # the first result takes the interaction check
        stack = engine.stack(_recorded(engine, model, x))
    assert engine.supported
    reference = _reference_rows(model, x)  # one-row forwards: bfloat16 round-off apart
    scale = float(reference.abs().max())
    assert float((stack - reference).abs().max()) <= 0.05 * scale


def test_under_bfloat16_autocast_the_checks_allow_for_it() -> None:
    """A float32 model run under bfloat16 autocast: the recording notes autocast's dtype
    (the module's own dtypes do not show it)."""
    torch.manual_seed(0)
    model = _Attention()
    engine = RowGradients(model, _trained(model))
    x = _inputs(torch.float32, TOKENS)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        engine.stack(_recorded(engine, model, x))
    assert engine.supported


def test_a_bfloat16_model_that_mixes_rows_is_still_refused() -> None:
    """The looser tolerance (bfloat16's) still sees a mean over the batch."""
    torch.manual_seed(0)
    model = _Bf16Backbone(center=True)
    engine = RowGradients(model, _trained(model))
    with pytest.raises(RowGradientError, match="rows interact"):
        engine.stack(_recorded(engine, model, _inputs(torch.float32, TOKENS)))
