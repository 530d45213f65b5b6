"""The restricted unpickler: plain data and numpy numbers load as ``pickle.loads`` would;
anything that would call code is refused before it runs."""

from __future__ import annotations

import builtins
import io
import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from mogradient_diffusion.rewards.base import RewardError
from mogradient_diffusion.rewards.remote.safe_pickle import UnsafePickleError, safe_loads

SERVER = "http://127.0.0.1:18085"
PROTOCOLS = range(pickle.HIGHEST_PROTOCOL + 1)
ARRAYS = [
    np.linspace(0, 1, 5, dtype=np.float32),
    np.linspace(0, 1, 6).reshape(2, 3),
    np.asfortranarray(np.arange(6, dtype=np.int64).reshape(2, 3)),
    np.array([True, False]),
    np.arange(3, dtype=">f8"),
    np.zeros((0, 4), dtype=np.uint8),
]
SCALARS = [np.float32(0.25), np.float64(-1.5), np.int64(7), np.bool_(True), np.complex64(1j)]
PLAIN = {
    "outputs": [0.5, 1, True, None, 2**70, 1 + 2j],
    "text": ("é", b"\x00\xff", bytearray(b"ab")),
    "sets": [{1, 2}, frozenset({"a"})],
}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_plain_data_and_numpy_numbers_load_as_pickle_does(protocol: int) -> None:
    assert safe_loads(pickle.dumps(PLAIN, protocol=protocol), SERVER) == PLAIN
    for array in ARRAYS:
        loaded = safe_loads(pickle.dumps({"scores": array}, protocol=protocol), SERVER)["scores"]
        assert type(loaded) is np.ndarray and loaded.dtype == array.dtype
        assert loaded.shape == array.shape and np.array_equal(loaded, array)
    for scalar in SCALARS:
        loaded = safe_loads(pickle.dumps(scalar, protocol=protocol), SERVER)
        assert type(loaded) is type(scalar) and loaded == scalar


# every global pickles of plain data and numpy numbers name, numpy 2's spelling
ACCEPTED_GLOBALS = {
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "bytearray"),
    ("builtins", "bytes"),
    ("builtins", "complex"),
    ("_codecs", "encode"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy._core.numeric", "_frombuffer"),
}


def test_the_accepted_globals_are_those_this_numpy_pickles_name() -> None:
    named = set()

    class Recording(pickle.Unpickler):
        def find_class(self, module, name):
            named.add((module.replace("__builtin__", "builtins"), name))
            return super().find_class(module, name)

    for protocol in PROTOCOLS:
        for value in [PLAIN, *ARRAYS, *SCALARS]:
            Recording(io.BytesIO(pickle.dumps(value, protocol=protocol))).load()
    assert named == ACCEPTED_GLOBALS
    numpy1 = pickle.dumps(np.float32(0.5), protocol=2).replace(b"numpy._core", b"numpy.core")
    assert b"numpy.core.multiarray" in numpy1
    assert safe_loads(numpy1, SERVER) == np.float32(0.5)


class Runs:
    """Pickles as ``function(*arguments)``: what a malicious server would send."""

    def __init__(self, function, *arguments):
        self.function, self.arguments = function, arguments

    def __reduce__(self):
        return self.function, self.arguments


