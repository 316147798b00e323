"""engineio.py: calls to a Docker-compatible engine (podman's service, dockerd) off the event
loop: the errors a call can raise, a failed call's connection released, a long call on a
thread of its own, a command's output followed, and a folder tarred for an archive put.
docker_api.py's sandboxes and backend use them; the preflight's ping too. Nothing here knows
a sandbox.
"""

from __future__ import annotations

import asyncio
import tarfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

from gyre.coordinator.sandbox.base import keep_output


def api_error() -> tuple[type[BaseException], ...]:
    import docker.errors
    import requests.exceptions

    return (docker.errors.DockerException, requests.exceptions.RequestException, OSError)


def released(e: BaseException) -> BaseException:
    """`e` with the frames of its traceback chain cleared: a refused connect leaves its socket
    in a frame's locals (docker-py's unix transport), which would otherwise live on with the
    exception and close only at garbage collection."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)
        e = e.__cause__ or e.__context__
    return e


def own_thread(fn, *args) -> asyncio.Future:
    """`fn(*args)` on a thread of its own: an exec streams for as long as the harness runs,
    and a few of them would fill the loop's default executor (cpus + 4 threads) and hold
    every other `to_thread` call behind them."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result=None, error: BaseException | None = None) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def work() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting coroutine
            outcome = (None, e)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    threading.Thread(target=work, name="gyre-sandbox-exec", daemon=True).start()
    return fut


def follow(stream, log: BinaryIO | None, tail: bytearray) -> None:
    """A command's output as it comes: into `log`, else its last OUTPUT_TAIL bytes into `tail`."""
    for chunk in stream:
        keep_output(chunk, log, tail)


def tar_into(f: BinaryIO, src: Path, arcname: str, owners: Mapping[str, tuple[int, int]] | None,
              under: Sequence[str] = ()) -> None:
    """`src` as a tar into `f`: a folder's contents, or the file as `arcname`, below the
    folders `under` (made with entries of their own). With `owners` (path -> uid, gid) each
    entry gets its owner from it, root where it names none; else the host file's."""
    prefix = "".join(f"{part}/" for part in under)

    def own(info: tarfile.TarInfo) -> tarfile.TarInfo:
        if owners is not None:
            info.uid, info.gid = owners.get(info.name[len(prefix):], (0, 0))
            info.uname = info.gname = ""
        return info

    with tarfile.open(fileobj=f, mode="w") as tar:
        for i in range(len(under)):
            folder = tarfile.TarInfo("/".join(under[:i + 1]))
            folder.type, folder.mode = tarfile.DIRTYPE, 0o755
            tar.addfile(folder)
        if src.is_dir():
            for child in sorted(src.iterdir()):
                tar.add(child, arcname=prefix + child.name, filter=own)
        else:
            tar.add(src, arcname=prefix + arcname, filter=own)
