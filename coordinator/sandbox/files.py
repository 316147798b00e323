"""files.py: files out of a sandbox onto the host, safely: never through a link, under a cap.

A container's files come as a tar stream (get_archive) and are extracted here entry by
entry as they stream: an entry the "data" filter refuses (a link to an absolute path or out
of the copy, a device, a name that escapes) is left out and named, a link that stays inside
is made as a link, nothing is ever written through one that leads out, and the copy stops at
its cap, closing the stream; owners other than root are noted in the report, for a copy put
back (the verifier's sandbox). A host folder (the process backend) is copied the same way.
Each returns a CopyReport; what to do with it is the launcher's. Not the engine calls.
"""

from __future__ import annotations

import io
import os
import shutil
import tarfile
import tempfile
from pathlib import Path, PurePosixPath

from gyre.coordinator.sandbox.base import COPY_LIMIT_BYTES, CopyReport, SandboxError

ENTRY_COST = 512  # every archive entry counts a header block against a download's cap


class _Chunks(io.RawIOBase):
    """An archive stream's chunks as the file tarfile reads in order (mode "r|")."""

    def __init__(self, chunks):
        self._chunks = iter(chunks)
        self._buf = b""

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while not self._buf:
            self._buf = next(self._chunks, b"")
            if not self._buf:
                return 0
        n = min(len(b), len(self._buf))
        b[:n], self._buf = self._buf[:n], self._buf[n:]
        return n


def first_file(chunks, limit: int) -> bytes | None:
    """The first `limit` bytes of a get_archive stream's one entry when it is a regular file;
    None when it is anything else, or the archive is cut."""
    try:
        with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks)), mode="r|") as tar:
            for member in tar:
                f = tar.extractfile(member) if member.isfile() else None
                return f.read(limit) if f is not None else None
    except (tarfile.TarError, OSError):
        return None
    return None


