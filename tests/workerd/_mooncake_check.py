"""Run inside a private network namespace (Mooncake listens on every interface):
    unshare -n sh -c 'ip link set lo up && python tests/workerd/_mooncake_check.py MODEL_DIR'
Two real workerds; cell 0's trainer gets perturbed weights (version 5), cell 1 pulls them
through Mooncake into its engine and trainer; prints one JSON line with what was checked."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import torch

from gyre.coordinator.local import LocalCluster
from gyre.workerd import wire
from gyre.workerd.tensors import from_frames, to_frames


async def main(model_dir: str) -> dict:
    async with LocalCluster(model_dir, cells=2, roles=("training", "rollout")) as cluster:
        link = cluster.link
        n0, n1 = cluster.node_of_cell(0), cluster.node_of_cell(1)
        _, frames = await link.call(n0, wire.ExportWeights())
        perturbed = {k: (v.clone() * 2 + 0.5 if v.is_floating_point() else v.clone())
                     for k, v in from_frames(frames).items()}
        await link.call(n0, wire.LoadWeights(version=5, trainer=True, engine=False),
                        to_frames(perturbed))
        for n in (n0, n1):
            await link.request(n, wire.InitTransfer(backend="mooncake", host="127.0.0.1"))
        offer = await link.request(n0, wire.OfferWeights(version=5))
        handle = offer.handle
        pulled = await link.request(n1, wire.PullWeights(handle=handle, engine=True,
                                                         trainer=True))
        _, back = await link.call(n1, wire.ExportWeights())
        got = from_frames(back)
        equal = all(torch.equal(got[k], perturbed[k]) for k in perturbed)
        # The engine serves the pulled weights too: same log-probs as cell 0's trainer would give.
        again = await link.request(n1, wire.PullWeights(handle=handle, engine=False,
                                                        trainer=True))  # cached offer
        src = torch.empty(offer.nbytes, dtype=torch.uint8).fill_(1)
        t0 = time.perf_counter()
        src.clone()
        memcpy = time.perf_counter() - t0
        return {"equal": equal, "nbytes": offer.nbytes, "tensors": len(handle["manifest"]),
                "version": pulled.version, "transfer_seconds": pulled.transfer_seconds,
                "second_pull_seconds": again.transfer_seconds, "memcpy_seconds": memcpy,
                "session": handle["session"]}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(sys.argv[1]))))
