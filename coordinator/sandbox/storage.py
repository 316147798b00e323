"""storage.py: an exec held to its sandbox's storage_mb, measured as it runs.

No backend here enforces a disk quota by itself: podman's `--storage-opt size=` needs overlay
on xfs with project quotas and is refused on ext4 ("overlay.size ... only supported for
backingFS XFS"), and the process and bubblewrap backends have none at all. So the harness's
exec runs under a watch: every POLL_S the sandbox's `storage_used` (a container's writable
layer, a host workspace's blocks) is measured, and once more when the exec ends; over the
limit a running exec is cancelled, which kills it inside. What that means for the execution
is the launcher's to say. Not a quota: a burst between two measurements lands on the disk.
"""

from __future__ import annotations

import asyncio
import logging

from gyre.coordinator.sandbox.base import ExecResult, Sandbox, SandboxError

log = logging.getLogger("gyre.coordinator")
POLL_S = 5.0  # how often a running exec's storage is measured


async def exec_within(sandbox: Sandbox, limit_bytes: int, argv: list[str], **exec_kw) -> tuple[ExecResult | None, int]:
    """`sandbox.exec(argv, **exec_kw)` with the sandbox's storage held to `limit_bytes`.
    Returns (its result, bytes used), the result None when the exec was stopped over the
    limit; used > limit_bytes also when it ended by itself over it."""
    job = asyncio.ensure_future(sandbox.exec(argv, **exec_kw))
    watch = asyncio.ensure_future(_watch(sandbox, limit_bytes))
    try:
        await asyncio.wait({job, watch}, return_when=asyncio.FIRST_COMPLETED)
        if job.done():
            result = job.result()
            return result, await used_bytes(sandbox) or 0
        return None, watch.result()
    finally:
        watch.cancel()
        if not job.done():  # over the limit, or this call cancelled: the exec kills it inside
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)


async def _watch(sandbox: Sandbox, limit_bytes: int) -> int:
    while True:  # returns only when over: a measurement that fails is made again, never trusted
        await asyncio.sleep(POLL_S)
        used = await used_bytes(sandbox)
        if used is not None and used > limit_bytes:
            return used


async def used_bytes(sandbox: Sandbox) -> int | None:
    """The sandbox's `storage_used`, None when it cannot be measured now."""
    try:
        return await sandbox.storage_used()
    except SandboxError as e:
        log.debug("sandbox storage not measured: %s", e)
        return None
