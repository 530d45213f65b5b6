"""K objective gradients for one backward pass per row value, from per-row gradients.

A [`CombinableLoss`][mogradient.combinable.CombinableLoss] that declares its
[`RowValues`][mogradient.combinable.RowValues] s (V x R, each entry depending on the network
through one forward row) has grad L_k = sum_{v,r} c[k,v,r] grad s[v,r] with
c = dL_k / ds. At a trainable ``nn.Linear`` (y = x W^T + b) the gradient of
sum_r s[v,r] splits by rows as delta_r^T x_r, which the ordinary backward already holds
at the module. So V backward passes, with the rows kept apart at the trainable
modules, give the K x D stack by a small contraction, exactly: DiffusionNFT needs 2
passes (its two branch errors) and Flow-GRPO or SDPO 1 (a log-probability per row),
instead of one per objective. The Gram of the objectives follows as c M c^T, with M the
Gram of the per-row gradients, without the stack when V = 1.

Why hooks of our own. Three well-kept options were measured against this (float64 tiny
SD3 transformer with peft LoRA; see benchmarks/results/row_gradients_options.md):
Opacus' ``GradSampleModule`` materializes a B x D per-sample gradient per backward,
wraps the model and does not support gradient checkpointing or a module called twice
per forward with a row layout; ``torch.func`` (``functional_call`` + ``vmap(grad)``)
re-runs the forward per row under vmap, which the diffusers transformer and peft's
adapter switching do not survive; TorchJD's ``autogram.Engine`` computes only the Gram
of per-instance losses (one extra backward and a re-forward of each hooked module) and
not the stack the update needs. None contracts per-row gradients with per-objective
coefficients as they are computed. What is captured here is the input of each call of
a trainable Linear while a forward is recorded, and an identity node on its output;
each pass hands every call's output gradient to the contraction as autograd produces it,
so no pass holds them all at once. The output itself is not kept (the node lives on in
the graph), which halves what a recorded forward holds beyond the plain one; modifying
it in place is refused by autograd. Forwards recomputed under gradient checkpointing run
outside the recording and are never captured twice.

Exactness needs rows that do not interact and trainable parameters reached only through
the hooked calls; where either fails the rows are wrong by their own size, so the engine
checks rather than trusts. Every pass compares the sum of its rows with the gradient
autograd computes anyway (projected on a fixed random vector per weight: a weight also
used outside its module, through ``F.linear`` say, is missed by the rows). The first
result of an engine takes one extra pass with random row weights u, whose rows must be
u_r times the plain ones (a mean over the batch in the forward or the row values breaks
that). A BatchNorm normalizing with batch statistics on a trained path is refused when
the forward is recorded, and parameters of any module but ``nn.Linear`` are refused by
name; [`RowGradients.supported`][mogradient.engines.RowGradients.supported] is false for both, so
callers fall back to
[`mogradient.engines.combinable_gradients`][mogradient.engines.combinable_gradients].
[`RowGradients.accumulate`][mogradient.engines.RowGradients.accumulate] with ``verify=True``
compares whole stacks with the K-backward engine (the trainer does so once per run).
"""

from __future__ import annotations

import bisect
import collections
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mogradient.combinable import CombinableLoss
from mogradient.engines._stack import accumulate_gradients, combinable_gradients
from mogradient.errors import UnusedParameterError


class RowGradientError(RuntimeError):
    """The per-row engine cannot give exact gradients for this forward or loss."""


_FALLBACK = (
    "use the K-backward engine, mogradient.engines._stack.combinable_gradients "
    "(objective_gradients for per-sample losses; their Gram is J J^T)"
)


@dataclass(frozen=True)
class _Slots:
    """Where a Linear's weight and bias sit in the flat parameter vector (None: frozen)."""

    weight: tuple[int, int] | None
    bias: tuple[int, int] | None
    name: str


@dataclass
class _Capture:
    """One recorded call of a trainable Linear: its input (its output has a relay node)."""

    slots: _Slots
    inputs: torch.Tensor


class _RowGradientRelay(torch.autograd.Function):
    """The identity on a recorded call's output whose backward hands the output's
    gradient to the engine.

    A node of its own rather than a tensor hook: a hook on a view (a Linear on 3-D input
    returns one) is bypassed if the view is later modified in place, silently; this
    node's output may not be modified in place at all (autograd refuses it, naming this
    class), and the node sees the gradient of the value the call returned.
    """

    @staticmethod
    def forward(ctx, output: torch.Tensor, relay: Callable[[torch.Tensor], None]):
        ctx.relay = relay
        return output.view_as(output)  # an alias: nothing is copied or kept

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.relay(grad)
        return grad, None


