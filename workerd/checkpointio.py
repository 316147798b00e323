"""checkpointio.py: a trainer's checkpoint file, written whole or not at all.

`torch.save` to a path reports a full disk as `unexpected pos 877120 vs 877008` (its C++
writer drops the errno), and leaves its half-written file behind. Here the file is written
through a Python file object, whose `write` keeps the OSError, to `PATH.tmp`; then fsynced,
renamed over PATH and the folder fsynced, so a checkpoint the coordinator declares complete
survives a power cut. Any failure removes the `.tmp` and is one line naming the path and
the errno ("no space left on device (ENOSPC)"). Not which files a checkpoint holds: the
trainers say (trainers/cpu.py, megatron_state.py).
"""

from __future__ import annotations

import errno as errnos
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gyre.workerd.wire import GyreError


class CheckpointWriteError(GyreError):
    """A checkpoint file that could not be written; the message names the path and the errno."""


class _Recording:
    """A file's `write` that keeps the first OSError: torch's writer replaces it with its own message."""

    def __init__(self, f: IO[bytes]):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def save(obj: Any, path: Path | str) -> None:
    """`torch.save(obj)` to `path`, atomically and durably (see the module's docstring)."""
    import torch

    def dump(f: IO[bytes]) -> None:
        rec = _Recording(f)
        try:
            torch.save(obj, rec)
        except RuntimeError:
            if rec.error is not None:
                raise rec.error from None
            raise

    write(path, dump)


def write(path: Path | str, dump: Callable[[IO[bytes]], None]) -> None:
    """`dump(f)` into `path`'s `.tmp`, fsynced, renamed over `path`, the folder fsynced."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as f:
            dump(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        sync_dir(path.parent)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise CheckpointWriteError(named(path, e)) from None
        raise


def commit(tmp: Path | str, path: Path | str) -> None:
    """A file written by another library (Megatron's optimizer state) to `tmp`: fsynced,
    renamed over `path`, the folder fsynced; `tmp` removed and the errno named on failure."""
    tmp, path = Path(tmp), Path(path)
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        sync_dir(path.parent)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise CheckpointWriteError(named(path, e)) from None


def sync_dir(folder: Path) -> None:
    """The folder's entries (a rename into it) on disk."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def named(path: Path, e: OSError) -> str:
    """'cannot write the checkpoint PATH: no space left on device (ENOSPC)'."""
    if e.errno is None:
        return f"cannot write the checkpoint {path}: {e}"
    text, code = os.strerror(e.errno), errnos.errorcode.get(e.errno, e.errno)
    return f"cannot write the checkpoint {path}: {text[:1].lower()}{text[1:]} ({code})"


def no_space(path: Path) -> bool:
    """Whether the filesystem holding `path` has no block left for an ordinary user: where a
    library that drops the errno (Megatron's optimizer state) failed to write there."""
    try:
        return os.statvfs(path).f_bavail == 0
    except OSError:
        return False
