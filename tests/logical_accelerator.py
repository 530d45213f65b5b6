"""A logical accelerator on a CPU: CUDA's device rules enforced, CPU kernels doing the work.

Why: the trainer is built for GPUs but CI has none, and a CPU tensor meeting a CUDA tensor
is an error only on a real GPU (the first CUDA training step crashed that way). Fake
tensors (``FakeTensorMode``) check devices but carry no values, so they stop at the first
data-dependent branch; a training step is full of those.

Inside :func:`logical_accelerator`, a tensor moved to :data:`ACCELERATOR` (``.to``, a
factory's ``device=``, a module's ``.to``) becomes an :class:`AcceleratorTensor`: it
reports that device and wraps real CPU data. Every aten op goes through
:class:`AcceleratorMode`, which checks the op's tensors as CUDA does and raises the error
a GPU would, then runs the CPU kernel on the unwrapped data and wraps the results of an
accelerator op again. Results are therefore those of the CPU run. The rules checked:

- an op's tensor arguments are all on one device, except CPU scalars (0-dim tensors),
  which CUDA kernels accept beside CUDA tensors;
- advanced indexing takes indices on the CPU or on the indexed tensor's device, and a
  packed sequence its lengths and batch sizes on the CPU;
- copies (``copy_``, ``.to``) cross devices, as on a GPU;
- a random op producing accelerator data takes no CPU generator;
- ``.numpy()`` of an accelerator tensor fails.

The device is ``lazy:0``, not ``cuda:0``: autograd asks the device's registered guard for
a stream, and a CPU build has guards for the CPU, meta and lazy devices only (the lazy
backend itself never runs: every op stops at the mode). So code that branches on
``device.type == "cuda"`` (memory statistics, synchronization) takes its other branch,
and ``torch.Generator(device)`` cannot be made for it: those are what the guard does not
cover.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

ACCELERATOR = torch.device("lazy", 0)

aten = torch.ops.aten
# Ops whose purpose is to move data between devices.
_CROSS_DEVICE = {
    aten._to_copy.default,
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
}
_COPY_INTO_SECOND = {aten._copy_from.default, aten._copy_from_and_resize.default}
# Arguments CUDA takes on the host beside device data: (name, position) per op.
# Advanced indexing's indices (host or the indexed tensor's device); a packed sequence's
# lengths and batch sizes (host only, by contract).
_HOST_ALLOWED = {
    aten.index.Tensor: ("indices", 1),
    aten.index_put_.default: ("indices", 1),
    aten.index_put.default: ("indices", 1),
    aten._index_put_impl_.default: ("indices", 1),
    aten._pack_padded_sequence.default: ("lengths", 1),
    aten.gru.data: ("batch_sizes", 1),
    aten.lstm.data: ("batch_sizes", 1),
    aten.rnn_tanh.data: ("batch_sizes", 1),
    aten.rnn_relu.data: ("batch_sizes", 1),
}
# Outputs CUDA leaves on the host: a packed sequence's batch sizes.
_HOST_OUTPUTS = {aten._pack_padded_sequence.default: {1}}


class DeviceMismatch(RuntimeError):
    """What a GPU raises where this op mixes devices."""


class AcceleratorTensor(torch.Tensor):
    """CPU data that reports :data:`ACCELERATOR`; usable inside :func:`logical_accelerator`."""

    data_cpu: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor) -> AcceleratorTensor:
        wrapper = torch.Tensor._make_wrapper_subclass(
            cls,
            data.shape,
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=ACCELERATOR,
            requires_grad=False,
        )
        wrapper.data_cpu = data
        return wrapper

    def __reduce_ex__(self, protocol: int) -> tuple:
        # torch.save of a GPU tensor stores its data for the host to read back
        # (map_location="cpu" gives a CPU tensor): pickle the data, not this class.
        return self.data_cpu.__reduce_ex__(protocol)

    def tolist(self) -> list | float | int | bool:  # a GPU tensor copies to the host
        return self.data_cpu.tolist()

    def numpy(self, *, force: bool = False) -> None:
        raise TypeError(
            f"can't convert {ACCELERATOR} device type tensor to numpy. Use Tensor.cpu() to "
            "copy the tensor to host memory first."
        )

    def __repr__(self) -> str:  # values included, like a GPU tensor's
        return f"AcceleratorTensor({self.data_cpu!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(
            f"{func}: an accelerator tensor was used outside logical_accelerator() (it "
            "escaped the guard's context)"
        )


def _device_of(tensor: torch.Tensor) -> torch.device:
    return ACCELERATOR if isinstance(tensor, AcceleratorTensor) else tensor.device


def _is_cpu_scalar(tensor: torch.Tensor) -> bool:
    return tensor.dim() == 0 and tensor.device.type == "cpu"


def _check_same_device(func: Any, tensors: list[torch.Tensor]) -> torch.device | None:
    """The one device of ``tensors`` (CPU scalars aside), or the error CUDA raises."""
    devices = {_device_of(t) for t in tensors if not _is_cpu_scalar(t)}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise DeviceMismatch(
            f"Expected all tensors to be on the same device, but found at least two devices, "
            f"{names}! (in {func})"
        )
    if devices:
        return devices.pop()
    return ACCELERATOR if any(isinstance(t, AcceleratorTensor) for t in tensors) else None


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def _check_host_allowed(func: Any, args: tuple, kwargs: dict) -> torch.device | None:
    """The host-allowed argument may stay on the CPU; the rest follows the one-device rule."""
    name, position = _HOST_ALLOWED[func]
    indices = kwargs.get(name, args[position] if len(args) > position else None)
    others = [a for i, a in enumerate(args) if i != position] + [
        v for k, v in kwargs.items() if k != name
    ]
    device = _check_same_device(func, _tensors(others))
    for index in _tensors(indices):
        if index.device.type != "cpu" and _device_of(index) != device:
            raise DeviceMismatch(
                f"{name} should be either on cpu or on the same device as the other "
                f"arguments ({device}) (in {func})"
            )
    return device


def _requested_device(kwargs: dict) -> torch.device | None:
    device = kwargs.get("device")
    return None if device is None else torch.device(device)


def _check_generator(func: Any, kwargs: dict, device: torch.device | None) -> None:
    generator = kwargs.get("generator")
    if device == ACCELERATOR and generator is not None and generator.device.type == "cpu":
        raise DeviceMismatch(
            f"Expected a generator on {ACCELERATOR} but found a 'cpu' one (in {func}); on a "
            "GPU: Expected a 'cuda' device type for generator but found 'cpu'"
        )


def _unwrap(value: Any) -> Any:
    return value.data_cpu if isinstance(value, AcceleratorTensor) else value


class AcceleratorMode(TorchDispatchMode):
    """Checks every aten op against CUDA's device rules and runs it on the CPU data."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        requested = _requested_device(kwargs)
        if func in _CROSS_DEVICE:  # the result lives where the copy goes
            target = args[1] if func in _COPY_INTO_SECOND else args[0]
            device = requested or _device_of(target)
        elif func in _HOST_ALLOWED:
            device = requested or _check_host_allowed(func, args, kwargs)
        else:
            device = _check_same_device(func, _tensors((args, kwargs)))
            device = requested or device
        _check_generator(func, kwargs, device)
        cpu_kwargs = dict(kwargs)
        if requested == ACCELERATOR:
            cpu_kwargs["device"] = torch.device("cpu")
        inputs = {id(_unwrap(a)): a for a in _tensors((args, kwargs))}
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, cpu_kwargs))
        if device != ACCELERATOR:
            return out

        def wrap(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            original = inputs.get(id(value))  # an in-place op returns its input
            if original is not None and isinstance(original, AcceleratorTensor):
                return original
            return AcceleratorTensor(value)

        if func in _HOST_OUTPUTS:
            host = _HOST_OUTPUTS[func]
            return tuple(v if i in host else wrap(v) for i, v in enumerate(out))
        return tree_map(wrap, out)


@contextmanager
def logical_accelerator() -> Iterator[torch.device]:
    """Run the body with :data:`ACCELERATOR` as a logical GPU; yields that device."""
    lift_cpu_only = torch._C._only_lift_cpu_tensors()
    # torch.tensor(data, device=...) then builds on the CPU and moves through the mode.
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        with AcceleratorMode():
            yield ACCELERATOR
    finally:
        torch._C._set_only_lift_cpu_tensors(lift_cpu_only)
