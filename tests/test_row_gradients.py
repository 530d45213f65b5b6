"""The per-row engine against the K-backward engine and finite differences (float64).

Every case builds a small network whose trainable Linears see rows the way the
diffusion losses feed them (tokens per row, a CFG-doubled batch, a module called twice,
checkpointed blocks) and compares the K x D stack with K separate backward passes
(``combinable_gradients(method="sequential")``, an independent path through autograd).
Planted bugs (rows rolled, recomputed forwards captured) must break the agreement.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mogradient.combinable import CombinableLoss, RowValues
from mogradient.engines import (
    RowGradientError,
    RowGradients,
    accumulate_gradients,
    check_close,
    combinable_gradients,
    flat_gradient,
)
from mogradient.errors import UnusedParameterError

ROWS, TOKENS, WIDTH, K = 6, 5, 8, 5
FLOAT64_RTOL = 1e-12


class Block(nn.Module):
    """Linear -> GELU -> Linear over tokens, residual; optionally checkpointed."""

    def __init__(self, width: int, checkpointed: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)
        self.checkpointed = checkpointed

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.checkpointed:
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Net(nn.Module):
    """Two blocks, the second applied twice (shared weights), and a frozen head."""

    def __init__(self, checkpointed: bool = False) -> None:
        super().__init__()
        self.first = Block(WIDTH, checkpointed)
        self.shared = Block(WIDTH, checkpointed)
        self.head = nn.Linear(WIDTH, WIDTH)
        self.head.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.shared(self.shared(self.first(x))))


def _net(checkpointed: bool = False, seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net(checkpointed).double()


def _params(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _inputs(rows: int = ROWS, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, TOKENS, WIDTH, generator=torch.Generator().manual_seed(seed)).double()


def _coefficients(terms: int, rows: int = ROWS, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    c = torch.randn(K, terms, rows, generator=generator).double()
    c[1] = 0.0  # an objective with no applicable row
    c[2, :, 0] = 0.0  # a masked row
    return c


def _nft_like(output: torch.Tensor, seed: int = 3) -> CombinableLoss:
    """Two per-row squared errors against fixed targets (DiffusionNFT's shape)."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.randn(output.shape, generator=generator).to(output.dtype)
    b = torch.randn(output.shape, generator=generator).to(output.dtype)
    terms = torch.stack(
        [(output - a).square().flatten(1).mean(1), (output - b).square().flatten(1).mean(1)]
    )
    coefficients = _coefficients(2, len(output)).to(output.dtype)
    return CombinableLoss(terms, coefficients, rows=RowValues(terms))


def _ratio_like(output: torch.Tensor, old: torch.Tensor | None = None) -> CombinableLoss:
    """Flow-GRPO's shape: clipped ratios of one per-row log-probability (by default with
    old log-probabilities that put the ratios on both sides of both clips)."""
    log_prob = -output.square().flatten(1).mean(1)
    if old is None:
        old = _old_log_probs(log_prob)
    ratio = torch.exp(log_prob - old)
    terms = torch.stack([ratio.clamp(max=1.1), ratio.clamp(min=0.9)])
    return CombinableLoss(terms, _coefficients(2, len(output)), rows=RowValues(log_prob))


def _old_log_probs(log_prob: torch.Tensor) -> torch.Tensor:
    return log_prob.detach() + torch.linspace(-0.2, 0.15, len(log_prob), dtype=log_prob.dtype)


def _pair_like(output: torch.Tensor) -> CombinableLoss:
    """SDPO's shape: terms of u = s_a - s_b over pairs of rows (own rows, then partners)."""
    s = output.flatten(1).mean(1)
    u = s[: len(s) // 2] - s[len(s) // 2 :]
    terms = torch.stack([u.square(), u, u.clamp(-0.1, 0.1).square()])
    return CombinableLoss(terms, _coefficients(3, len(u)), rows=RowValues(s))


def _reference(loss: CombinableLoss, params: list[torch.Tensor]) -> torch.Tensor:
    return combinable_gradients(loss, params, method="sequential", retain_graph=True)


def _assert_exact(stack: torch.Tensor, reference: torch.Tensor) -> None:
    scale = float(reference.abs().max())
    assert scale > 0
    error = float((stack - reference).abs().max())
    assert error <= FLOAT64_RTOL * scale, f"relative error {error / scale:.3g}"


@pytest.mark.parametrize("make_loss", [_nft_like, _ratio_like, _pair_like])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_stack_equals_k_backward_passes(make_loss, checkpointed: bool) -> None:
    model = _net(checkpointed)
    params = _params(model)
    engine = RowGradients(model, params)
    with engine.recording():
        loss = make_loss(model(_inputs()))
    reference = _reference(loss, params)
    _assert_exact(engine.stack(loss), reference)


def test_classifier_free_guidance_rows_stacked_twice() -> None:
    """A forward on cat([x, x']) combined per row: copies = 2 adds both halves per row."""
    model = _net()
    params = _params(model)
    engine = RowGradients(model, params)
    x = _inputs()
    with engine.recording():
        out = model(torch.cat([x, 0.5 * x]))
        uncond, cond = out.chunk(2)
        guided = uncond + 3.0 * (cond - uncond)
        base = _nft_like(guided)
        loss = CombinableLoss(base.terms, base.coefficients, rows=RowValues(base.terms, copies=2))
    reference = _reference(loss, params)
    _assert_exact(engine.stack(loss), reference)


def test_undeclared_copies_are_refused_in_one_line() -> None:
    model = _net()
    engine = RowGradients(model, _params(model))
    x = _inputs()
    with engine.recording():
        out = sum(model(torch.cat([x, x])).chunk(2))
        loss = _nft_like(out)
    with pytest.raises(RowGradientError, match="12 rows, but the loss declares 6 rows x 1"):
        engine.stack(loss)


def test_accumulation_and_extra_match_the_weightless_k_backward_path() -> None:
    """Two micro-batches with scales and a KL-like extra: stack and .grad both agree."""
    model = _net()
    params = _params(model)

    def stream():
        for seed, scale in ((1, 0.25), (4, 0.75)):
            out = model(_inputs(seed=seed))
            loss = _nft_like(out, seed=seed)
            extra = 0.3 * out.square().mean()
            yield scale, CombinableLoss(loss.terms, loss.coefficients, extra, loss.rows)

    reference = accumulate_gradients(stream(), params)
    reference_grad = flat_gradient(params).clone()
    model.zero_grad(set_to_none=True)
    stack = RowGradients(model, params).accumulate(stream())
    _assert_exact(stack, reference)
    _assert_exact(flat_gradient(params), reference_grad)


def test_verify_passes_on_exact_forwards_and_catches_mixed_rows() -> None:
    """Rows that start to interact after the engine's one-time check (here the second
    piece centers its output over the batch) give a wrong per-row split; the K-backward
    cross-check says so instead of returning it."""
    model = _net()
    params = _params(model)

    def stream(center_second: bool):
        yield 1.0, _nft_like(model(_inputs()))
        out = model(_inputs(seed=4))
        yield 1.0, _nft_like(out - out.mean(dim=0) if center_second else out)

    engine = RowGradients(model, params)
    engine.accumulate(stream(center_second=False), verify=True)
    with pytest.raises(RowGradientError, match="mixes rows"):
        engine.accumulate(stream(center_second=True), verify=True)


def test_finite_differences() -> None:
    """Independent of autograd: central differences of each objective's loss."""
    model = _net()
    params = _params(model)
    x = _inputs(rows=3)
    engine = RowGradients(model, params)

    with engine.recording():
        output = model(x)
        old = _old_log_probs(-output.square().flatten(1).mean(1))
        loss = _ratio_like(output, old)

    def losses() -> torch.Tensor:
        return _ratio_like(model(x), old).objective_losses().detach()

    stack = engine.stack(loss)
    generator = torch.Generator().manual_seed(5)
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    step = 1e-6
    for _ in range(3):
        direction = torch.randn(flat.shape, generator=generator).double()
        estimates = []
        for sign in (1, -1):
            _assign(params, flat + sign * step * direction)
            estimates.append(losses())
        _assign(params, flat)
        numeric = (estimates[0] - estimates[1]) / (2 * step)
        torch.testing.assert_close(stack @ direction, numeric, rtol=1e-6, atol=1e-9)


def _assign(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    with torch.no_grad():
        offset = 0
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def test_planted_bug_rows_rolled_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the engine paired a call's inputs with another row's output gradients, its rows
    would no longer add up to autograd's gradient: the engine refuses the result."""
    import mogradient.engines._rows as engine_module

    original = engine_module._rows_view

    def rolled(tensor, rows, copies, name):
        view = original(tensor, rows, copies, name)
        return view.roll(1, dims=0) if tensor.shape[-1] == 2 * WIDTH else view

    monkeypatch.setattr(engine_module, "_rows_view", rolled)
    model = _net()
    params = _params(model)
    engine = RowGradients(model, params)
    with engine.recording():
        loss = _nft_like(model(_inputs()))
    with pytest.raises(RowGradientError, match="miss part of its gradient"):
        engine.stack(loss)


def test_planted_bug_call_captured_twice_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A call captured twice (hooks registered twice, or a recomputed forward paired with
    the backward as if it were another call) would double its rows' gradients, which
    then add up to twice autograd's gradient: the engine refuses the result."""
    model = _net(checkpointed=True)
    params = _params(model)
    x = _inputs()

    def stream():
        yield 1.0, _nft_like(model(x))

    original = RowGradients._hook

    def twice(self, slots):
        hook = original(self, slots)

        def doubled(module, args, kwargs, output):
            return hook(module, args, kwargs, hook(module, args, kwargs, output))

        return doubled

    monkeypatch.setattr(RowGradients, "_hook", twice)
    with pytest.raises(RowGradientError, match="miss part of its gradient"):
        RowGradients(model, params).accumulate(stream())


def test_recomputed_forwards_are_not_captured() -> None:
    """Under checkpointing every block's forward runs again in each backward pass; the
    engine records the forward only, so each call is captured once."""
    model = _net(checkpointed=True)
    engine = RowGradients(model, _params(model))
    counts = []
    original = engine._take

    def counting():
        captures = original()
        counts.append(len(captures))
        return captures

    def stream():
        yield 1.0, _nft_like(model(_inputs()))

    engine._take = counting
    engine.accumulate(stream())
    assert counts == [6]  # first: up, down; shared twice: 2 x (up, down)


def test_unsupported_parameters_are_reported() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4))
    engine = RowGradients(model, list(model.parameters()))
    assert not engine.supported
    assert engine.unsupported == ["1.weight", "1.bias"]


def test_a_forward_outside_recording_is_an_unused_parameter_error() -> None:
    model = _net()
    engine = RowGradients(model, _params(model))
    loss = _nft_like(model(_inputs()))
    with pytest.raises(UnusedParameterError, match="not reached"):
        engine.stack(loss)


def test_loss_without_rows_is_refused() -> None:
    model = _net()
    engine = RowGradients(model, _params(model))
    with engine.recording():
        base = _nft_like(model(_inputs()))
    loss = CombinableLoss(base.terms, base.coefficients)
    assert not engine.supports(loss)
    with pytest.raises(RowGradientError, match="declares no rows"):
        engine.stack(loss)


@pytest.mark.parametrize("tokens", [1, TOKENS])
def test_gram_of_per_sample_losses_equals_the_jacobian_gram(tokens: int) -> None:
    """Instance-wise: B losses, the B x B Gram against the full per-sample Jacobian
    (both the factored and the formed per-row weight Gram are exercised)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    params = _params(model)
    x = torch.randn(7, tokens, WIDTH).double()
    engine = RowGradients(model, params)
    with engine.recording():
        losses = model(x).square().mean(dim=(1, 2))
    jacobian = torch.stack(
        [
            torch.cat([g.reshape(-1) for g in torch.autograd.grad(loss, params, retain_graph=True)])
            for loss in losses
        ]
    )
    gram = engine.gram(CombinableLoss.instance_wise(losses))
    _assert_exact(gram, jacobian @ jacobian.T)


def test_gram_with_coefficients_equals_the_stack_gram() -> None:
    model = _net()
    params = _params(model)
    engine = RowGradients(model, params)
    with engine.recording():
        loss = _ratio_like(model(_inputs()))
    reference = _reference(loss, params)
    _assert_exact(engine.gram(loss), reference @ reference.T)


def test_bf16_autocast_within_bfloat16_rounding() -> None:
    """Under autocast the matmuls round to bf16; the engine keeps its sums in float32."""
    torch.manual_seed(0)
    model = Net().float()
    params = _params(model)
    engine = RowGradients(model, params)
    x = _inputs().float()
    with engine.recording(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x).float()
    loss = _nft_like(out)
    stack = engine.stack(loss, retain_graph=True)
    assert stack.dtype == torch.float32
    # The reference differentiates bf16 matmuls too; both are within bf16 rounding of
    # the float32 truth, so of each other.
    check_close(stack, _reference(loss, params), torch.bfloat16)


@pytest.mark.parametrize(
    ("make_loss", "passes"), [(_nft_like, 2), (_ratio_like, 1), (_pair_like, 1)]
)
def test_one_backward_pass_per_row_value(make_loss, passes: int) -> None:
    """K = 5 objectives cost V passes: NFT's two terms, one log-probability per row (and
    the engine's first result one more, its check that rows do not interact)."""
    model = _net()
    engine = RowGradients(model, _params(model))
    calls = []
    original = engine._pass

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    engine._pass = counting
    for _ in range(2):
        with engine.recording():
            loss = make_loss(model(_inputs()))
        engine.stack(loss)
    assert loss.num_objectives == K and len(calls) == (passes + 1) + passes


def test_a_linear_called_by_keyword_is_recorded() -> None:
    class Keyword(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.linear(input=x)

    torch.manual_seed(0)
    model = Keyword().double()
    params = _params(model)
    engine = RowGradients(model, params)
    with engine.recording():
        loss = _nft_like(model(_inputs()))
    reference = _reference(loss, params)
    _assert_exact(engine.stack(loss), reference)


def test_an_output_modified_in_place_after_the_call_is_refused() -> None:
    """A Linear on 3-D input returns a view; a hook on it would be bypassed, silently, if
    the view were modified in place. The engine's relay node makes autograd refuse it."""

    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(WIDTH, WIDTH)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            return torch.tanh(y.mul_(1.5).add_(x))  # what a fused residual might do

    torch.manual_seed(0)
    model = InPlace().double()
    assert _nft_like(model(_inputs())) is not None  # unrecorded, the forward is fine
    engine = RowGradients(model, _params(model))
    with engine.recording(), pytest.raises(RuntimeError, match="_RowGradientRelay"):
        model(_inputs())


def test_a_recorded_forward_does_not_keep_the_outputs_alive() -> None:
    """Only the inputs are captured (the contraction's x); each output is freed with the
    forward as in an unrecorded one, and its gradient still reaches the engine."""
    import weakref

    model = _net()
    params = _params(model)
    outputs: list[weakref.ref] = []
    handle = model.first.down.register_forward_hook(
        lambda m, a, out: outputs.append(weakref.ref(out))
    )
    engine = RowGradients(model, params)
    with engine.recording():
        loss = _nft_like(model(_inputs()))
    handle.remove()
    assert len(outputs) == 1 and outputs[0]() is None  # the residual add saves nothing
    reference = _reference(loss, params)
    _assert_exact(engine.stack(loss), reference)
