"""bench/transfer.py: weight transfer between two real workerds: ZeroMQ frames vs Mooncake.

    python bench/transfer.py [--sizes tiny,15M,62M] [--repeat 3]   (parameters; fp32)

For each model size: (a) zmq: the core's ExportWeights frames relayed by the coordinator to
the other cell's LoadWeights (engine + trainer), as `weight_transfer = zmq` publishes;
(b) mooncake: the core packs and registers its parameters once (the offer), the other
cell pulls them with one read and loads them, as `weight_transfer = mooncake` does;
(c) a local memcpy of the same bytes, the baseline. Mooncake listens on every interface,
so the benchmark re-runs itself in a private network namespace (`unshare -n`, root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from gyre.coordinator.local import LocalCluster
from gyre.workerd import wire
from gyre.workerd.modeldir import init_tiny

SIZES = {"tiny": {}, "15M": {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8,
                              "num_key_value_heads": 4},
         "62M": {"hidden_size": 1024, "intermediate_size": 2816, "num_attention_heads": 16,
                  "num_key_value_heads": 8}}


def memcpy(nbytes: int, repeat: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        src.clone()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def one_size(model_dir: Path, repeat: int) -> dict:
    async with LocalCluster(model_dir, cells=2, roles=("training", "rollout"), start_timeout_s=600) as cluster:
        link, n0, n1 = cluster.link, cluster.node_of_cell(0), cluster.node_of_cell(1)
        zmq = []
        for v in range(repeat):
            t0 = time.perf_counter()
            w, frames = await link.call(n0, wire.ExportWeights(), timeout=600)
            await link.call(n1, wire.LoadWeights(version=v, trainer=True, engine=True),
                            frames, timeout=600)
            zmq.append(time.perf_counter() - t0)
        nbytes = w.nbytes
        for n in (n0, n1):
            await link.request(n, wire.InitTransfer(backend="mooncake", host="127.0.0.1"),
                               timeout=600)
        t0 = time.perf_counter()
        handle = (await link.request(n0, wire.OfferWeights(version=0), timeout=600)).handle
        offer = time.perf_counter() - t0
        pulls, wire_s = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            r = await link.request(n1, wire.PullWeights(handle=handle, engine=True,
                                                        trainer=True), timeout=600)
            pulls.append(time.perf_counter() - t0)
            wire_s.append(r.transfer_seconds)
    return {"bytes": nbytes, "zmq_s": statistics.median(zmq), "mooncake_offer_s": offer,
            "mooncake_pull_s": statistics.median(pulls), "mooncake_read_s": statistics.median(wire_s),
            "memcpy_s": memcpy(nbytes, repeat)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="tiny,15M,62M")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if os.environ.get("GYRE_BENCH_NETNS") != "1":
        cmd = f"ip link set lo up && GYRE_BENCH_NETNS=1 {sys.executable} {' '.join(sys.argv)}"
        raise SystemExit(subprocess.call(["unshare", "-n", "sh", "-c", cmd]))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes.split(","):
            model_dir = init_tiny(Path(tmp) / name, overrides=SIZES[name])
            r = asyncio.run(one_size(model_dir, args.repeat))
            rows.append({"size": name, **r})
            print(f"{name:>5} {r['bytes'] / 1e6:8.1f} MB  zmq {r['zmq_s']:.3f} s "
                  f"({r['bytes'] / r['zmq_s'] / 1e9:.2f} GB/s)"
                  f"  mooncake pull {r['mooncake_pull_s']:.3f} s (read {r['mooncake_read_s']:.3f} s, "
                  f"{r['bytes'] / r['mooncake_read_s'] / 1e9:.2f} GB/s; offer once {r['mooncake_offer_s']:.3f} s)"
                  f"  memcpy {r['memcpy_s']:.4f} s", flush=True)
    print("ratios (same run): mooncake pull / zmq, zmq / memcpy, mooncake read / memcpy")
    for r in rows:
        print(f"{r['size']:>5}  {r['mooncake_pull_s'] / r['zmq_s']:.2f}x  {r['zmq_s'] / r['memcpy_s']:.1f}x  "
              f"{r['mooncake_read_s'] / r['memcpy_s']:.1f}x")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
