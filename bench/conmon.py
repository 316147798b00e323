"""bench/conmon.py: what executions leave behind on a podman host: exec sessions and `conmon`
monitors (issue 36, finding 10).

Each exec through podman's Docker-compatible API leaves its `conmon` alive about 5 minutes
after it ends, so the monitors a host holds grow with the execs per execution times the
executions per 5 minutes. This runs real executions of a small Harbor task (one proxy call
through the in-container listener, an answer written, tests/test.sh scored) through the
launcher with the podman sandbox, --concurrent at a time for --minutes, and samples
`ps -eo rss,args` for /usr/bin/conmon every --every seconds: their count and RSS, beside the
executions running then (this run's alone: conmon names its container with -n). It counts
the execs and containers each execution made (the Docker API's exec_create and
create_container calls, counted in this process). Not a test. Run:
    python bench/conmon.py [--minutes 5] [--concurrent 4] [--every 10] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from gyre.coordinator.buffer import Execution  # noqa: E402
from gyre.coordinator.launcher import Launcher, LaunchSpec  # noqa: E402
from gyre.coordinator.sandbox import Limits  # noqa: E402
from gyre.coordinator.sandbox.podman import PodmanBackend  # noqa: E402
from gyre.coordinator.taskformats import load_harbor_task  # noqa: E402
from gyre.coordinator.waterlevel import Tracked  # noqa: E402
from gyre.proxy.chat import ChatTokenizer  # noqa: E402
from gyre.proxy.server import ProxyConfig, ProxyServer  # noqa: E402
from gyre.workerd.modeldir import init_tiny  # noqa: E402
from tests.sandbox.conftest import CALL_PROXY, harbor_task, shell_preset  # noqa: E402
from tests.scripted import ScriptedEngine  # noqa: E402
from tests.support import ThreadEngineBackend  # noqa: E402

AGENT = CALL_PROXY + "echo 42 > answer.txt\n"
TEST_SH = 'if [ "$(cat /app/answer.txt)" = 42 ]; then echo 1 > /logs/verifier/reward.txt; ' \
          'else echo 0 > /logs/verifier/reward.txt; fi\n'


def conmons(tag: str = "") -> tuple[int, float]:
    """(processes, their RSS in MiB) of /usr/bin/conmon on this host; with `tag`, only those
    of containers named gyre-TAG... (this run's: conmon names its container with -n)."""
    out = subprocess.run(["ps", "-eo", "rss,args"], capture_output=True, text=True).stdout.splitlines()
    rss = [int(line.split(None, 1)[0]) for line in out[1:]
           if "/usr/bin/conmon" in line and (not tag or f" -n gyre-{tag}" in line)]
    return len(rss), sum(rss) / 1024


class Counted:
    """The Docker API's exec_create and create_container calls of one client, counted."""

    def __init__(self, api):
        self.execs = self.containers = 0
        exec_create, create_container = api.exec_create, api.create_container

        def counted_exec(*a, **kw):
            self.execs += 1
            return exec_create(*a, **kw)

        def counted_create(*a, **kw):
            self.containers += 1
            return create_container(*a, **kw)

        api.exec_create, api.create_container = counted_exec, counted_create


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--concurrent", type=int, default=4)
    ap.add_argument("--every", type=float, default=10.0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gyre-conmon-"))
    tokenizer = ChatTokenizer(init_tiny(root / "tiny", seed=0))
    engine = ThreadEngineBackend(ScriptedEngine(tokenizer, tokens_per_step=16), sampling_cls=lambda **kw: kw)
    proxy = ProxyServer(tokenizer, engine, ProxyConfig(max_context=1 << 16), run_dir=root / "run")
    await proxy.start()
    backend = PodmanBackend()
    await backend.open()
    counted = Counted(backend.client.api)
    preset = shell_preset(AGENT)
    spec = LaunchSpec(preset=preset, timeout_s=120, eval_attempts=1, eval_budget_s=120, limits=Limits(pids=512))
    launcher = Launcher(proxy, root / "run", spec, backend=backend)
    task = load_harbor_task(harbor_task(root, "conmon", test_sh=TEST_SH))
    await launcher.prepare(task)
    idle, tag = conmons(), f"cm{secrets.token_hex(3)}"
    print(f"idle: {idle[0]} conmon on the host, {idle[1]:.1f} MiB (counted below: this run's alone)", flush=True)
    done, running, samples, statuses = 0, 0, [], {}
    stop_at = time.monotonic() + args.minutes * 60

    async def worker(w: int) -> None:
        nonlocal done, running
        n = 0
        while time.monotonic() < stop_at:
            run = Execution(id=f"{tag}-{w}-{n}", group=0, index=0, task=task, tracked=Tracked(), version_dispatched=0)
            running += 1
            try:
                await launcher.run(run)
            finally:
                running -= 1
            statuses[run.status] = statuses.get(run.status, 0) + 1
            done, n = done + 1, n + 1

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop_at:
            await asyncio.sleep(args.every)
            count, mib = conmons(tag)
            samples.append({"t_s": round(time.monotonic() - t0), "conmon": count, "conmon_mib": round(mib, 1),
                            "running": running, "executions": done})
            print(json.dumps(samples[-1]), flush=True)

    await asyncio.gather(sampler(), *(worker(w) for w in range(args.concurrent)))
    last = samples[-max(1, len(samples) // 3):]  # the last third: past the first 5-minute wave
    summary = {
        "minutes": args.minutes, "concurrent": args.concurrent, "executions": done, "statuses": statuses,
        "execs_per_execution": round(counted.execs / max(done, 1), 2),
        "containers_per_execution": round(counted.containers / max(done, 1), 2),
        "host_conmon_at_start": idle[0], "host_conmon_mib_at_start": round(idle[1], 1),
        "conmon_median_last_third": statistics.median(s["conmon"] for s in last),
        "conmon_mib_median_last_third": statistics.median(s["conmon_mib"] for s in last),
        "conmon_per_running_execution": round(statistics.median(
            s["conmon"] / max(s["running"], 1) for s in last), 1),
        "conmon_mib_per_running_execution": round(statistics.median(
            s["conmon_mib"] / max(s["running"], 1) for s in last), 2),
        "samples": samples,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "samples"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    await backend.close()
    await proxy.stop()
    engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
