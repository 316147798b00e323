"""bench/foundation.py: throughput of the embedded foundation on CPU, with in-run baselines.

Measures, on the tiny model: CPU engine tokens/s at 1, 8 and 32 concurrent requests
against the same 32 requests run one at a time; trainer tokens/s and optimizer-step time;
the trainer's peak memory for one long micro-step, its chunked log-probs against the
whole-vocabulary float32 log-softmax (each in a fresh process, on the tiny model with a
49,152-token vocabulary unless --model names a real one); weight export + load, in
process and over ZeroMQ with gyre's wire framing; and raw ZeroMQ tensor bandwidth (tcp,
ipc) against a local memcpy. Every ratio compares figures taken in this same run, so they
hold across machines where absolute numbers do not. Not a test: it asserts only output
lengths and byte counts. Run:
    python bench/foundation.py [--quick] [--json PATH] [--model DIR] [--memory-tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

from gyre.workerd import wire
from gyre.workerd.engines.base import SamplingParams
from gyre.workerd.engines.cpu import CpuEngine
from gyre.workerd.model import load_model, num_params
from gyre.workerd.modeldir import init_tiny
from gyre.workerd.tensors import from_frames, to_frames
from gyre.workerd.trainers.base import MicroBatch
from gyre.workerd.trainers.cpu import CpuTrainer

MIB = 1 << 20


def median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# --- 1. engine ----------------------------------------------------------------------------


def run_batch(engine: CpuEngine, tag: str, ids: list[int], prompt_len: int, new_tokens: int) -> dict:
    """Add requests `ids` together and step until done; the first step prefills, the rest decode."""
    for i in ids:  # request i has the same prompt and seed whether run alone or batched
        prompt = torch.randint(0, 256, (prompt_len,), generator=torch.Generator().manual_seed(i))
        engine.add_request(f"{tag}-{i}", prompt.tolist(), SamplingParams(max_new_tokens=new_tokens, seed=i))
    t0 = time.perf_counter()
    tokens = len(engine.step())  # prefill: one sampled token per request
    t1 = time.perf_counter()
    while engine.running:
        tokens += sum(len(o.token_ids) for o in engine.step())
    t2 = time.perf_counter()
    # No stop tokens: a short output would mean the engine ended a request early.
    assert tokens == len(ids) * new_tokens, (tokens, len(ids), new_tokens)
    return dict(tokens=tokens, seconds=t2 - t0, prefill_s=t1 - t0, decode_s=t2 - t1,
                decode_tokens=tokens - len(ids))


ENGINE_RUNS = {"concurrent_1": (1, True), "concurrent_8": (8, True),
               "concurrent_32": (32, True), "sequential_32": (32, False)}


def bench_engine(model, prompt_len: int, new_tokens: int, reps: int) -> dict:
    engine = CpuEngine(model, max_running=64)
    run_batch(engine, "warm", [0], prompt_len, 4)
    # Repetitions interleave the runs, so a noisy neighbour skews them alike, not one of them.
    runs: dict[str, list[dict]] = {key: [] for key in ENGINE_RUNS}
    for rep in range(reps):
        for key, (n, concurrent) in ENGINE_RUNS.items():
            groups = [list(range(n))] if concurrent else [[i] for i in range(n)]
            parts = [run_batch(engine, f"{key}-{rep}", g, prompt_len, new_tokens) for g in groups]
            runs[key].append({k: sum(p[k] for p in parts) for k in parts[0]})
    out = {}
    for key, rs in runs.items():
        run = sorted(rs, key=lambda r: r["seconds"])[len(rs) // 2]  # the median run
        out[key] = dict(run, tok_s=run["tokens"] / run["seconds"],
                        decode_tok_s=run["decode_tokens"] / run["decode_s"])
    # Both runs make the same tokens, so the tok/s ratio is sequential time / concurrent time.
    ratios = [s["seconds"] / c["seconds"] for s, c in zip(runs["sequential_32"], runs["concurrent_32"])]
    out["ratio_32_concurrent_vs_sequential"] = statistics.median(ratios)
    return out


# --- 2. trainer ---------------------------------------------------------------------------


def micro_batch(rows: int, seq: int, vocab: int) -> MicroBatch:
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(rows, seq, dtype=torch.bool)
    mask[:, 0] = False  # the first token has no context to be predicted from
    return MicroBatch(
        input_ids=torch.randint(0, vocab, (rows, seq), generator=g),
        target_mask=mask,
        behaviour_logprobs=torch.full((rows, seq), -float(torch.tensor(vocab).log())),
        advantages=torch.randn(rows, 1, generator=g).expand(rows, seq).contiguous(),
        loss_weights=torch.full((rows, seq), 1.0 / (seq - 1)),
        exec_ids=torch.arange(rows).unsqueeze(1).expand(rows, seq).contiguous(),
    )


def bench_trainer(trainer: CpuTrainer, rows: int, seq: int, reps: int) -> dict:
    batch = micro_batch(rows, seq, trainer.model.config.vocab_size)
    trainer.train_micro_step(batch)
    trainer.optimizer_step(rows)  # warm-up: AdamW creates its state on the first step
    micro, step = [], []
    for _ in range(reps):  # timed in pairs so each update applies real gradients
        micro.append(trainer.train_micro_step(batch).seconds)
        t0 = time.perf_counter()
        trainer.optimizer_step(rows)
        step.append(time.perf_counter() - t0)
    micro_s, targets = statistics.median(micro), int(batch.target_mask.sum())
    return dict(rows=rows, seq=seq, target_tokens=targets, micro_step_s=micro_s,
                train_tok_s=targets / micro_s, optimizer_step_s=statistics.median(step))


# --- 2b. trainer memory ---------------------------------------------------------------------


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_child(model_dir: str, tokens: int, variant: str) -> dict:
    """One micro-step of `tokens` targets in this (fresh) process; the peak resident memory
    it adds over the trainer at rest (VmHWM is reset just before, through clear_refs)."""
    from gyre.workerd.loss import token_logprobs
    from gyre.workerd.trainers.base import backward_micro_step

    trainer = CpuTrainer(load_model(model_dir), lr=1e-6, checkpoint_layers=variant == "chunked+recompute")
    batch = micro_batch(1, tokens, trainer.model.config.vocab_size)
    Path("/proc/self/clear_refs").write_text("5")  # reset the high-water mark
    before = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if variant != "full":
        trainer.train_micro_step(batch)
    else:  # the whole [T, V] float32 log-softmax, as loss.py computed it before
        backward_micro_step(token_logprobs(trainer.model(batch.input_ids), batch.input_ids), batch, t0)
    seconds = time.perf_counter() - t0
    return dict(peak_mib=(_status_kib("VmHWM") - before) / 1024, seconds=seconds)


def bench_memory(model_dir: str, tokens: int) -> dict:
    out = {"tokens": tokens}
    for variant in ("chunked", "chunked+recompute", "full"):
        r = subprocess.run([sys.executable, __file__, "--memory-child", model_dir, str(tokens), variant],
                           capture_output=True, text=True, check=True)
        out[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    out["vocab"] = load_model_config(model_dir).vocab_size
    out["full_vs_chunked_peak"] = out["full"]["peak_mib"] / max(out["chunked"]["peak_mib"], 1e-9)
    return out


def load_model_config(model_dir: str):
    from gyre.workerd.modeldir import load_config

    return load_config(model_dir)


# --- 3. weights ---------------------------------------------------------------------------


def bench_weights(trainer: CpuTrainer, engine: CpuEngine, reps: int) -> dict:
    export_s = median_time(trainer.export_weights, reps)
    named = trainer.export_weights()
    nbytes = engine.load_weights(named.items(), 1)
    load_s = median_time(lambda: engine.load_weights(named.items(), 1), reps)

    # The workerd's path: export -> to_frames -> encode -> tcp -> decode -> from_frames -> load.
    def payload() -> list:
        msg = wire.Weights(req_id=0, version=2, nbytes=nbytes)
        return wire.encode(msg, to_frames(trainer.export_weights()))

    def load(frames: list) -> None:
        msg, tensors = wire.decode(frames)
        engine.load_weights(from_frames(tensors).items(), msg.version)

    zmq_s = push_pull("tcp://127.0.0.1:*", payload, load, reps)
    return dict(tensors=len(named), bytes=nbytes, export_s=export_s, load_s=load_s,
                zmq_export_to_load_s=zmq_s, zmq_gb_s=nbytes / zmq_s / 1e9)


# --- 4. raw ZeroMQ bandwidth ----------------------------------------------------------------


def bench_transfer(total_mib: int, frame_mib: int, reps: int) -> dict:
    frames = [torch.randn(frame_mib * MIB // 4).numpy() for _ in range(total_mib // frame_mib)]
    nbytes = sum(f.nbytes for f in frames)
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # fault in the destination pages before timing
    memcpy_s = median_time(lambda: dst.copy_(src), max(reps, 5))
    out = {"bytes": nbytes, "frame_bytes": frame_mib * MIB, "memcpy_gb_s": nbytes / memcpy_s / 1e9}

    def check(got: list) -> None:
        assert sum(len(f.buffer) for f in got) == nbytes

    with tempfile.TemporaryDirectory() as tmp:
        for name, addr in (("tcp", "tcp://127.0.0.1:*"), ("ipc", f"ipc://{tmp}/bench.sock")):
            seconds = push_pull(addr, lambda: frames, check, reps)
            out[f"{name}_gb_s"] = nbytes / seconds / 1e9
            out[f"{name}_vs_memcpy"] = out[f"{name}_gb_s"] / out["memcpy_gb_s"]
    return out


def push_pull(addr: str, payload, on_receive, reps: int) -> float:
    """Median seconds from building and sending `payload()` (zero-copy) over PUSH/PULL
    until a receiving thread has run `on_receive` on the frames (received zero-copy)."""
    ctx = zmq.Context.instance()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(addr)
    push.connect(pull.getsockopt(zmq.LAST_ENDPOINT).decode())
    done = threading.Semaphore(0)

    def receiver() -> None:
        for _ in range(reps + 1):
            on_receive(pull.recv_multipart(copy=False))
            done.release()

    def once() -> None:
        push.send_multipart(payload(), copy=False)
        done.acquire()

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    once()  # warm-up: the connection is set up on the first message
    seconds = median_time(once, reps)
    thread.join()
    push.close(linger=0)
    pull.close(linger=0)
    return seconds


# --- report -------------------------------------------------------------------------------


def report(r: dict) -> None:
    e, t, w, x = r["engine"], r["trainer"], r["weights"], r["transfer"]
    print(f"gyre foundation bench: tiny model, {r['params'] / 1e6:.2f} M params, "
          f"torch {torch.__version__}, {r['threads']} threads, quick={r['quick']}")
    # Other processes on the cores skew every figure (torch's threads spin-wait): say so.
    print(f"load average before the run: {r['loadavg'][0]:.2f} on {r['cpus']} CPUs")
    print(f"\nengine ({r['prompt_len']}-token prompts, {r['new_tokens']} new tokens each)")
    print(f"  {'requests':<16}{'tokens':>8}{'seconds':>10}{'tok/s':>10}{'decode tok/s':>14}")
    for key in ENGINE_RUNS:
        run = e[key]
        print(f"  {key:<16}{run['tokens']:>8}{run['seconds']:>10.3f}"
              f"{run['tok_s']:>10.0f}{run['decode_tok_s']:>14.0f}")
    print(f"  ratio 32 concurrent / 32 sequential: {e['ratio_32_concurrent_vs_sequential']:.2f}x")
    print(f"\ntrainer ({t['rows']} rows x {t['seq']} tokens, {t['target_tokens']} targets)")
    print(f"  fwd+bwd {t['micro_step_s']:.3f} s = {t['train_tok_s']:.0f} target tok/s;"
          f" optimizer step {t['optimizer_step_s'] * 1e3:.1f} ms")
    m = r["memory"]
    print(f"\ntrainer memory, one micro-step of {m['tokens']} tokens, vocabulary {m['vocab']} ({r['memory_model']})")
    for variant, label in (("chunked", "chunked log-probs (gyre)"), ("chunked+recompute", "  + checkpoint_layers"),
                           ("full", "full float32 log-softmax")):
        print(f"  {label:<28} peak +{m[variant]['peak_mib']:>8.0f} MiB  {m[variant]['seconds']:>7.2f} s")
    print(f"  ratio full / chunked peak: {m['full_vs_chunked_peak']:.1f}x")
    print(f"\nweights ({w['tensors']} tensors, {w['bytes'] / MIB:.2f} MiB)")
    print(f"  export {w['export_s'] * 1e3:.2f} ms, load into engine {w['load_s'] * 1e3:.2f} ms")
    print(f"  export -> zmq tcp -> load {w['zmq_export_to_load_s'] * 1e3:.2f} ms ({w['zmq_gb_s']:.2f} GB/s)")
    print(f"\nzeromq transfer ({x['bytes'] // MIB} MiB in {x['frame_bytes'] // MIB} MiB frames, zero-copy)")
    print(f"  memcpy {x['memcpy_gb_s']:.2f} GB/s")
    for name in ("tcp", "ipc"):
        print(f"  {name:<6} {x[f'{name}_gb_s']:.2f} GB/s = {x[f'{name}_vs_memcpy']:.2f}x memcpy")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes, fewer repetitions")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    ap.add_argument("--model", metavar="DIR", help="the trainer-memory section on this model directory "
                    "(default: the tiny model with a 49,152-token vocabulary)")
    ap.add_argument("--memory-tokens", type=int, metavar="N", help="tokens of the memory section's micro-step "
                    "(default 8192, 2048 with --quick)")
    ap.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        model_dir, tokens, variant = args.memory_child
        print(json.dumps(memory_child(model_dir, int(tokens), variant)))
        return
    q = args.quick
    reps, prompt_len, new_tokens = (1 if q else 3), 64, (16 if q else 64)

    tmp_dir = tempfile.TemporaryDirectory()
    model_dir = init_tiny(Path(tmp_dir.name) / "tiny")
    engine_model, trainer_model = load_model(model_dir), load_model(model_dir)
    memory_model = args.model or str(init_tiny(Path(tmp_dir.name) / "wide-vocab", overrides={"vocab_size": 49152}))
    memory_tokens = args.memory_tokens or (2048 if q else 8192)
    trainer = CpuTrainer(trainer_model, lr=1e-4)
    started = time.perf_counter()
    r = dict(quick=q, threads=torch.get_num_threads(), cpus=os.cpu_count(), loadavg=os.getloadavg(),
             params=num_params(engine_model), prompt_len=prompt_len, new_tokens=new_tokens)
    sections = {
        "engine": lambda: bench_engine(engine_model, prompt_len, new_tokens, reps),
        "trainer": lambda: bench_trainer(trainer, 8, 128 if q else 512, 2 if q else 3),
        "memory": lambda: bench_memory(memory_model, memory_tokens),
        "weights": lambda: bench_weights(trainer, CpuEngine(engine_model), 3 if q else 5),
        "transfer": lambda: bench_transfer(16 if q else 64, 4, 3 if q else 5),
    }
    r["section_s"] = {}
    for name, fn in sections.items():
        t0 = time.perf_counter()
        r[name] = fn()
        r["section_s"][name] = time.perf_counter() - t0
    r["wall_s"] = time.perf_counter() - started
    r["memory_model"] = "tiny, vocabulary 49152" if not args.model else args.model
    tmp_dir.cleanup()
    report(r)
    times = ", ".join(f"{k} {v:.1f} s" for k, v in r["section_s"].items())
    print(f"\n(total {r['wall_s']:.1f} s: {times})")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=2))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