def untar_capped(chunks, dest: Path, is_dir: bool, limit: int = COPY_LIMIT_BYTES) -> CopyReport:
    """Extract a get_archive stream (one top-level entry) as `dest`: a folder's contents into
    it, a file as it. Entry by entry, as it streams: what the "data" filter refuses (a link
    to an absolute path or out of the copy, a device, a name that escapes) is left out and
    named in the report, links that stay inside are made as links and nothing is ever
    written through one that leads out; the copy stops at `limit` bytes."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gyre-dl-", dir=dest.parent))  # same filesystem: moved, not copied
    report, top = CopyReport(), None
    try:
        try:
            with tarfile.open(fileobj=io.BufferedReader(_Chunks(chunks), 1 << 16), mode="r|") as tar:
                for member in tar:
                    parts = PurePosixPath(member.name.lstrip("/")).parts  # "/bin", "./bin": ("bin",)
                    if top is None:  # the first entry is the one copied: "app", or "" for a copy of "/"
                        top = parts[0] if parts else ""
                    if not parts:
                        continue  # the root of a copy of "/"
                    if top and parts[0] != top:
                        report.skip(f"{member.name}: outside the copied entry")
                        continue
                    member.name = "/".join(parts)
                    _note_owner(member, parts[1:] if top else parts, report)
                    if not _extract(tar, member, tmp, report, limit):
                        break
        except tarfile.TarError as e:
            raise SandboxError(f"unreadable archive: {e}") from None
        got = None if top is None else tmp / top if top else tmp
        if got is None or not (got.is_dir() if is_dir else got.is_file() or got.is_symlink()):
            if not is_dir:  # the file itself was left out (a link out of the sandbox, a device)
                raise FileNotFoundError(f"{dest.name}: not a plain file ({'; '.join(report.skipped) or 'empty'})")
            got = tmp / ".empty"
            got.mkdir()
        if is_dir and dest.is_dir():
            shutil.copytree(got, dest, dirs_exist_ok=True, symlinks=True)
        else:
            os.replace(got, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return report


def _note_owner(member: tarfile.TarInfo, inside: tuple[str, ...], report: CopyReport) -> None:
    """An entry's owner where it is not root's, by its path inside the copy: the files here
    belong to whoever copied them, and the copy put back (the verifier's sandbox) needs the
    owners the agent's files had (an image that runs as a user)."""
    if inside and (member.uid or member.gid):
        report.owners["/".join(inside)] = (member.uid, member.gid)


def _extract(tar: tarfile.TarFile, member: tarfile.TarInfo, root: Path, report: CopyReport, limit: int) -> bool:
    """One entry into `root`; False once the cap is reached (the copy stops there). Each
    entry costs its content and a header block (ENTRY_COST), so a million empty files is no
    cheaper than their archive."""
    try:
        safe = tarfile.data_filter(member, str(root))
    except tarfile.FilterError as e:
        report.skip(str(e))
        return True
    room = limit - report.bytes
    if room <= 0:
        report.truncated = True
        return False
    try:
        written = _make(tar, member, safe, root, room)
    except OSError as e:  # an entry that clashes with an earlier one (a file where a folder was)
        report.skip(f"{safe.name}: {e.strerror or e}")
        return True
    if written is None:
        report.skip(f"{safe.name}: not a file, folder or link")
        return True
    report.bytes += written + ENTRY_COST
    if written < (safe.size if safe.isreg() else 0):
        report.truncated = True
        return False
    return True


def _make(tar: tarfile.TarFile, member: tarfile.TarInfo, safe: tarfile.TarInfo, root: Path, room: int) -> int | None:
    """Create one filtered entry under `root`; the bytes of content written (at most `room`),
    None for a kind it does not make."""
    target, linked = root / safe.name, root / (safe.linkname or ".")
    if not safe.isdir():
        target.parent.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(target) and not target.is_dir():
            target.unlink()  # a later entry of the same name replaces it, never writes through it
    written = 0
    if safe.isdir():
        target.mkdir(parents=True, exist_ok=True)
    elif safe.isreg():
        src = tar.extractfile(member)
        with open(target, "xb") as out:  # "x": created here, never an existing file or link followed
            while written < min(safe.size, room) and (chunk := src.read(min(room - written, 1 << 20))):
                out.write(chunk)
                written += len(chunk)
        if safe.mode is not None:
            os.chmod(target, safe.mode)
    elif safe.issym():
        os.symlink(safe.linkname, target)
    elif safe.islnk() and linked.is_file() and not linked.is_symlink():  # the filter kept it inside
        os.link(linked, target)
    else:
        return None
    return written


def copy_capped(src: Path, dest: Path, limit: int = COPY_LIMIT_BYTES) -> CopyReport:
    """Copy a host file or folder, links as links (never read through), special files left
    out, stopping after `limit` bytes of file content."""
    report = CopyReport()
    if not os.path.lexists(src):
        raise FileNotFoundError(str(src))
    if not src.is_dir() or src.is_symlink():
        dest.parent.mkdir(parents=True, exist_ok=True)
        _copy_one(src, dest, report, limit)
        return report
    for here, dirs, files in os.walk(src):  # os.walk does not descend into linked folders
        rel = Path(here).relative_to(src)
        (dest / rel).mkdir(parents=True, exist_ok=True)
        for name in sorted(files) + sorted(d for d in dirs if Path(here, d).is_symlink()):
            if not _copy_one(Path(here, name), dest / rel / name, report, limit):
                return report
    return report


def _copy_one(src: Path, dest: Path, report: CopyReport, limit: int) -> bool:
    if src.is_symlink():
        if os.path.lexists(dest):
            dest.unlink()
        os.symlink(os.readlink(src), dest)
        return True
    if not src.is_file():
        report.skip(f"{src.name}: not a file, folder or link")
        return True
    room = limit - report.bytes
    if os.path.lexists(dest) and dest.is_symlink():
        dest.unlink()  # written here, never through a link
    with open(src, "rb") as f, open(dest, "wb") as out:
        while room > 0 and (chunk := f.read(min(room, 1 << 20))):
            out.write(chunk)
            room -= len(chunk)
            report.bytes += len(chunk)
        more = bool(f.read(1))
    shutil.copymode(src, dest)
    report.truncated = more
    return not more
