"""Read the pickled answers of pickle-speaking reward servers without running their code.

Flow-GRPO's reward-server, and the services built like it, answer with ``pickle.dumps``
of a dict of score lists. ``pickle.loads`` on such a body lets whoever controls the server
(or the network in between) run any code in the trainer: a pickle calls whatever global it
names. This unpickler resolves only the globals that plain data needs:

- the builtins that pickles of sets, frozensets, bytes, bytearrays and complex numbers
  call (bytes never from a size), and ``_codecs.encode`` (protocols 0-2 write bytes as
  latin-1 text), only for latin-1;
- the numpy globals that pickles of arrays and scalars reference (``numpy.dtype``,
  ``numpy.ndarray``, ``_reconstruct``, ``scalar`` and ``_frombuffer`` under numpy 1.x's
  ``numpy.core`` and 2.x's ``numpy._core``). These are not handed out as they are: a pickle
  may give a ``numpy.dtype`` any state it likes, object flags included, and numpy trusts
  it. They resolve to stand-ins that only record what the pickle says; once the load has
  finished, each record becomes a real array through ``numpy.frombuffer`` on a dtype named
  by its string (``"<f4"``), checked to be a bool or number type. Object arrays, string
  arrays, structured and datetime dtypes are refused.

A pickle can do more than call globals: ``BUILD`` sets state on any object it holds,
including a global itself (``setattr`` on a class lasts for the whole process). So no
global resolves to a class or a function: each resolves to an immutable ``_Global``
wrapper (``__slots__``, and a ``__setstate__`` that refuses), and the stand-ins have
``__slots__`` and take only the state numpy's own pickles give them (a dtype's byte order,
an array's shape, dtype and bytes); any other ``BUILD`` is an ``UnpicklingError``.

Before anything is unpickled the opcodes are read once with ``pickletools.genops``: a memo
index (``PUT``, ``BINPUT``, ``LONG_BINPUT``) is at most the number of opcodes, since each
opcode stores at most one value. The C unpickler sizes its memo array by the largest index
it is given, so ``LONG_BINPUT 2**31`` alone would ask for ~32 GiB. (The pure-Python
unpickler keeps its memo in a dict, but it is a private class, ``pickle._Unpickler``, and
runs one Python call per opcode; the scan keeps the C unpickler.)

Everything else, and persistent ids, is refused with ``UnsafePickleError`` before anything
is called.
"""

from __future__ import annotations

import io
import math
import pickle
import pickletools
import re
from collections.abc import Callable
from typing import Any

import numpy as np

from ..base import RewardError

ACCEPTED = "only plain containers, numbers, strings, bytes and numpy arrays are accepted"
# bool, signed and unsigned integers, floats and complex numbers, e.g. "f4", "i8", "b1"
PLAIN_DTYPE = re.compile(r"[biufc]\d{1,2}")
# deeper nesting than any score list needs; stops a crafted body exhausting the stack
MAX_DEPTH = 100


class UnsafePickleError(RewardError):
    """A server's pickle named a global, or a numpy type, that is not plain data."""


def safe_loads(data: bytes, source: str) -> Any:
    """``pickle.loads(data)`` limited to plain data; ``source`` (the server) names the
    sender in the error. Raises ``UnsafePickleError`` for anything else, and pickle's own
    errors (``UnpicklingError``, ``EOFError``, ...) for a body that is not a pickle."""
    _check_memo_indices(data)
    loaded = _RestrictedUnpickler(io.BytesIO(data), source).load()
    return _realized(loaded, source, {}, 0)


_MEMO_PUTS = frozenset({"PUT", "BINPUT", "LONG_BINPUT"})


def _check_memo_indices(data: bytes) -> None:
    """Refuse a memo index beyond the pickle's opcode count (see the module's docstring);
    a body that is not a sequence of opcodes is an ``UnpicklingError`` here too."""
    count, largest = 0, -1
    try:
        for opcode, argument, _ in pickletools.genops(data):
            count += 1
            if opcode.name in _MEMO_PUTS:
                largest = max(largest, argument)
    except ValueError as error:  # genops' own errors: an unknown opcode, truncated data
        raise pickle.UnpicklingError(f"not a pickle: {error}") from None
    if largest >= count:
        raise pickle.UnpicklingError(
            f"memo index {largest} in a pickle of {count} opcodes (a forged memo size)"
        )


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, source: str):
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        module = "builtins" if module == "__builtin__" else module  # protocols 0-2
        if module == "builtins" and name in BUILTINS:
            return BUILTINS[name]
        if (module, name) == ("_codecs", "encode"):
            return _CODECS_ENCODE
        stand_in = _NUMPY.get((re.sub(r"^numpy\._?core\.", "numpy.core.", module), name))
        if stand_in is not None:
            return stand_in
        raise UnsafePickleError(
            f"refused to unpickle {module}.{name} from {self.source}: {ACCEPTED}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(
            f"refused to unpickle a persistent id from {self.source}: {ACCEPTED}"
        )