class RowGradients:
    """Per-objective gradients from per-row gradients at the trainable ``nn.Linear`` s.

    ``module`` is searched for the owners of ``parameters`` (the flat order of the stack
    is the order of ``parameters``, as in `mogradient.engines._stack`).
    """

    def __init__(self, module: nn.Module, parameters: Sequence[torch.Tensor]) -> None:
        self.parameters = list(parameters)
        if not self.parameters:
            raise ValueError("the parameter set is empty: pass the parameters to differentiate")
        offsets, start = {}, 0
        for parameter in self.parameters:
            offsets[id(parameter)] = (start, start + parameter.numel())
            start += parameter.numel()
        self.size = start
        self._modules: list[tuple[nn.Linear, _Slots]] = []
        self._batch_norms = [
            (name, child) for name, child in module.named_modules() if isinstance(child, _BatchNorm)
        ]
        owned: set[int] = set()
        for name, child in module.named_modules():
            weight = offsets.get(id(child.weight)) if isinstance(child, nn.Linear) else None
            bias = None
            if isinstance(child, nn.Linear) and child.bias is not None:
                bias = offsets.get(id(child.bias))
            if weight is None and bias is None:
                continue
            self._modules.append((child, _Slots(weight, bias, name)))
            owned.update(id(p) for p in (child.weight, child.bias) if p is not None)
        names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        self._names = [names.get(id(p), f"parameter {i}") for i, p in enumerate(self.parameters)]
        owners = _owner_types(module)
        self.unsupported = [
            self._names[i] for i, p in enumerate(self.parameters) if id(p) not in owned
        ]
        self._unsupported_owners = [
            f"{self._names[i]} ({owners.get(id(p), 'not in the module')})"
            for i, p in enumerate(self.parameters)
            if id(p) not in owned
        ]
        self._index = {
            start: i for i, (start, _) in enumerate(offsets[id(p)] for p in self.parameters)
        }
        self._summary: list[int] = []  # each parameter's first entry in a pass's summary
        width = 0
        for parameter in self.parameters:
            self._summary.append(width)
            width += parameter.shape[0] if parameter.ndim else 1
        self._summary_width = width
        self._directions: dict[tuple, torch.Tensor] = {}
        self._module = module  # its coarsest dtype bounds the interaction check's round-off
        self._forward_precision = self.parameters[0].dtype  # coarsened by recorded autocast
        self._rows_checked = False  # the first result's extra pass showed rows apart
        self._refused = False  # a result was refused: rows mixed or a weight used outside
        self._recording = False
        self._captures: list[_Capture] = []
        self._mixing: list[str] = []  # BatchNorms that mixed the recorded forward's rows
        self._generation = 0  # which recording the relay nodes belong to
        self._consume: Callable[[int, torch.Tensor], None] | None = None  # the running pass

    @property
    def supported(self) -> bool:
        """Whether the engine can serve this model (else use the K-backward engine):
        every parameter belongs to a Linear, no BatchNorm normalizes with batch statistics
        now, and no result has been refused for mixed rows or a weight used outside its
        Linear (what only a forward shows)."""
        batch_statistics = any(_uses_batch_statistics(norm) for _, norm in self._batch_norms)
        return not (self.unsupported or batch_statistics or self._refused)

    def supports(self, loss: CombinableLoss) -> bool:
        """Whether ``loss`` can go through this engine: it declares rows, all is Linear."""
        return self.supported and loss.rows is not None

    # ----------------------------------------------------------- recording
    @contextmanager
    def hooked(self) -> Iterator[None]:
        """Forward hooks on the trainable Linears for the block (nothing recorded yet)."""
        handles = [
            module.register_forward_hook(self._hook(slots), with_kwargs=True)
            for module, slots in self._modules
        ]
        handles += [
            norm.register_forward_hook(self._norm_hook(name)) for name, norm in self._batch_norms
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the trainable Linears' calls of the forward run in the block.

        What is recorded feeds the next [`stack`][mogradient.engines.RowGradients.stack] or
        [`gram`][mogradient.engines.RowGradients.gram] call; a forward recomputed during backward
        (gradient checkpointing) runs outside and is ignored.
        """
        with self.hooked():
            self._start()
            try:
                yield
            finally:
                self._recording = False

    def _start(self) -> None:
        self._captures = []
        self._forward_precision = self.parameters[0].dtype
        self._mixing = []
        self._generation += 1
        self._recording = True

    def _hook(self, slots: _Slots):
        def hook(
            module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor
        ) -> torch.Tensor | None:
            if not self._recording or not isinstance(output, torch.Tensor):
                return None
            if not torch.is_grad_enabled() or not output.requires_grad:
                return None  # a no-grad call (a rollout, a frozen adapter's pass)
            inputs = args[0] if args else kwargs["input"]
            device = output.device.type
            if torch.amp.is_autocast_available(device) and torch.is_autocast_enabled(device):
                self._forward_precision = _coarser(
                    self._forward_precision, torch.get_autocast_dtype(device)
                )
            relay = self._relay(len(self._captures), self._generation)
            self._captures.append(_Capture(slots, inputs))
            return _RowGradientRelay.apply(output, relay)

        return hook

    def _norm_hook(self, name: str):
        """Note a BatchNorm that normalizes a trained path with batch statistics while a
        forward is recorded: it mixes the rows, which no later check can undo."""

        def hook(module: _BatchNorm, args: tuple, output: torch.Tensor) -> None:
            inputs = args[0] if args else None
            trained = isinstance(inputs, torch.Tensor) and inputs.requires_grad
            recorded = self._recording and torch.is_grad_enabled()
            if recorded and trained and _uses_batch_statistics(module):
                self._mixing.append(f"{name!r} ({type(module).__name__})")

        return hook

    def _relay(self, index: int, generation: int) -> Callable[[torch.Tensor], None]:
        """What call ``index``'s relay node does with its output gradient: hand it to the
        running pass, if any (other backward passes through the graph, and stale
        recordings, are ignored)."""

        def relay(grad: torch.Tensor) -> None:
            if self._consume is not None and generation == self._generation:
                self._consume(index, grad)

        return relay

    def _recorded(
        self, losses: Iterable[tuple[float, CombinableLoss]]
    ) -> Iterator[tuple[float, CombinableLoss]]:
        """The stream's pieces, each forward recorded; its calls wait for `_take`."""
        iterator = iter(losses)
        while True:
            self._start()
            try:
                piece = next(iterator)
            except StopIteration:
                return
            finally:
                self._recording = False
            yield piece

    def _take(self) -> list[_Capture]:
        captures, self._captures = self._captures, []
        return captures

    # -------------------------------------------------------------- results
    def stack(self, loss: CombinableLoss, retain_graph: bool = False) -> torch.Tensor:
        """The K x D stack of the recorded forward's ``loss`` (``extra`` excluded).

        Raises [`RowGradientError`][mogradient.engines.RowGradientError] instead of rows that would
        be wrong (see the module: other modules' parameters, mixed rows, a weight used outside its
        Linear).
        """
        return self._stack(loss, self._take(), retain_graph)

    def gram(self, loss: CombinableLoss, retain_graph: bool = False) -> torch.Tensor:
        """The K x K Gram of the recorded forward's objectives, in float64.

        With one row value (V = 1: per-sample losses, Flow-GRPO, SDPO) it is c M c^T
        from the per-row Gram M, module by module, without forming the stack.
        """
        captures = self._take()
        with _autocast_off(self.parameters[0].device):
            return self._gram(loss, captures, retain_graph)

    def _gram(
        self, loss: CombinableLoss, captures: list[_Capture], retain_graph: bool
    ) -> torch.Tensor:
        self._refuse()
        values, coefficients = self._row_coefficients(loss)
        if len(values) != 1 or _shares_parameters(captures):
            stack = self._stack(loss, captures, retain_graph).double()
            return stack @ stack.T
        rows = values.shape[1]
        per_row = torch.zeros(rows, rows, dtype=torch.float64, device=values.device)
        calls = collections.Counter((c.slots.weight, c.slots.bias) for c in captures)
        summed: dict[tuple, torch.Tensor] = {}  # modules called several times

        def add(capture: _Capture, x: torch.Tensor | None, d: torch.Tensor) -> None:
            nonlocal per_row
            key = (capture.slots.weight, capture.slots.bias)
            if calls[key] == 1:
                per_row += _row_gram(x, d, capture.slots.bias is not None)
            else:  # the Gram of a sum over calls: sum the calls' row gradients first
                gradient = _per_row_gradient(x, d, capture.slots.bias is not None)
                summed[key] = gradient if key not in summed else summed[key] + gradient

        probe = self._weighted_rows(values[0], captures, loss.rows.copies)
        tally = self._pass(values[0].sum(), captures, retain_graph, add, rows, loss.rows.copies)
        self._check([tally], probe)
        self._check_used(captures, [tally.reached])
        for gradient in summed.values():
            per_row += gradient @ gradient.T
        c = coefficients[:, 0].double()
        return c @ per_row @ c.T

    def accumulate(
        self,
        losses: Iterable[tuple[float, CombinableLoss]],
        count: int | None = None,
        apply_extra: bool = True,
        verify: bool = False,
        verify_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``sum scale * stack`` over a stream of pieces, recording each piece's forward.

        As [`mogradient.engines.accumulate_gradients`][mogradient.engines.accumulate_gradients]
        without weights: the ``extra`` terms go to ``.grad`` (unless ``apply_extra`` is False). A
        piece that declares no rows goes through the K-backward engine. ``verify``
        also computes each piece with the K-backward engine and raises
        [`RowGradientError`][mogradient.engines.RowGradientError] where they differ by more than
        round-off of ``verify_dtype`` (the stack's by default; bfloat16 under bf16 autocast).
        """
        self._refuse_unsupported()

        def piece_stack(loss: CombinableLoss, retain_graph: bool) -> torch.Tensor:
            captures = self._take()
            reference = None
            if verify:
                reference = combinable_gradients(loss, self.parameters, retain_graph=True)
            if loss.rows is None:
                part = combinable_gradients(loss, self.parameters, retain_graph=retain_graph)
            else:
                part = self._stack(loss, captures, retain_graph)
            if reference is not None:
                check_close(part, reference, verify_dtype)
            return part

        with self.hooked():
            return accumulate_gradients(
                self._recorded(losses),
                self.parameters,
                count=count,
                apply_extra=apply_extra,
                piece_stack=piece_stack,
            )

    # ------------------------------------------------------------ internals
    def _row_coefficients(self, loss: CombinableLoss) -> tuple[torch.Tensor, torch.Tensor]:
        """The row values (V, R) and c = dL_k / d values (K, V, R), constants."""
        if loss.rows is None:
            raise RowGradientError(
                "this loss declares no rows (CombinableLoss.rows): use "
                "mogradient.engines._stack.combinable_gradients, or declare RowValues"
            )
        values = loss.rows.matrix
        if values is loss.terms:
            return values, loss.coefficients.to(device=values.device, dtype=values.dtype)
        objectives = loss.objective_losses()
        rows = []
        for k in range(loss.num_objectives):
            (grad,) = torch.autograd.grad(
                objectives[k], loss.rows.values, retain_graph=True, allow_unused=True
            )
            rows.append(torch.zeros_like(values) if grad is None else grad.reshape(values.shape))
        return values, torch.stack(rows).detach()

    def _stack(
        self, loss: CombinableLoss, captures: list[_Capture], retain_graph: bool
    ) -> torch.Tensor:
        with _autocast_off(self.parameters[0].device):
            return self._stack_exact(loss, captures, retain_graph)

    def _stack_exact(
        self, loss: CombinableLoss, captures: list[_Capture], retain_graph: bool
    ) -> torch.Tensor:
        self._refuse()
        values, coefficients = self._row_coefficients(loss)
        copies = loss.rows.copies
        dtype = self._dtype
        stack = torch.zeros(
            loss.num_objectives, self.size, dtype=dtype, device=self.parameters[0].device
        )
        active = [v for v in range(len(values)) if bool(coefficients[:, v].any())]
        probe = self._weighted_rows(values[active[0]], captures, copies) if active else None
        tallies = []
        for position, v in enumerate(active):
            keep = retain_graph or position < len(active) - 1
            c = coefficients[:, v].to(dtype)

            def add(
                capture: _Capture, x: torch.Tensor | None, d: torch.Tensor, c: torch.Tensor = c
            ) -> None:
                _add_contraction(stack, capture, x, d, c)

            tallies.append(
                self._pass(values[v].sum(), captures, keep, add, values.shape[1], copies)
            )
        self._check(tallies, probe)
        self._check_used(captures, [tally.reached for tally in tallies])
        return stack

    @property
    def _dtype(self) -> torch.dtype:
        """What the stack and the checks' summaries are computed in (float32 at least)."""
        return torch.promote_types(self.parameters[0].dtype, torch.float32)

    def _refuse_unsupported(self) -> None:
        """Name the parameters of modules other than ``nn.Linear``, which no hook sees."""
        if not self.unsupported:
            return
        shown = ", ".join(self._unsupported_owners[:3])
        if len(self._unsupported_owners) > 3:
            shown += f" and {len(self._unsupported_owners) - 3} more"
        raise RowGradientError(
            "RowGradients handles parameters of nn.Linear modules only (peft's LoRA layers "
            f"are ones); {shown} belong elsewhere: train only Linear parameters, or "
            f"{_FALLBACK}"
        )

    def _refuse(self) -> None:
        """Refuse parameters outside a Linear and a recorded forward with rows mixed by a
        BatchNorm (batch statistics), before any pass."""
        self._refuse_unsupported()
        if self._mixing:
            raise RowGradientError(
                f"BatchNorm {self._mixing[0]} normalized a trained path with batch "
                "statistics (training mode), which mixes rows: each row's gradient then "
                "depends on every other row. Run it in eval mode (running statistics), or "
                f"{_FALLBACK}"
            )

    def _pass(
        self,
        seed: torch.Tensor,
        captures: list[_Capture],
        retain_graph: bool,
        consume: Callable[[_Capture, torch.Tensor | None, torch.Tensor], None] | None,
        rows: int,
        copies: int,
    ) -> _Tally:
        """Back-propagate ``seed`` (a sum over rows), handing each recorded call's input
        and output gradient, as (rows, positions, width) views, to ``consume`` as soon as
        autograd has them (so no pass holds them all at once).

        Returns the pass's `_Tally`, with the parameters' gradients that the
        backward computes anyway, for `_check`.
        """
        tally = _Tally(self, rows)

        def relayed(index: int, grad: torch.Tensor) -> None:
            capture = captures[index]
            x, d = None, _rows_view(grad, rows, copies, capture.slots.name)
            if capture.slots.weight is not None:
                x = _rows_view(capture.inputs.detach(), rows, copies, capture.slots.name)
            tally.add(index, capture, x, d)
            if consume is not None:
                consume(capture, x, d)

        self._consume = relayed
        try:
            if not captures:
                return tally
            grads = torch.autograd.grad(
                seed, self.parameters, retain_graph=retain_graph, allow_unused=True
            )
        finally:
            self._consume = None
        tally.total = torch.cat(
            [_summarize(self, i, grad, tally.summary) for i, grad in enumerate(grads)]
        )
        return tally

    def _weighted_rows(
        self, values: torch.Tensor, captures: list[_Capture], copies: int
    ) -> tuple[torch.Tensor, _Tally] | None:
        """The engine's first result takes this extra pass, seeded with sum_r u_r v_r
        (u_r fixed, in [1, 2)): where rows do not interact each row's summary is u_r times
        the plain pass's; a mean over the batch anywhere between the trained calls and
        ``values`` breaks that, and no single pass can show it."""
        if self._rows_checked or not captures:
            return None
        u = 1 + torch.rand(len(values), generator=torch.Generator().manual_seed(0))
        u = u.to(device=values.device, dtype=values.dtype)
        return u, self._pass((u * values).sum(), captures, True, None, len(values), copies)

    def _check(self, tallies: list[_Tally], probe: tuple[torch.Tensor, _Tally] | None) -> None:
        """Refuse the result where a comparison of `_comparisons` fails, by more than
        round-off of the coarsest dtype seen; one device sync for all, at the end.
        ``supported`` is false after a refusal."""
        checks = [check for check in self._comparisons(tallies, probe) if check[1] is not None]
        if not checks:  # no call recorded
            return
        gaps = torch.stack(
            [torch.stack([(a - e).abs().max(), e.abs().max()]) for a, e, _, _ in checks]
        ).tolist()
        for (actual, expected, precision, explain), (error, scale) in zip(
            checks, gaps, strict=True
        ):
            if not math.isfinite(scale):  # diverged gradients: nothing to compare them by;
                return  # the caller's finite checks report them, and the next result checks
            tolerance = _relative_tolerance(precision) * scale
            if not error <= tolerance:
                self._refused = True
                gap = f"off by {error:.3g}, largest entry {scale:.3g}, tolerance {tolerance:.3g}"
                raise RowGradientError(explain((actual - expected).abs(), gap))
        self._rows_checked = self._rows_checked or probe is not None

    def _comparisons(
        self, tallies: list[_Tally], probe: tuple[torch.Tensor, _Tally] | None
    ) -> list[tuple[torch.Tensor, torch.Tensor | None, torch.dtype, Callable]]:
        """(actual, expected, dtype, explain): each pass's rows summed against autograd's
        gradient (a parameter also reached outside its Linear's recorded calls breaks it),
        then the weighted pass's rows against u_r times the plain pass's (rows that
        interact break it)."""
        passes = tallies if probe is None else [probe[1], *tallies]
        checks = [(t.summary.sum(dim=0), t.total, t.precision, self._outside) for t in passes]
        if probe is not None:
            u, weighted = probe
            expected = u.to(weighted.summary.dtype)[:, None] * tallies[0].summary
            # Both passes back-propagate through the whole forward: its coarsest rounding
            # (a bfloat16 base model around float32 adapters, or autocast) separates them,
            # not only the recorded calls' own. The module is read here, once per engine,
            # not at every recording: the check runs on the first result only.
            precision = _coarser(weighted.precision, tallies[0].precision)
            precision = _coarser(precision, self._forward_precision)
            precision = _coarser(precision, _coarsest_floating(self._module, precision))
            checks.append((weighted.summary, expected, precision, _interacting))
        return checks

    def _outside(self, error: torch.Tensor, gap: str) -> str:
        """Why the rows' sum misses part of the gradient of the parameter worst off."""
        name = self._names[bisect.bisect_right(self._summary, int(error.argmax())) - 1]
        return (
            f"{name} is reached outside its nn.Linear's recorded calls: the per-row "
            f"gradients miss part of its gradient ({gap}). Typical causes: the weight is "
            "also used through F.linear or a module other than its own (a tied weight), or "
            "part of the forward ran outside the recording. Call the Linear itself and "
            f"record the whole forward, or {_FALLBACK}"
        )

    def _direction(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """A fixed random unit vector over weight ``index``'s inputs, like ``like``: the
        summaries project weight gradients on it (any fixed vector would miss inputs
        orthogonal to it, as a LayerNorm's output is to ones)."""
        key = (index, like.device, like.dtype)
        if key not in self._directions:
            generator = torch.Generator().manual_seed(index)
            direction = torch.randn(self.parameters[index].shape[1], generator=generator)
            direction = direction.double() / direction.double().norm()
            self._directions[key] = direction.to(device=like.device, dtype=like.dtype)
        return self._directions[key]

    def _check_used(self, captures: list[_Capture], passes: list[set[int]]) -> None:
        """Raise as the K-backward engine does for parameters no objective reached."""
        reached: set[int] = set()
        indices = set().union(*passes) if passes else range(len(captures))
        # (no pass: every coefficient zero, a recorded call is enough)
        for index in indices:
            slots = captures[index].slots
            reached.update(s[0] for s in (slots.weight, slots.bias) if s)
        missing, start = [], 0
        for index, parameter in enumerate(self.parameters):
            if start not in reached:
                missing.append(f"parameter {index} (shape {tuple(parameter.shape)})")
            start += parameter.numel()
        if missing:
            shown = ", ".join(missing[:5]) + (
                f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            )
            raise UnusedParameterError(
                f"{len(missing)} of {len(self.parameters)} parameters are not reached by any "
                f"objective through a recorded call: {shown}. Was the forward run inside "
                "RowGradients.recording() (or the stream given to accumulate), with grad "
                "enabled and without reentrant checkpointing?"
            )


class _Tally:
    """One pass's per-row gradients in brief: (rows, sum of output widths), each weight's
    row gradient projected on a fixed random unit vector, each bias's as is.

    O(positions x widths) per call, against the per-row products' O(positions x width^2);
    enough to compare the rows' sum with autograd's total, and a pass with other row
    weights with this one.
    """

    def __init__(self, engine: RowGradients, rows: int) -> None:
        self.engine = engine
        self.reached: set[int] = set()
        device = engine.parameters[0].device
        # the coarsest rounding the pass saw: autograd's matmuls, then the calls' tensors
        self.precision = _matmul_precision(engine.parameters[0].dtype, device)
        self.total: torch.Tensor | None = None  # autograd's gradient, summarized alike
        self.summary = torch.zeros(rows, engine._summary_width, dtype=engine._dtype, device=device)

    def add(self, index: int, capture: _Capture, x: torch.Tensor | None, d: torch.Tensor) -> None:
        """Add recorded call ``index``'s row gradients, from its (R, positions, width)
        views."""
        self.reached.add(index)
        self.precision = _coarser(self.precision, d.dtype)
        d = d.to(self.summary.dtype)
        if capture.slots.weight is not None:
            self.precision = _coarser(self.precision, x.dtype)
            weight = self.engine._index[capture.slots.weight[0]]
            x = x.to(self.summary.dtype)
            direction = self.engine._direction(weight, x)
            projected = torch.bmm((x @ direction)[:, None], d)  # (R, 1, out): fast on CPU too
            self._add(weight, projected[:, 0])
        if capture.slots.bias is not None:
            self._add(self.engine._index[capture.slots.bias[0]], d.sum(dim=1))

    def _add(self, index: int, part: torch.Tensor) -> None:
        start = self.engine._summary[index]
        self.summary[:, start : start + part.shape[1]] += part


def _interacting(error: torch.Tensor, gap: str) -> str:
    """Why the weighted pass's rows are not u_r times the plain pass's."""
    row = int(error.amax(dim=1).argmax())
    return (
        f"rows interact: row {row}'s gradient depends on other rows ({gap}). Something "
        "between the trained calls and the row values reduces over the batch (a mean or "
        "normalization over rows, BatchNorm in training mode, advantages normalized "
        f"without detaching the statistics). Compute each row's values from its own row, "
        f"or {_FALLBACK}"
    )


def _summarize(
    engine: RowGradients, index: int, grad: torch.Tensor | None, like: torch.Tensor
) -> torch.Tensor:
    """Parameter ``index``'s gradient as a _Tally row: a weight's projected, a bias's."""
    parameter = engine.parameters[index]
    if grad is None:
        return like.new_zeros(parameter.shape[0] if parameter.ndim else 1)
    grad = grad.to(like.dtype)
    return grad @ engine._direction(index, like) if grad.ndim == 2 else grad.reshape(-1)


def _coarser(first: torch.dtype, second: torch.dtype) -> torch.dtype:
    """The dtype with the larger round-off."""
    return first if torch.finfo(first).eps >= torch.finfo(second).eps else second


def _autocast_off(device: torch.device) -> AbstractContextManager:
    """The engine's own products (contractions, Grams, checks) in their dtype, also when
    the caller's backward runs under autocast: bfloat16 would cost them their precision
    and break the in-place sums into the float32 stack."""
    if not torch.amp.is_autocast_available(device.type):
        return nullcontext()
    return torch.autocast(device.type, enabled=False)


def _coarsest_floating(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The coarsest rounding of ``module``'s floating parameters and buffers, as its
    matmuls on their device have it (``default`` for a module without any)."""
    precision = default
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.is_floating_point():
            precision = _coarser(precision, _matmul_precision(tensor.dtype, tensor.device))
    return precision


def _matmul_precision(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype whose round-off float32 matmuls on CUDA have: TF32 (float16's 10 mantissa
    bits) at float32 matmul precision "high", bfloat16 at "medium"."""
    if dtype != torch.float32 or device.type != "cuda":
        return dtype
    return {"highest": torch.float32, "high": torch.float16, "medium": torch.bfloat16}[
        torch.get_float32_matmul_precision()
    ]


def _relative_tolerance(*dtypes: torch.dtype) -> float:
    """sqrt(eps) of the coarsest dtype, as [`check_close`][mogradient.engines.check_close]:
    round-off of sums over rows and positions stays below it; a missed or mixed row moves entries by
    their size."""
    return max(torch.finfo(dtype).eps for dtype in dtypes) ** 0.5


def _uses_batch_statistics(norm: _BatchNorm) -> bool:
    """Whether a BatchNorm normalizes with the batch's statistics (as F.batch_norm does in
    training mode, or without running statistics)."""
    return norm.training or norm.running_mean is None


def _owner_types(module: nn.Module) -> dict[int, str]:
    """id(parameter) -> the type name of the module that registers it."""
    return {
        id(parameter): type(child).__name__
        for child in module.modules()
        for parameter in child.parameters(recurse=False)
    }


def _rows_view(tensor: torch.Tensor, rows: int, copies: int, name: str) -> torch.Tensor:
    """A call's (M, ..., d) tensor as (R, copies x tokens, d): all of row r's positions."""
    batch = tensor.shape[0] if tensor.ndim > 1 else 1
    if tensor.ndim < 2 or batch != rows * copies:
        raise RowGradientError(
            f"{name!r} was called on a batch of {batch} rows, but the loss declares "
            f"{rows} rows x {copies} copies: declare one row value per forward row (not a "
            "mean over the batch), with RowValues(copies=...) matching how the forward "
            f"stacks its rows, or {_FALLBACK}"
        )
    width = tensor.shape[-1]
    shaped = tensor.reshape(copies, rows, -1, width)
    return shaped.transpose(0, 1).reshape(rows, -1, width) if copies > 1 else shaped[0]


def _per_row_gradient(x: torch.Tensor | None, d: torch.Tensor, bias: bool) -> torch.Tensor:
    """(R, D_module): each row's gradient of a Linear's trainable weight and bias, from
    (R, positions, width) views of its inputs ``x`` (None: weight frozen) and output
    gradients ``d``, in ``d``'s dtype."""
    parts = []
    if x is not None:
        parts.append(torch.bmm(d.transpose(1, 2), x.to(d.dtype)).reshape(len(d), -1))
    if bias:
        parts.append(d.sum(dim=1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _add_contraction(
    stack: torch.Tensor,
    capture: _Capture,
    x: torch.Tensor | None,
    d: torch.Tensor,
    coefficients: torch.Tensor,
) -> None:
    """stack[:, slot] += sum_r c[k, r] (row r's gradient of the capture's parameters),
    from (rows, positions, width) views of the call's input ``x`` and output gradient."""
    d = d.to(stack.dtype)
    slots = capture.slots
    if slots.weight is not None:
        start, end = slots.weight
        gradient = _per_row_gradient(x.to(stack.dtype), d, bias=False)
        stack[:, start:end].addmm_(coefficients, gradient)
    if slots.bias is not None:
        start, end = slots.bias
        stack[:, start:end].addmm_(coefficients, d.sum(dim=1))


# Elements of one temporary of the per-sample Gram (1 MiB in float32): per-row gradients
# are formed a block of output features at a time, factored products a block of rows.
_GRAM_BLOCK = 1 << 18


def _row_gram(x: torch.Tensor | None, d: torch.Tensor, bias: bool) -> torch.Tensor:
    """The R x R Gram (float64) of one call's per-row gradients, from (R, positions,
    width) views of its inputs ``x`` (None: weight frozen) and output gradients ``d``.

    Weight: per-row gradients formed and multiplied, or, when cheaper (few positions per
    row, as in an MLP), the factored form <d_r^T x_r, d_s^T x_s> =
    sum_{t,u} (d_rt . d_su)(x_rt . x_su) without forming them; in blocks of at most
    ``_GRAM_BLOCK`` elements, products in the gradients' dtype, the R x R sums in float64.
    """
    rows = d.shape[0]
    gram = torch.zeros(rows, rows, dtype=torch.float64, device=d.device)
    if x is not None:
        x = x.to(d.dtype)
        positions, d_out, d_in = x.shape[1], d.shape[-1], x.shape[-1]
        flat = rows * positions
        if flat * flat * (d_in + d_out) < flat * d_in * d_out + rows * rows * d_in * d_out:
            d_flat, x_flat = d.reshape(flat, d_out), x.reshape(flat, d_in)
            step = max(1, _GRAM_BLOCK // (positions * flat))
            for start in range(0, rows, step):
                block = slice(start * positions, min(rows, start + step) * positions)
                products = (d_flat[block] @ d_flat.T) * (x_flat[block] @ x_flat.T)
                summed = products.reshape(-1, positions, rows, positions).sum(dim=(1, 3))
                gram[start : start + step] += summed.double()
        else:
            step = max(1, _GRAM_BLOCK // (rows * d_in))
            for start in range(0, d_out, step):
                part = torch.bmm(d[:, :, start : start + step].transpose(1, 2), x)
                part = part.reshape(rows, -1)
                gram += (part @ part.T).double()
    if bias:
        summed = d.sum(dim=1)
        gram += (summed @ summed.T).double()
    return gram


def _shares_parameters(captures: list[_Capture]) -> bool:
    """Whether two different modules' calls hold one parameter (tied weights)."""
    owners: dict[int, tuple] = {}
    for capture in captures:
        key = (capture.slots.weight, capture.slots.bias)
        for slot in key:
            if slot is not None and owners.setdefault(slot[0], key) != key:
                return True
    return False


def check_close(
    engine: torch.Tensor, reference: torch.Tensor, dtype: torch.dtype | None = None
) -> None:
    """Raise RowGradientError where the per-row stack is not the K-backward one.

    The tolerance is sqrt(eps) of ``dtype`` (the reference's by default) times the
    largest entry: 1.5e-8 in float64, 3.5e-4 in float32, 0.09 in bfloat16. Round-off of
    sums over many rows and positions stays below it; a structural error (rows stacked
    otherwise than declared, mixed rows, a missed call) moves entries by their own size.
    """
    dtype = reference.dtype if dtype is None else dtype
    scale = float(reference.abs().max()) if reference.numel() else 0.0
    error = float((engine - reference).abs().max()) if reference.numel() else 0.0
    tolerance = torch.finfo(dtype).eps ** 0.5 * scale
    if not error <= tolerance:
        raise RowGradientError(
            f"per-row gradients differ from the K-backward engine by {error:.3g} (largest "
            f"entry {scale:.3g}, tolerance {tolerance:.3g}): the forward mixes rows (e.g. "
            "BatchNorm in training mode), uses a trainable weight outside its module's "
            "call, or stacks rows otherwise than RowValues.copies says"
        )
