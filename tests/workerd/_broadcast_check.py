"""Run inside a private network namespace by test_transfer: a trainer broadcasts its
weights to two receivers over a `BroadcastGroup` (SGLang's rendezvous), which load them
into CPU engines; prints one JSON line per receiver."""

import json
import multiprocessing as mp
import sys

import torch


def member(rank: int, model_dir: str, port: int, q) -> None:
    from gyre.workerd.model import load_model
    from gyre.workerd.transfer import BroadcastGroup

    group = BroadcastGroup(master_address="127.0.0.1", master_port=port, rank=rank, world_size=3,
                           group_name="gyre_weights_test", timeout_s=60)
    model = load_model(model_dir)
    if rank == 0:
        named = {k: v + 0.5 * (i + 1) for i, (k, v) in enumerate(model.hf_state_dict().items())}  # "trained"
        q.put({"rank": 0, "sent": group.send(named)})
    else:
        from gyre.workerd.model import CausalLM

        specs = BroadcastGroup.specs(model.hf_state_dict())  # a receiver knows them from its own model
        got = group.recv(specs)
        engine_model = CausalLM(model.config)
        nbytes = engine_model.load_hf_weights(got.items())
        expect = {k: v + 0.5 * (i + 1) for i, (k, v) in enumerate(model.hf_state_dict().items())}
        same = all(torch.equal(engine_model.state_dict()[k], expect[k]) for k in expect)
        q.put({"rank": rank, "received": nbytes, "equal": same})
    group.close()


if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=member, args=(r, sys.argv[1], 29533, q)) for r in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
    for r in sorted(results, key=lambda r: r["rank"]):
        print(json.dumps(r))
    sys.exit(max(p.exitcode for p in procs))