class _Global:
    """What an accepted global resolves to: calling it calls ``make``; it has no attributes
    to set and refuses ``BUILD``, so a pickle cannot change it (a class or a function would
    take ``setattr``, or new ``__defaults__``, for the rest of the process)."""

    __slots__ = ("_make", "_name")

    def __init__(self, name: str, make: Callable[..., Any]):
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_make", make)

    def __call__(self, *arguments: Any) -> Any:
        return self._make(*arguments)

    def __setattr__(self, name: str, value: Any) -> None:
        raise pickle.UnpicklingError(f"setting {name!r} on {self._name}")

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a pickle gave {self._name} a state (BUILD on a global)")

    def __repr__(self) -> str:
        return f"<accepted global {self._name}>"


def _not_from_a_size(kind: type) -> Callable[..., Any]:
    """``bytes`` or ``bytearray`` as pickles call them (empty, from bytes, from latin-1
    text), never from a size: ``bytearray(10**12)`` asks for a terabyte in 15 bytes."""

    def build(*arguments: Any) -> Any:
        if arguments and isinstance(arguments[0], int):
            raise pickle.UnpicklingError(f"{kind.__name__} of a given size")
        return kind(*arguments)

    return build


BUILTINS = {
    kind.__name__: _Global(f"builtins.{kind.__name__}", kind) for kind in (set, frozenset, complex)
}
BUILTINS |= {
    kind.__name__: _Global(f"builtins.{kind.__name__}", _not_from_a_size(kind))
    for kind in (bytes, bytearray)
}


def _latin1_encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as protocols 0-2 use it for bytes: latin-1 text only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError(f"_codecs.encode with {encoding!r}: not pickled bytes")
    return text.encode("latin-1")


_CODECS_ENCODE = _Global("_codecs.encode", _latin1_encode)


def _never_called(*arguments: Any) -> Any:
    raise pickle.UnpicklingError("numpy.ndarray called: numpy pickles only name it")


# ``numpy.ndarray`` resolves to this marker: it is only ever ``_reconstruct``'s first argument
_NDARRAY = _Global("numpy.ndarray", _never_called)


