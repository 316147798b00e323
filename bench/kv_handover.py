"""bench/kv_handover.py: prefill seconds a KV handover saves when a request is rerouted.

    python bench/kv_handover.py [--sizes 1024,8192,32000]

For each prefix length: (a) recompute: a fresh engine prefills the whole context (what a
reroute without handover costs before its first new token); (b) handover: the source's KV
is turned into wire frames, encoded, decoded and imported, and the destination prefills
the one token the source had not fed yet. Both on the tiny model, in one process (no
socket: ZeroMQ throughput is bench/foundation.py's). Prints seconds and the ratio.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from gyre.workerd import wire
from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine
from gyre.workerd.model import load_model
from gyre.workerd.modeldir import init_tiny
from gyre.workerd.worker import kv_frames, kv_from_frames


def first_token_seconds(engine: CpuEngine, prompt: list[int], kv=None) -> float:
    t0 = time.perf_counter()
    engine.add_request("r", prompt, SamplingParams(max_new_tokens=1, temperature=0), kv=kv)
    while engine.running:
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,8192,32000")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny(tmp)
        src, dst = CpuEngine(load_model(model_dir)), CpuEngine(load_model(model_dir))
    rows = []
    for n in (int(x) for x in args.sizes.split(",")):
        prompt = [(i * 7919) % 256 for i in range(n)]
        recompute = first_token_seconds(dst, prompt)
        src.add_request("s", prompt[:-1], SamplingParams(max_new_tokens=2, temperature=0))
        src.step()  # prefill n-1 tokens and sample one: the cache now covers prompt[:-1]
        kv = src.export_kv("s")
        t0 = time.perf_counter()
        frames = kv_frames(kv)
        decoded = wire.decode(wire.encode(wire.Generate(req_id=1, rid="r", prompt_ids=[], max_new_tokens=1,
                                                        kv_tokens=kv.length), frames))[1]
        imported = kv_from_frames(decoded, kv.length)
        transfer = time.perf_counter() - t0
        src.abort("s")
        handover = first_token_seconds(dst, prompt, kv=imported)
        nbytes = sum(f.data.nbytes for f in frames)
        rows.append({"tokens": n, "recompute_s": round(recompute, 4), "transfer_s": round(transfer, 4),
                     "import_prefill_s": round(handover, 4), "kv_bytes": nbytes,
                     "saved_s": round(recompute - transfer - handover, 4),
                     "ratio": round(recompute / (transfer + handover), 1)})
    print(f"{'tokens':>8}{'recompute s':>13}{'kv bytes':>12}{'frames s':>10}{'import s':>10}{'saved s':>10}"
          f"{'ratio':>8}")
    for r in rows:
        print(f"{r['tokens']:>8}{r['recompute_s']:>13.4f}{r['kv_bytes']:>12}{r['transfer_s']:>10.4f}"
              f"{r['import_prefill_s']:>10.4f}{r['saved_s']:>10.4f}{r['ratio']:>7.1f}x")
    print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
