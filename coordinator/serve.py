"""serve.py: `gyre serve`: the proxy plus one local workerd, recording one execution.

Prints one JSON line (`base_url`, `api_key`, `run_dir`) so any harness can be pointed at
it, then serves until SIGINT/SIGTERM. Calls made with that key form one execution whose
records land in RUN_DIR/executions/serve/. Not the RL loop: nothing trains here.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

from gyre.coordinator.local import LocalCluster
from gyre.coordinator.routing import LinkBackend, RoutingTable
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.server import ProxyConfig, ProxyServer


async def serve(*, model_dir: Path, run_dir: Path, host: str, port: int, execution: str = "serve",
                ready_file: Path | None = None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with LocalCluster(model_dir, cells=1, roles=("rollout",), log_dir=run_dir / "logs") as cluster:
        table = RoutingTable()
        table.set_nodes([cluster.node_of_cell(0)])
        tokenizer = ChatTokenizer(model_dir)
        proxy = ProxyServer(tokenizer, LinkBackend(cluster.link, table), ProxyConfig(host=host, port=port),
                            run_dir=run_dir)
        base_url = await proxy.start()
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
            await proxy.stop()
    print(json.dumps({"event": "stopped", "calls": len(ex.calls), "tree": ex.tree.stats()}), file=sys.stderr)


def run_serve(*, model_dir: Path, run_dir: Path, host: str, port: int) -> None:
    import uvloop

    (run_dir / "config.json").write_text(json.dumps({"command": "serve", "model": str(model_dir), "host": host,
                                                     "port": port}, indent=2))
    uvloop.run(serve(model_dir=model_dir, run_dir=run_dir, host=host, port=port))