@pytest.mark.parametrize("protocol", [0, 2, pickle.HIGHEST_PROTOCOL])
def test_code_in_a_pickle_is_refused_without_running(protocol: int, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    payloads = {
        "posix.system": Runs(os.system, f"touch {marker}"),
        "builtins.eval": Runs(builtins.eval, f"open({str(marker)!r}, 'w')"),
        "builtins.exec": Runs(builtins.exec, f"open({str(marker)!r}, 'w')"),
        "builtins.getattr": Runs(getattr, "os", "system"),
        "io.open": Runs(open, str(marker), "w"),
    }
    for name, payload in payloads.items():
        body = pickle.dumps({"outputs": [0.5], "extra": payload}, protocol=protocol)
        with pytest.raises(UnsafePickleError) as refused:
            safe_loads(body, SERVER)
        message = str(refused.value)
        assert message.startswith(f"refused to unpickle {name} from {SERVER}: only plain")
        assert "\n" not in message and isinstance(refused.value, RewardError)
    assert not marker.exists()


def test_a_persistent_id_is_refused() -> None:
    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return "secret" if obj == "x" else None

    body = io.BytesIO()
    Pickler(body, protocol=2).dump(["x"])
    with pytest.raises(UnsafePickleError, match="a persistent id from"):
        safe_loads(body.getvalue(), SERVER)


@pytest.mark.parametrize(
    ("value", "refused"),
    [
        (np.array([1, "a"], dtype=object), "dtype object"),
        (np.array(["text"]), "dtype 'U"),
        (np.zeros(2, dtype=[("a", "f4")]), "dtype 'V4'"),
        (np.array(["2020-01-01"], dtype="datetime64[D]"), "dtype 'M8'"),
    ],
)
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_arrays_of_anything_but_numbers_are_refused(value, refused: str, protocol: int) -> None:
    with pytest.raises(UnsafePickleError, match=refused):
        safe_loads(pickle.dumps({"scores": value}, protocol=protocol), SERVER)


def test_a_dtype_state_forging_object_flags_is_never_applied() -> None:
    """numpy.dtype.__setstate__ takes its flags from the pickle (1: "holds Python objects")
    and numpy trusts them; the unpickler keeps only a dtype's type string and byte order."""

    class Forging(pickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, np.dtype):
                return np.dtype, ("f8", False, True), (3, "<", None, None, None, -1, -1, 1)
            return NotImplemented

    def forged(value) -> bytes:
        body = io.BytesIO()
        Forging(body, protocol=2).dump(value)
        return body.getvalue()

    assert pickle.loads(forged(np.dtype("f8"))).hasobject  # what numpy would make of it
    loaded = safe_loads(forged({"scores": np.zeros(3)}), SERVER)["scores"]
    assert not loaded.dtype.hasobject and np.array_equal(loaded, np.zeros(3))


def test_other_codecs_and_bare_globals_are_refused() -> None:
    with pytest.raises(pickle.UnpicklingError, match="not pickled bytes"):
        safe_loads(pickle.dumps(Runs(__import__("_codecs").encode, "x", "rot13")), SERVER)
    with pytest.raises(pickle.UnpicklingError, match="bytearray of a given size"):
        safe_loads(pickle.dumps(Runs(bytearray, 10**12)), SERVER)
    with pytest.raises(UnsafePickleError, match="bare global"):
        safe_loads(pickle.dumps([set]), SERVER)
    deep: list = []
    for _ in range(150):
        deep = [deep]
    with pytest.raises(pickle.UnpicklingError, match="nested deeper"):
        safe_loads(pickle.dumps(deep), SERVER)


def short_text(text: str) -> bytes:
    return pickle.SHORT_BINUNICODE + bytes([len(text)]) + text.encode()


def global_op(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def build_on(target: bytes, state: bytes) -> bytes:
    """A protocol 2 pickle: ``target`` given ``state`` by BUILD, then ``{}`` as the result
    (what a server's answer would look like)."""
    body = pickle.PROTO + b"\x02" + target + state + pickle.BUILD + pickle.POP
    return body + pickle.EMPTY_DICT + pickle.STOP


# (None, {"real": numpy.dtype}): BUILD's slot state, applied with setattr
SLOT_STATE = (
    pickle.NONE
    + pickle.EMPTY_DICT
    + short_text("real")
    + global_op("numpy", "dtype")
    + pickle.SETITEM
    + pickle.TUPLE2
)
DICT_STATE = pickle.EMPTY_DICT + short_text("x") + pickle.NONE + pickle.SETITEM


@pytest.mark.parametrize("state", [SLOT_STATE, DICT_STATE], ids=["slots", "dict"])
@pytest.mark.parametrize(("module", "name"), sorted(ACCEPTED_GLOBALS))
def test_build_on_an_accepted_global_is_refused_and_changes_nothing(
    module: str, name: str, state: bytes
) -> None:
    """The reviewer's 60-byte pickle set ``real`` on the numpy scalar stand-in's class for
    the whole process; after it, honest scalars from any server came back as stand-ins."""
    attack = build_on(global_op(module, name), state)
    with pytest.raises(pickle.UnpicklingError, match="BUILD on a global"):
        safe_loads(attack, SERVER)
    for protocol in (2, pickle.HIGHEST_PROTOCOL):  # later honest loads are intact
        for scalar in SCALARS:
            loaded = safe_loads(pickle.dumps(scalar, protocol=protocol), SERVER)
            assert type(loaded) is type(scalar) and loaded == scalar
        loaded = safe_loads(pickle.dumps(ARRAYS[1], protocol=protocol), SERVER)
        assert type(loaded) is np.ndarray and np.array_equal(loaded, ARRAYS[1])


def test_build_on_a_numpy_stand_in_takes_only_numpys_own_state() -> None:
    dtype = global_op("numpy", "dtype") + short_text("f8") + pickle.TUPLE1 + pickle.REDUCE
    scalar = (
        global_op("numpy.core.multiarray", "scalar")
        + dtype
        + pickle.SHORT_BINBYTES
        + bytes([8])
        + bytes(8)
        + pickle.TUPLE2
        + pickle.REDUCE
    )
    assert safe_loads(pickle.PROTO + b"\x02" + scalar + pickle.STOP, SERVER) == 0.0
    with pytest.raises(pickle.UnpicklingError, match="gave a numpy scalar a state"):
        safe_loads(build_on(scalar, SLOT_STATE), SERVER)
    with pytest.raises(pickle.UnpicklingError, match="dtype state that numpy does not write"):
        safe_loads(build_on(dtype, SLOT_STATE), SERVER)
    with pytest.raises(pickle.UnpicklingError, match="dtype state that numpy does not write"):
        safe_loads(build_on(dtype, DICT_STATE), SERVER)


def test_a_forged_memo_index_is_refused_before_unpickling() -> None:
    """``}`` then ``LONG_BINPUT 2**24``: 9 bytes that made the C unpickler allocate 256 MB
    for its memo (``2**31``: ~32 GiB)."""
    for index in (2**24, 2**31):
        bomb = pickle.PROTO + b"\x02" + pickle.EMPTY_DICT + pickle.LONG_BINPUT
        bomb += index.to_bytes(4, "little") + pickle.STOP
        assert len(bomb) == 9
        with pytest.raises(pickle.UnpicklingError, match=f"memo index {index} in a pickle of"):
            safe_loads(bomb, SERVER)
    text = b"(dp99999999\n."  # protocol 0's PUT, a decimal index
    with pytest.raises(pickle.UnpicklingError, match="memo index 99999999"):
        safe_loads(text, SERVER)
    with pytest.raises(pickle.UnpicklingError, match="not a pickle"):
        safe_loads(b"\x80\x02\xff.", SERVER)
