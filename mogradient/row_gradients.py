"""K objective gradients for one backward pass per row value, from per-row gradients.

A :class:`~mogradient.combinable.CombinableLoss` that declares its
:class:`~mogradient.combinable.RowValues` s (V x R, each entry depending on the network
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

Exactness is the caller's claim that rows do not interact and that every trainable
parameter is reached only through the hooked calls; :func:`RowGradients.accumulate`
with ``verify=True`` checks it against the K-backward engine (the trainer does so once
per run). Parameters of any other module type make :meth:`RowGradients.supported`
false, so callers fall back to :func:`mogradient.gradients.combinable_gradients`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from mogradient.combinable import CombinableLoss
from mogradient.errors import UnusedParameterError
from mogradient.gradients import accumulate_gradients, combinable_gradients


class RowGradientError(RuntimeError):
    """The per-row engine cannot give exact gradients for this forward or loss."""


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
    is the order of ``parameters``, as in :mod:`mogradient.gradients`).
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
        self.unsupported = [
            names.get(id(p), f"parameter {index}")
            for index, p in enumerate(self.parameters)
            if id(p) not in owned
        ]
        self._recording = False
        self._captures: list[_Capture] = []
        self._generation = 0  # which recording the relay nodes belong to
        self._consume: Callable[[int, torch.Tensor], None] | None = None  # the running pass

    @property
    def supported(self) -> bool:
        """Whether every parameter belongs to a Linear (else use the K-backward engine)."""
        return not self.unsupported

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
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Record the trainable Linears' calls of the forward run in the block.

        What is recorded feeds the next :meth:`stack` or :meth:`gram` call; a forward
        recomputed during backward (gradient checkpointing) runs outside and is ignored.
        """
        with self.hooked():
            self._start()
            try:
                yield
            finally:
                self._recording = False

    def _start(self) -> None:
        self._captures = []
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
            relay = self._relay(len(self._captures), self._generation)
            self._captures.append(_Capture(slots, inputs))
            return _RowGradientRelay.apply(output, relay)

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
        """The stream's pieces, each forward recorded; its calls wait for :meth:`_take`."""
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
        """The K x D stack of the recorded forward's ``loss`` (``extra`` excluded)."""
        return self._stack(loss, self._take(), retain_graph)

    def gram(self, loss: CombinableLoss, retain_graph: bool = False) -> torch.Tensor:
        """The K x K Gram of the recorded forward's objectives, in float64.

        With one row value (V = 1: per-sample losses, Flow-GRPO, SDPO) it is c M c^T
        from the per-row Gram M, module by module, without forming the stack.
        """
        captures = self._take()
        values, coefficients = self._row_coefficients(loss)
        if len(values) != 1 or _shares_parameters(captures):
            stack = self._stack(loss, captures, retain_graph).double()
            return stack @ stack.T
        rows, copies = values.shape[1], loss.rows.copies
        per_row = torch.zeros(rows, rows, dtype=torch.float64, device=values.device)
        calls = collections.Counter((c.slots.weight, c.slots.bias) for c in captures)
        summed: dict[tuple, torch.Tensor] = {}  # modules called several times

        def add(capture: _Capture, delta: torch.Tensor) -> None:
            nonlocal per_row
            key = (capture.slots.weight, capture.slots.bias)
            x = None
            if capture.slots.weight is not None:
                x = _rows_view(capture.inputs.detach(), rows, copies, capture.slots.name)
            d = _rows_view(delta, rows, copies, capture.slots.name)
            if calls[key] == 1:
                per_row += _row_gram(x, d, capture.slots.bias is not None)
            else:  # the Gram of a sum over calls: sum the calls' row gradients first
                gradient = _per_row_gradient(x, d, capture.slots.bias is not None)
                summed[key] = gradient if key not in summed else summed[key] + gradient

        reached = self._pass(values[0].sum(), captures, retain_graph, add)
        self._check_used(captures, [reached])
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

        As :func:`mogradient.gradients.accumulate_gradients` without weights: the
        ``extra`` terms go to ``.grad`` (unless ``apply_extra`` is False). A piece that
        declares no rows goes through the K-backward engine. ``verify``
        also computes each piece with the K-backward engine and raises
        :class:`RowGradientError` where they differ by more than round-off of
        ``verify_dtype`` (the stack's by default; bfloat16 under bf16 autocast).
        """
        if not self.supported:
            raise RowGradientError(
                f"parameters outside an nn.Linear ({', '.join(self.unsupported[:3])}): use "
                "mogradient.gradients.accumulate_gradients (the K-backward engine)"
            )

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
                "mogradient.gradients.combinable_gradients, or declare RowValues"
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
        values, coefficients = self._row_coefficients(loss)
        count, rows = loss.num_objectives, values.shape[1]
        copies = loss.rows.copies
        dtype = torch.promote_types(self.parameters[0].dtype, torch.float32)
        stack = torch.zeros(count, self.size, dtype=dtype, device=self.parameters[0].device)
        active = [v for v in range(len(values)) if bool(coefficients[:, v].any())]
        passes = []
        for position, v in enumerate(active):
            keep = retain_graph or position < len(active) - 1
            c = coefficients[:, v].to(dtype)

            def add(capture: _Capture, delta: torch.Tensor, c: torch.Tensor = c) -> None:
                _add_contraction(stack, capture, delta, c, rows, copies)

            passes.append(self._pass(values[v].sum(), captures, keep, add))
        self._check_used(captures, passes)
        return stack

    def _pass(
        self,
        seed: torch.Tensor,
        captures: list[_Capture],
        retain_graph: bool,
        consume: Callable[[_Capture, torch.Tensor], None],
    ) -> set[int]:
        """Back-propagate ``seed``, handing each recorded call's output gradient to
        ``consume`` as soon as autograd has it (so no pass holds them all at once).

        Returns the indices of the calls the seed reached. The backward runs to the
        trainable parameters, whose own gradients are dropped.
        """
        reached: set[int] = set()

        def relayed(index: int, grad: torch.Tensor) -> None:
            reached.add(index)
            consume(captures[index], grad)

        self._consume = relayed
        try:
            if captures:
                torch.autograd.grad(
                    seed, self.parameters, retain_graph=retain_graph, allow_unused=True
                )
        finally:
            self._consume = None
        return reached

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


def _rows_view(tensor: torch.Tensor, rows: int, copies: int, name: str) -> torch.Tensor:
    """A call's (M, ..., d) tensor as (R, copies x tokens, d): all of row r's positions."""
    batch = tensor.shape[0] if tensor.ndim > 1 else 1
    if tensor.ndim < 2 or batch != rows * copies:
        raise RowGradientError(
            f"{name!r} was called on a batch of {batch} rows, but the loss declares "
            f"{rows} rows x {copies} copies: declare RowValues(copies=...) to match how "
            "the forward stacks its rows, or use the K-backward engine"
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
    delta: torch.Tensor,
    coefficients: torch.Tensor,
    rows: int,
    copies: int,
) -> None:
    """stack[:, slot] += sum_r c[k, r] (row r's gradient of the capture's parameters)."""
    dtype = stack.dtype
    d = _rows_view(delta, rows, copies, capture.slots.name).to(dtype)
    slots = capture.slots
    if slots.weight is not None:
        x = _rows_view(capture.inputs.detach(), rows, copies, slots.name).to(dtype)
        start, end = slots.weight
        stack[:, start:end].addmm_(coefficients, _per_row_gradient(x, d, bias=False))
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
