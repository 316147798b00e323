"""bench/workers.py: what starting a run's workers costs, as processes and in process.

    python bench/workers.py [--cells 2] [--repeat 3] [--steps 2]

(a) cluster: a `LocalCluster` of `--cells` cells on the tiny model, started until every cell
is ready, then shut down: wall seconds and CPU seconds (this process and its children), as
`gyre workerd` processes (workers = "local", the baseline) and as threads of this process
(workers = "inproc"); (b) run: a whole `--steps`-step run of the demo harness on each,
wall seconds. Each kind is measured in a fresh interpreter (torch already imported there,
as in a coordinator), alternating, `--repeat` times; the ratios are inproc / local.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import asyncio, json, resource, sys, tempfile, time
from pathlib import Path
import torch  # noqa: F401 - as in a coordinator: its import is not the workers' cost
from gyre.coordinator.local import LocalCluster
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.main import Coordinator
from gyre.workerd.inproc import InprocWorkers
from gyre.workerd.modeldir import init_tiny

kind, what, cells, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = init_tiny(tempfile.mkdtemp(), seed=0)

def cpu():
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime

async def cluster():
    workers = InprocWorkers() if kind == "inproc" else None
    async with LocalCluster(model, cells=cells, workers=workers):
        pass

async def run():
    cfg = CoordinatorConfig(run_dir=Path(tempfile.mkdtemp()) / "run", model_dir=model, steps=steps, cells=cells,
                            workers=kind)
    await Coordinator(cfg, workers=InprocWorkers() if kind == "inproc" else None).run()

t0, c0 = time.monotonic(), cpu()
asyncio.run(cluster() if what == "cluster" else run())
print(json.dumps({"wall_s": time.monotonic() - t0, "cpu_s": cpu() - c0}))
"""


def measure(kind: str, what: str, cells: int, steps: int) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, kind, what, str(cells), str(steps)], capture_output=True,
                         text=True, timeout=900, cwd=tempfile.gettempdir())
    if out.returncode != 0:
        sys.exit(f"bench/workers.py: {kind} {what} failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cells", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    results: dict = {}
    for what in ("cluster", "run"):
        for _ in range(args.repeat):
            for kind in ("local", "inproc"):  # alternating: a slow minute falls on both
                results.setdefault(what, {}).setdefault(kind, []).append(measure(kind, what, args.cells, args.steps))
    print(f"{'':8} {'local wall':>11} {'inproc wall':>12} {'ratio':>6} {'local cpu':>10} {'inproc cpu':>11} "
          f"{'ratio':>6}   (medians of {args.repeat}, seconds; {args.cells} cells, runs of {args.steps} steps)")
    summary = {}
    for what, kinds in results.items():
        med = {k: {m: statistics.median(r[m] for r in v) for m in ("wall_s", "cpu_s")} for k, v in kinds.items()}
        lw, iw, lc, ic = med["local"]["wall_s"], med["inproc"]["wall_s"], med["local"]["cpu_s"], med["inproc"]["cpu_s"]
        print(f"{what:8} {lw:11.2f} {iw:12.2f} {iw / lw:6.2f} {lc:10.2f} {ic:11.2f} {ic / lc:6.2f}")
        summary[what] = {"medians": med, "wall_ratio": iw / lw, "cpu_ratio": ic / lc}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
