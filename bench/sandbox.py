"""bench/sandbox.py: what a sandbox costs: start-to-first-command latency, 16 concurrent
starts, idle memory per sandbox, and the proxy round-trip through the namespace listener.

For each backend (process, bubblewrap, podman; each skipped, saying why, where it cannot
run): the time from `create` to the end of the first `exec` of `true`, measured --repeat
times one after another (median, p95), then 16 sandboxes started at once (wall time, and
each one's latency); with those 16 idle, the memory they hold (podman: each container's
cgroup memory plus its conmon's RSS; bubblewrap: the holder processes' RSS; process:
nothing runs while idle). The round-trip: an HTTP GET answered by a small aiohttp server
on the host, timed by a client in the sandbox through gyre's listener in the sandbox's
network namespace (workerd/netns.py), against the same client run on the host straight to
the server; the ratio is the listener's price. Not a test. Run:
    python bench/sandbox.py [--repeat 10] [--concurrent 16] [--requests 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from aiohttp import web

from gyre.coordinator.sandbox import Limits, SandboxError, SandboxSpec, images, make_backend
from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER, LABEL_PROCESS, LABEL_RUN_DIR, process_label
from gyre.workerd.netns import ProxyRelay

OWNER = "bench-sandbox"
CLIENT = r'''
import json, sys, time, urllib.request
url, n = sys.argv[1], int(sys.argv[2])
times = []
for _ in range(n):
    t = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as r:
        r.read()
    times.append(time.perf_counter() - t)
print(json.dumps(times))
'''


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def why_not(name: str) -> str | None:
    if name == "process":
        return None
    if os.geteuid() != 0:
        return "needs root"
    if name == "bubblewrap" and shutil.which("bwrap") is None:
        return "bwrap is not installed"
    if name == "podman" and shutil.which("podman") is None:
        return "podman is not installed"
    return None


class Bench:
    def __init__(self, name: str, root: Path):
        self.name = name
        self.root = root
        self.backend = make_backend(name)
        self.n = 0

    def spec(self) -> SandboxSpec:
        self.n += 1
        ex = f"{self.name}-{self.n}"
        labels = {LABEL_OWNER: OWNER, LABEL_RUN_DIR: str(self.root), LABEL_EXECUTION: ex,
                  LABEL_PROCESS: process_label()}  # a run starting meanwhile leaves them alone
        if self.backend.needs_image:
            return SandboxSpec(execution=ex, labels=labels, image=images.BASE_IMAGE, limits=Limits(pids=256))
        return SandboxSpec(execution=ex, labels=labels, workdir=str(self.root / ex / "workspace"))

    async def start(self):
        t = time.perf_counter()
        box = await self.backend.create(self.spec())
        r = await box.exec(["true"], timeout_s=60)
        if r.code != 0:
            raise SandboxError(f"{self.name}: `true` exited {r.code}: {r.output[-300:]!r}")
        return box, time.perf_counter() - t

    def idle_mb(self, boxes) -> float | None:
        if self.name == "process":
            return 0.0
        if self.name == "bubblewrap":
            return sum(rss_mb(b.holder.pid) + rss_mb(b.child) for b in boxes) / len(boxes)
        total = 0.0
        for b in boxes:
            stats = b.container.stats(stream=False)
            total += stats.get("memory_stats", {}).get("usage", 0) / 2**20
            total += sum(rss_mb(p) for p in conmon_pids(b.container.id))
        return total / len(boxes)


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def conmon_pids(container_id: str) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and cmd[0].endswith(b"conmon") and container_id.encode() in b" ".join(cmd):
            out.append(int(d.name))
    return out


async def round_trip(bench: Bench, box, requests: int) -> dict:
    app = web.Application()
    app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "m"}]}))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    relay = None
    try:
        direct = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", CLIENT,
                                                          f"http://127.0.0.1:{port}/v1/models", str(requests)],
                                         capture_output=True, text=True, timeout=300)
        direct_t = json.loads(direct.stdout)
        url = f"http://127.0.0.1:{port}/v1/models"
        if bench.backend.isolated_network:
            relay = ProxyRelay("127.0.0.1", port)
            inner = await relay.start(box.netns_pid())
            url = f"http://127.0.0.1:{inner}/v1/models"
        py = "python3" if bench.backend.needs_image else sys.executable
        r = await box.exec([py, "-c", CLIENT, url, str(requests)], timeout_s=300)
        inside_t = json.loads(r.output.decode().strip().splitlines()[-1])
    finally:
        if relay is not None:
            await relay.close()
        await runner.cleanup()
    d, i = statistics.median(direct_t) * 1e3, statistics.median(inside_t) * 1e3
    return {"direct_ms": d, "inside_ms": i, "ratio": i / d, "inside_p95_ms": pct(inside_t, 0.95) * 1e3}


async def run_backend(name: str, args, root: Path) -> dict:
    bench = Bench(name, root / name)
    await bench.backend.open()
    try:
        if bench.backend.needs_image:
            await images.ensure_base(bench.backend)
        box, _ = await bench.start()  # warm: the image's layers and the engine's caches
        await box.stop()
        serial = []
        for _ in range(args.repeat):
            box, dt = await bench.start()
            serial.append(dt)
            await box.stop()
        t = time.perf_counter()
        started = await asyncio.gather(*(bench.start() for _ in range(args.concurrent)))
        wall = time.perf_counter() - t
        boxes = [b for b, _ in started]
        each = [dt for _, dt in started]
        try:
            idle = bench.idle_mb(boxes)
            rt = await round_trip(bench, boxes[0], args.requests)
        finally:
            await asyncio.gather(*(b.stop() for b in boxes))
        return {"backend": name, "start_median_s": statistics.median(serial), "start_p95_s": pct(serial, 0.95),
                "concurrent": args.concurrent, "concurrent_wall_s": wall,
                "concurrent_median_s": statistics.median(each),
                "concurrent_p95_s": pct(each, 0.95), "idle_mb": idle, **{f"rt_{k}": v for k, v in rt.items()}}
    finally:
        await bench.backend.reap(lambda labels: labels.get(LABEL_OWNER) != OWNER)
        await bench.backend.close()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--concurrent", type=int, default=16)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--backends", default="process,bubblewrap,podman")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="gyre-bench-sandbox-") as tmp:
        for name in args.backends.split(","):
            why = why_not(name)
            if why:
                print(f"{name}: skipped ({why})")
                continue
            try:
                rows.append(await run_backend(name, args, Path(tmp)))
            except SandboxError as e:
                print(f"{name}: failed: {e}")
    base = next((r for r in rows if r["backend"] == "process"), None)
    print(f"\nstart = create + first `exec true`; {args.repeat} one after another, then {args.concurrent} at once; "
          f"round-trip = median of {args.requests} GETs")
    print(f"{'backend':<11} {'start med':>9} {'p95':>7} {'x proc':>7} | {args.concurrent} at once: {'wall':>6} "
          f"{'med':>6} {'p95':>6} | {'idle MB':>7} | {'rt direct':>9} {'inside':>7} {'ratio':>6}")
    for r in rows:
        x = r["start_median_s"] / base["start_median_s"] if base else float("nan")
        idle = "n/a" if r["idle_mb"] is None else f"{r['idle_mb']:.1f}"
        print(f"{r['backend']:<11} {r['start_median_s']:>8.3f}s {r['start_p95_s']:>6.3f}s {x:>6.1f}x | "
              f"{'':>10}{r['concurrent_wall_s']:>6.2f}s {r['concurrent_median_s']:>5.2f}s "
              f"{r['concurrent_p95_s']:>5.2f}s | "
              f"{idle:>7} | {r['rt_direct_ms']:>7.3f}ms {r['rt_inside_ms']:>5.3f}ms {r['rt_ratio']:>5.2f}x")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
