"""serve.py: `gyre serve`: the proxy plus one local workerd, recording one execution.

Without `--harness` it prints one JSON line (`base_url`, `api_key`, `run_dir`) so any
harness can be pointed at it, then serves until SIGINT/SIGTERM. With `--harness NAME
--task TEXT` it runs that preset's harness once in a fresh workspace under the run
directory (the launcher's path: key, environment, deadline), prints one JSON summary line
and exits 0 when the harness completed. Either way the calls form one execution whose
records land in RUN_DIR/executions/<execution>/, for `gyre inspect`. Not the RL loop:
nothing trains or scores here.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections import Counter
from pathlib import Path

from gyre.coordinator.buffer import Run
from gyre.coordinator.harnesses import HarnessPreset
from gyre.coordinator.launcher import LaunchSpec, Launcher
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.coordinator.tasks import Task
from gyre.coordinator.waterlevel import Tracked
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer


async def run_harness_once(proxy: ProxyServer, preset: HarnessPreset, prompt: str, *, run_dir: Path,
                           execution: str = "serve", timeout_s: float = 600.0) -> dict:
    """Run `preset` once against a started proxy; the summary is also written to
    RUN_DIR/executions/<execution>/summary.json."""
    launcher = Launcher(proxy, run_dir, LaunchSpec(preset=preset, timeout_s=timeout_s, eval_attempts=1,
                                                   eval_budget_s=0.0))
    run = Run(id=execution, group=0, index=0, task=Task(id=execution, prompt=prompt), tracked=Tracked(),
              version_dispatched=0)
    try:
        code, timed_out, workspace = await launcher.execute(run)
    finally:
        await launcher.stop_all()
    ex = run.recorder
    status = ("not_started" if code is None else "timed_out" if timed_out
              else "completed" if code == 0 else "harness_error")
    folder = run_dir / "executions" / execution
    summary = {"execution": execution, "harness": preset.name, "status": status, "exit_code": code,
               "calls": len(ex.calls), "roles": dict(Counter(c["role"] for c in ex.calls)),
               "call_status": dict(Counter(c["status"] for c in ex.calls)), "tree": ex.tree.stats(),
               "workspace": str(workspace), "harness_log": str(folder / "harness.log")}
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


async def serve(*, model_dir: Path, run_dir: Path, host: str, port: int, execution: str = "serve",
                ready_file: Path | None = None, preset: HarnessPreset | None = None, task: str | None = None,
                timeout_s: float = 600.0, max_context: int | None = None) -> int:
    loop = asyncio.get_running_loop()
    async with LocalCluster(model_dir, cells=1, roles=("rollout",), log_dir=run_dir / "logs") as cluster:
        table = RoutingTable()
        table.set_nodes([cluster.node_of_cell(0)])
        tokenizer = ChatTokenizer(model_dir)
        config = ProxyConfig(host=host, port=port, **({"max_context": max_context} if max_context else {}))
        proxy = ProxyServer(tokenizer, LinkBackend(cluster.link, table), config, run_dir=run_dir)
        base_url = await proxy.start()
        try:
            if preset is not None:
                job = asyncio.ensure_future(run_harness_once(proxy, preset, task or "", run_dir=run_dir,
                                                             execution=execution, timeout_s=timeout_s))
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.add_signal_handler(sig, job.cancel)
                try:
                    summary = await job
                except asyncio.CancelledError:
                    print(json.dumps({"event": "interrupted", "execution": execution}), file=sys.stderr)
                    return 130
                print(json.dumps(summary), flush=True)
                return 0 if summary["status"] == "completed" else 1
            stop = asyncio.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            ex = proxy.register(execution)
            info = {"base_url": base_url, "openai_base_url": f"{base_url}/v1", "api_key": ex.key,
                    "execution": execution, "run_dir": str(run_dir)}
            print(json.dumps(info), flush=True)
            if ready_file is not None:
                ready_file.write_text(json.dumps(info))
            try:
                await stop.wait()
            finally:
                proxy.revoke(execution)
            print(json.dumps({"event": "stopped", "calls": len(ex.calls), "tree": ex.tree.stats()}), file=sys.stderr)
            return 0
        finally:
            await proxy.stop()


def run_serve(*, model_dir: Path, run_dir: Path, host: str, port: int, preset: HarnessPreset | None = None,
              task: str | None = None, timeout_s: float = 600.0, max_context: int | None = None) -> int:
    import uvloop

    (run_dir / "config.json").write_text(json.dumps({
        "command": "serve", "model": str(model_dir), "host": host, "port": port,
        "harness": None if preset is None else preset.name, "task": task, "timeout_s": timeout_s,
        "max_context": max_context}, indent=2))
    return uvloop.run(serve(model_dir=model_dir, run_dir=run_dir, host=host, port=port, preset=preset, task=task,
                            timeout_s=timeout_s, max_context=max_context))