class _Recorded:
    """What a numpy global was called with, turned into the real value by ``real``. Only
    the attributes in ``__slots__`` exist; ``BUILD`` is refused unless a subclass takes the
    state numpy's pickles give it."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"a pickle gave a numpy {self.kind} a state")

    @property
    def kind(self) -> str:
        return type(self).__name__.strip("_").lower()

    def real(self, source: str) -> Any:
        raise NotImplementedError


class _Dtype(_Recorded):
    """``numpy.dtype(typestr, align, copy)`` and its ``__setstate__``: only the type string
    and the byte order are kept; the rest of the state (flags, fields) is never applied."""

    __slots__ = ("byteorder", "typestr")

    def __init__(self, typestr: Any, align: Any = False, copy: Any = True):
        self.typestr, self.byteorder = typestr, "|"

    def __setstate__(self, state: Any) -> None:
        # (version, byteorder, ...) with 6 to 9 items; numpy's oldest: (byteorder, ...), 5
        if not (isinstance(state, tuple) and 5 <= len(state) <= 9):
            raise pickle.UnpicklingError("a numpy dtype state that numpy does not write")
        self.byteorder = state[0] if len(state) == 5 else state[1]

    def real(self, source: str) -> np.dtype:
        if not (isinstance(self.typestr, str) and PLAIN_DTYPE.fullmatch(self.typestr)):
            what = "object" if str(self.typestr).startswith("O") else repr(self.typestr)
            raise UnsafePickleError(
                f"refused to unpickle a numpy array of dtype {what} from {source}: "
                "only bool and number arrays are accepted"
            )
        if self.byteorder not in ("<", ">", "|", "="):
            raise pickle.UnpicklingError(f"numpy dtype with byte order {self.byteorder!r}")
        dtype = np.dtype(self.typestr)
        return dtype if self.byteorder in ("|", "=") else dtype.newbyteorder(self.byteorder)


class _Array(_Recorded):
    """``_reconstruct(ndarray, ...)`` then ``__setstate__``, or ``_frombuffer(...)``."""

    __slots__ = ("dtype", "fortran", "raw", "shape")

    def __init__(self, shape: Any = (), dtype: Any = None, fortran: Any = False, raw: Any = b""):
        self.shape, self.dtype, self.fortran, self.raw = shape, dtype, fortran, raw

    @classmethod
    def reconstruct(cls, subtype: Any, shape: Any, typecode: Any) -> _Array:
        if subtype is not _NDARRAY:
            raise pickle.UnpicklingError("numpy _reconstruct of something other than ndarray")
        return cls()

    @classmethod
    def frombuffer(cls, buffer: Any, dtype: Any, shape: Any, order: Any) -> _Array:
        return cls(shape, dtype, order == "F", buffer)

    def __setstate__(self, state: Any) -> None:
        # (version, shape, dtype, is_fortran, raw); numpy's oldest pickles lack the version
        if not (isinstance(state, tuple) and len(state) in (4, 5)):
            raise pickle.UnpicklingError("a numpy array state that numpy does not write")
        self.shape, self.dtype, self.fortran, self.raw = state[-4:]

    def real(self, source: str) -> np.ndarray:
        dtype = _real_dtype(self.dtype, source)
        shape = self.shape
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and n >= 0 for n in shape)):
            raise pickle.UnpicklingError(f"numpy array with shape {shape!r}")
        if not isinstance(self.raw, (bytes, bytearray)):  # a list: an object array's items
            raise UnsafePickleError(
                f"refused to unpickle a numpy array of Python objects from {source}: {ACCEPTED}"
            )
        if len(self.raw) != math.prod(shape) * dtype.itemsize:
            raise pickle.UnpicklingError(f"numpy array data does not fill the shape {shape}")
        flat = np.frombuffer(self.raw, dtype=dtype)
        return flat.reshape(shape, order="F" if self.fortran else "C").copy()


class _Scalar(_Recorded):
    """``scalar(dtype, data)``: one numpy number (numpy's pickles give it no state)."""

    __slots__ = ("data", "dtype")

    def __init__(self, dtype: Any, data: Any = b""):
        self.dtype, self.data = dtype, data

    def real(self, source: str) -> np.generic:
        dtype = _real_dtype(self.dtype, source)
        if not isinstance(self.data, bytes) or len(self.data) != dtype.itemsize:
            raise pickle.UnpicklingError("numpy scalar data does not match its dtype")
        return np.frombuffer(self.data, dtype=dtype)[0]


def _real_dtype(dtype: Any, source: str) -> np.dtype:
    if not isinstance(dtype, _Dtype):
        raise pickle.UnpicklingError(f"numpy data with a dtype of type {type(dtype).__name__}")
    return dtype.real(source)


_NUMPY: dict[tuple[str, str], _Global] = {
    ("numpy", "dtype"): _Global("numpy.dtype", _Dtype),
    ("numpy", "ndarray"): _NDARRAY,
    ("numpy.core.multiarray", "_reconstruct"): _Global("_reconstruct", _Array.reconstruct),
    ("numpy.core.multiarray", "scalar"): _Global("numpy scalar", _Scalar),
    ("numpy.core.numeric", "_frombuffer"): _Global("_frombuffer", _Array.frombuffer),
}


def _realized(value: Any, source: str, done: dict[int, Any], depth: int) -> Any:
    """``value`` with every numpy stand-in replaced by the real array or scalar; shared
    and self-referencing containers stay shared (``done``: id -> result)."""
    if id(value) in done:
        return done[id(value)]
    if depth > MAX_DEPTH:
        raise pickle.UnpicklingError(f"nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, _Recorded):
        result = value.real(source)
    elif isinstance(value, _Global) or callable(value):  # a global named but never called
        raise UnsafePickleError(f"refused to unpickle a bare global from {source}: {ACCEPTED}")
    elif isinstance(value, list):
        result = done[id(value)] = []
        result.extend(_realized(item, source, done, depth + 1) for item in value)
    elif isinstance(value, dict):
        result = done[id(value)] = {}
        for key, item in value.items():
            result[_realized(key, source, done, depth + 1)] = _realized(
                item, source, done, depth + 1
            )
    elif isinstance(value, (tuple, set, frozenset)):
        result = type(value)(_realized(item, source, done, depth + 1) for item in value)
    else:
        result = value
    done[id(value)] = result
    return result
