"""Atomic checkpoints, for resuming a run exactly where it stopped.

A checkpoint is ``run_dir/checkpoints/step_XXXXXXXX/`` holding ``state.pt`` (torch.save of
the state dict) and ``manifest.json``. It is written into a hidden temporary sibling,
fsynced, then renamed into place, so a crash at any point leaves either the complete new
checkpoint or none: ``latest_checkpoint`` only considers renamed directories with a
manifest. The manifest records the state file's size and SHA-256, so a truncated or
bit-flipped file is caught on load, and ``load_newest_intact`` falls back to the newest
checkpoint that is whole; a renamed directory whose manifest is damaged counts as a
damaged checkpoint, so damage never looks like a run with nothing saved. One process
(rank 0) writes a run directory.

Loading never runs code from the run directory: ``state.pt`` is read with torch's
weights-only unpickler (tensors, containers, plain values). The SHA-256 protects against
damage, not against a writer, who can rewrite it; so a state file asking to call anything
else (a pickle ``__reduce__`` to ``os.system``) is refused outright with
``UnsafeCheckpointError``, never passed over for an older checkpoint: such a file was
written on purpose, and resuming quietly from another one would hide that the directory
was tampered with.

Exports (``lora/``, ``lora_ema/``) are written the same way (``write_export``): filled in
a temporary sibling, recorded in ``export.json`` with the checkpoint step they come from,
then renamed into place, so a half-written export is never taken for a finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import torch
from torch.serialization import get_unsafe_globals_in_checkpoint

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
EXPORT_RECORD = "export.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step_(\d+)")
_TEMP_PREFIX = ".tmp-"


def _checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in ``path`` durable, not just the files themselves."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write: Callable[[BinaryIO], object]) -> int:
    with open(path, "wb") as handle:
        write(handle)
        handle.flush()
        os.fsync(handle.fileno())
    return path.stat().st_size


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _temporary_sibling(checkpoints: Path, name: str) -> Path:
    return checkpoints / f"{_TEMP_PREFIX}{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any]) -> Path:
    """Write ``state`` as the checkpoint of ``step`` atomically and return its directory.

    An existing checkpoint of the same step is replaced (moved aside first, so a crash
    mid-replacement still leaves the older checkpoints intact).
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if not isinstance(state, dict):
        raise TypeError(f"state must be a dict, got {type(state).__name__}")
    checkpoints = _checkpoints_dir(run_dir)
    checkpoints.mkdir(parents=True, exist_ok=True)
    final = checkpoints / f"step_{step:08d}"
    temporary = _temporary_sibling(checkpoints, final.name)
    temporary.mkdir()
    try:
        size = _write_file(temporary / STATE_FILE, lambda handle: torch.save(state, handle))
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "keys": sorted(str(key) for key in state),
            "files": {STATE_FILE: size},
            "sha256": {STATE_FILE: _sha256(temporary / STATE_FILE)},
            "saved_at": time.time(),
            "torch": torch.__version__,
        }
        text = json.dumps(manifest, indent=2).encode()
        _write_file(temporary / MANIFEST_FILE, lambda handle: handle.write(text))
        _fsync_dir(temporary)
        _replace_directory(temporary, final)
    except OSError as error:  # a full disk: name the checkpoint, not a bare handle
        shutil.rmtree(temporary, ignore_errors=True)
        raise OSError(error.errno, error.strerror or str(error), str(final)) from error
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _remove_leftovers(checkpoints, f"{_TEMP_PREFIX}{final.name}-replaced-")
    return final


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((path / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def _checkpoint_dirs(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every ``step_N`` directory, oldest first, whatever its state.

    Writes happen in temporaries renamed into place whole, so a ``step_N`` directory was
    complete once: one without a readable manifest is damaged, never half-written.
    """
    checkpoints = _checkpoints_dir(run_dir)
    if not checkpoints.is_dir():
        return []
    found = []
    for path in checkpoints.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _complete_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint whose manifest is readable and names its step."""
    return [(step, path) for step, path in _checkpoint_dirs(run_dir) if _manifest_fits(path, step)]


def _manifest_fits(path: Path, step: int) -> bool:
    manifest = _read_manifest(path)
    return manifest is not None and manifest.get("step") == step


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The complete checkpoint with the highest step, or None when there is none."""
    complete = _complete_checkpoints(run_dir)
    return complete[-1][1] if complete else None


def load_checkpoint(path: str | os.PathLike, *, weights_only: bool = True) -> dict[str, Any]:
    """The state saved in checkpoint directory ``path``, with tensors on the CPU.

    ``weights_only`` (torch.load's safe unpickler) accepts tensors, containers and plain
    numbers, which is all a checkpoint holds; a state file that would call anything else
    raises ``UnsafeCheckpointError`` before any of it is unpickled. Pass False only to
    read a checkpoint you wrote yourself (tests, debugging): it can run code.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a checkpoint directory")
    state_file = _checked_state_file(path)
    if weights_only:
        _refuse_unsafe(state_file)
    try:
        state = torch.load(state_file, map_location="cpu", weights_only=weights_only)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CorruptCheckpointError(f"{state_file} cannot be read: {_first_line(error)}") from None
    if not isinstance(state, dict):
        raise CorruptCheckpointError(
            f"{state_file} holds a {type(state).__name__}, not a checkpoint's dict"
        )
    return state


def _checked_state_file(path: Path) -> Path:
    """``path``'s state file, once its manifest, size and SHA-256 agree (damage only)."""
    manifest = _read_manifest(path)
    match = _STEP_DIR.fullmatch(path.name)
    if manifest is None or (match is not None and manifest.get("step") != int(match.group(1))):
        raise CorruptCheckpointError(f"{path / MANIFEST_FILE} is missing or damaged")
    state_file = path / STATE_FILE
    try:
        expected = int(manifest["files"][STATE_FILE])
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptCheckpointError(f"{path / MANIFEST_FILE} is damaged: {error!r}") from None
    if not state_file.is_file() or state_file.stat().st_size != expected:
        raise CorruptCheckpointError(
            f"{state_file} is missing or truncated (manifest says {expected} bytes)"
        )
    checksums = manifest.get("sha256")  # absent in older checkpoints
    checksum = checksums.get(STATE_FILE) if isinstance(checksums, dict) else None
    if checksum is not None and _sha256(state_file) != checksum:
        raise CorruptCheckpointError(f"{state_file} does not match its manifest's SHA-256")
    return state_file


def _first_line(error: BaseException) -> str:
    """torch's unpickling errors run to paragraphs; a refusal is one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    detail = [line for line in lines if "WeightsUnpickler error" not in line]
    if len(lines) > 1 and lines[0].startswith("Weights only load failed"):
        detail = [line for line in lines[1:] if not line.startswith(("Please", "Check"))]
        return "the weights-only unpickler rejects it: " + " ".join(detail)
    return " ".join(detail) or repr(error)


def _refuse_unsafe(state_file: Path) -> None:
    """Raise ``UnsafeCheckpointError`` when unpickling ``state_file`` would call a function
    outside torch's weights-only allowlist. Only the pickle's opcodes are read: nothing
    in it runs. A file that is not a torch zip archive at all is left to torch.load, whose
    weights-only unpickler rejects it as unreadable (damage) without running it either."""
    try:
        unsafe = get_unsafe_globals_in_checkpoint(state_file)
    except (ValueError, RuntimeError, EOFError, pickle.UnpicklingError):
        return
    if unsafe:
        raise UnsafeCheckpointError(
            f"{state_file} was refused: loading it would call {', '.join(sorted(unsafe))}, "
            "and a checkpoint holds only tensors and plain values (it was written to run "
            "code, or by another program); nothing in it was run and no older checkpoint "
            f"was used: delete {state_file.parent} if you do not trust it, or use a new "
            "run.directory"
        )


class CorruptCheckpointError(OSError):
    """A checkpoint directory looks complete but its state file is damaged."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A state file that would call a function when loaded: refused, never passed over."""


class Restored(NamedTuple):
    """The checkpoint a run resumes from, and why each newer one was passed over."""

    path: Path
    state: dict[str, Any]
    passed_over: list[str]


def load_newest_intact(
    run_dir: str | os.PathLike,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> Restored | None:
    """The newest checkpoint that loads (weights only) and passes ``check`` (which raises
    ValueError to reject a state); None when the run has no checkpoint. A damaged latest
    checkpoint must not end a run that an older intact one can resume, and damaged ones
    alone are an error, never a fresh start (a damaged manifest included). An unsafe one
    (``UnsafeCheckpointError``) is raised at once: it is tampering, not damage."""
    passed_over = []
    for _, path in reversed(_checkpoint_dirs(run_dir)):
        try:
            state = load_checkpoint(path)
            if check is not None:
                check(state)
        except UnsafeCheckpointError:
            raise
        except (CorruptCheckpointError, ValueError) as error:
            passed_over.append(f"{path.name}: {error}")
            continue
        return Restored(path, state, passed_over)
    if passed_over:
        raise CorruptCheckpointError(
            f"no intact checkpoint in {_checkpoints_dir(run_dir)} ("
            + "; ".join(passed_over)
            + "); nothing was overwritten: repair or remove them, or use a new run.directory"
        )
    return None


def write_export(final: str | os.PathLike, step: int, write: Callable[[Path], object]) -> Path:
    """Write the export ``final`` (``lora/``) of checkpoint ``step`` atomically.

    ``write`` fills a fresh temporary sibling; its files are fsynced and listed, with
    ``step``, in ``export.json``; then it is renamed into place (an older export moved
    aside first and removed after). A crash leaves the old export or the new one, never a
    half-written folder under the final name, and ``export_is_current`` tells them apart.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(final.parent, f"{_TEMP_PREFIX}{final.name}-")
    temporary = _temporary_sibling(final.parent, final.name)
    try:
        write(temporary)
        files = {path.name: path.stat().st_size for path in sorted(temporary.iterdir())}
        for name in files:
            _fsync_file(temporary / name)
        text = json.dumps({"format": FORMAT_VERSION, "step": step, "files": files}, indent=2)
        _write_file(temporary / EXPORT_RECORD, lambda handle: handle.write(text.encode()))
        _fsync_dir(temporary)
        _replace_directory(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    _remove_leftovers(final.parent, f"{_TEMP_PREFIX}{final.name}-")
    return final


def export_is_current(final: str | os.PathLike, step: int) -> bool:
    """Whether ``final`` is a whole export of checkpoint ``step``: its ``export.json``
    names that step and every file it lists has the recorded size. An export of an
    earlier step (the run went on), a damaged one or one without a record is not."""
    try:
        record = json.loads((Path(final) / EXPORT_RECORD).read_text())
        files = record["files"]
        if record["step"] != step or not files:
            return False
        return all((Path(final) / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def _replace_directory(temporary: Path, final: Path) -> None:
    """Rename ``temporary`` to ``final``, moving an existing ``final`` aside first."""
    replaced = _temporary_sibling(final.parent, final.name + "-replaced")
    if final.exists():
        final.rename(replaced)
    try:
        os.replace(temporary, final)
    except BaseException:
        if replaced.exists():
            replaced.rename(final)
        raise
    _fsync_dir(final.parent)


def _remove_leftovers(checkpoints: Path, prefix: str = _TEMP_PREFIX) -> list[Path]:
    leftovers = [path for path in checkpoints.iterdir() if path.name.startswith(prefix)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    return leftovers


def keep_last(run_dir: str | os.PathLike, n: int) -> list[Path]:
    """Delete all but the newest ``n`` complete checkpoints, and leftover temporaries.

    Each doomed checkpoint is first renamed to a temporary name, so a crash mid-delete
    never leaves a partial directory that looks complete. Returns the removed paths.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be an int >= 1 (never delete the latest), got {n!r}")
    checkpoints = _checkpoints_dir(run_dir)
    if not checkpoints.is_dir():
        return []
    removed = _remove_leftovers(checkpoints)
    for _, path in _complete_checkpoints(run_dir)[:-n]:
        doomed = _temporary_sibling(checkpoints, path.name + "-deleted")
        path.rename(doomed)
        shutil.rmtree(doomed)
        removed.append(path)
    return removed
