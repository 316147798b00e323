"""Run by test_sglang_cpu.py with the SGLang CPU venv's python (PYTHONPATH = the repo root):
drives gyre's SglangEngine over a real `sglang.Engine` 0.5.23 on CPU with the tiny model,
and compares every sampled token's log-prob with the CPU trainer's. Prints one JSON line
per stage and the whole report last. Not a test: it measures and reports, and fails only
when SGLang or the adapter raises.

Options that live here: max_total_tokens, because on CPU SGLang sizes its KV pool from
host RAM (16 GB for this model in float32: the OOM killer ended the scheduler); 8192 tokens
are 25 MB here. (The adapter itself sets SGLANG_USE_CPU_ENGINE for device="cpu", turns the
CUDA-only memory saver off there, and serves the checkpoint's dtype.)
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

OPTIONS = {"device": "cpu", "attention_backend": "torch_native",
           "sampling_backend": "pytorch", "sleep_on_idle": True, "max_total_tokens": 8192,
           "context_length": 4096, "step_wait_s": 0.05}
VOCAB = 272
DEADLINE_S = 120.0  # for one batch of requests to finish
MATCH = 1e-4  # the issue's bar for "equal log-probs"


def prompts() -> list[list[int]]:
    from tests.workerd.helpers import prompt_ids

    base = prompt_ids()
    return [base, base[:20] + [257], prompt_ids("<|im_start|>user\nHi<|im_end|>\n"), list(range(60, 100))]


def drive(eng, until=lambda got: False, deadline_s: float = DEADLINE_S) -> dict[str, dict]:
    """Steps until no request runs (or `until(collected)`); returns rid -> what it produced."""
    got: dict[str, dict] = {}
    end = time.monotonic() + deadline_s
    while eng.running and not until(got):
        if time.monotonic() > end:
            raise TimeoutError(f"{eng.running} requests still running after {deadline_s} s")
        for o in eng.step():
            g = got.setdefault(o.rid, {"ids": [], "lps": [], "reason": None, "chunks": 0, "versions": set()})
            g["ids"] += o.token_ids
            g["lps"] += o.logprobs
            g["chunks"] += 1
            g["versions"].add(o.version)
            g["reason"] = o.finish_reason
    return got


def merge(got: dict[str, dict], more: dict[str, dict]) -> None:
    for rid, g in more.items():
        cur = got.setdefault(rid, {"ids": [], "lps": [], "reason": None})
        cur["ids"] += g["ids"]
        cur["lps"] += g["lps"]
        cur["reason"] = g["reason"]


def diffs(trainer, prompt: list[int], ids: list[int], lps: list[float]) -> torch.Tensor:
    """|engine log-prob - trainer log-prob| at each output position."""
    if not ids:
        return torch.zeros(0)
    ref = trainer.current_logprobs(torch.tensor([prompt + ids]))[0, len(prompt):]
    return (ref - torch.tensor(lps)).abs()


def max_diff(trainer, samples: dict) -> float:
    return max(float(d.max()) if d.numel() else 0.0 for d in (diffs(trainer, *s) for s in samples.values()))


def generate(eng, trainer, tag: str, max_new_tokens: int = 16) -> tuple[dict, dict]:
    """Five concurrent requests at temperature 1, one of which stops at once (every id is
    one of its stop ids). Returns (report, rid -> (prompt, ids, log-probs))."""
    from gyre.workerd.engines.base import SamplingParams

    ps = prompts()
    params = {f"{tag}{i}": SamplingParams(max_new_tokens=max_new_tokens) for i in range(len(ps))}
    params[f"{tag}stop"] = SamplingParams(max_new_tokens=max_new_tokens, stop_token_ids=tuple(range(VOCAB)))
    prompt_of = {rid: ps[i % len(ps)] for i, rid in enumerate(params)}
    t0 = time.perf_counter()
    for rid, p in params.items():
        eng.add_request(rid, prompt_of[rid], p)
    got = drive(eng)
    seconds = time.perf_counter() - t0
    samples = {r: (prompt_of[r], g["ids"], g["lps"]) for r, g in got.items()}
    tokens = sum(len(g["ids"]) for g in got.values())
    return {
        "diff": max_diff(trainer, samples),
        "reasons": {r: g["reason"] for r, g in got.items()},
        "lengths": {r: len(g["ids"]) for r, g in got.items()},
        "lps_per_token": all(len(g["ids"]) == len(g["lps"]) for g in got.values()),
        "chunks": sum(g["chunks"] for g in got.values()),
        "versions": sorted({v for g in got.values() for v in g["versions"]}),
        "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
    }, samples


def check_abort(eng, trainer) -> dict:
    """Three long requests; once each has tokens, abort the middle one by id."""
    from gyre.workerd.engines.base import SamplingParams

    p, rids = prompts()[0], ("x0", "x1", "x2")
    for rid in rids:
        eng.add_request(rid, p, SamplingParams(max_new_tokens=48))
    got = drive(eng, until=lambda g: all(len(g.get(r, {}).get("ids", [])) >= 2 for r in rids))
    running_before = eng.running
    out = eng.abort("x1")
    rest = drive(eng)
    merge(got, rest)
    return {
        "running_before": running_before, "running_after": eng.running,
        "abort_output": out and {"rid": out.rid, "reason": out.finish_reason, "finished": out.finished},
        "x1_output_after_abort": "x1" in rest, "abort_again_is_none": eng.abort("x1") is None,
        "reasons": {r: got[r]["reason"] for r in ("x0", "x2")},
        "lengths": {r: len(got[r]["ids"]) for r in ("x0", "x2")},
        "diff": max_diff(trainer, {r: (p, got[r]["ids"], got[r]["lps"]) for r in ("x0", "x2")}),
    }


def check_sampling(eng, trainer) -> dict:
    """Log-probs stay those of temperature 1 before top-p whatever the request samples with
    (the adapter sets SGLANG_RETURN_ORIGINAL_LOGPROB=1 for that): the largest gap per setting."""
    from gyre.workerd.engines.base import SamplingParams

    settings = {"t0.7_p0.9": SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9),
                "t1.5": SamplingParams(max_new_tokens=16, temperature=1.5),
                "greedy": SamplingParams(max_new_tokens=16, temperature=0.0)}
    out = {}
    for name, params in settings.items():
        ps = {f"{name}-{i}": p for i, p in enumerate(prompts())}
        for rid, p in ps.items():
            eng.add_request(rid, p, params)
        got = drive(eng)
        out[name] = max_diff(trainer, {r: (ps[r], g["ids"], g["lps"]) for r, g in got.items()})
    return out


def train_step(trainer, samples: dict) -> float:
    """A real GSPO micro-step on the engine's own samples (one row each, advantages +-1),
    then one AdamW update; returns the gradient norm."""
    from gyre.workerd.trainers.base import MicroBatch

    rows = [s for s in samples.values() if len(s[1]) > 1]
    width = max(len(p) + len(ids) for p, ids, _ in rows)
    t = {k: torch.zeros(len(rows), width) for k in ("behaviour_logprobs", "advantages", "loss_weights")}
    input_ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, (p, ids, lps) in enumerate(rows):
        out = slice(len(p), len(p) + len(ids))
        input_ids[i, : out.stop] = torch.tensor(p + ids)
        mask[i, out] = True
        t["behaviour_logprobs"][i, out] = torch.tensor(lps)
        t["advantages"][i, out] = 1.0 if i % 2 == 0 else -1.0
        t["loss_weights"][i, out] = 1.0 / len(ids)
    exec_ids = torch.arange(len(rows)).unsqueeze(1).expand(-1, width).contiguous()
    trainer.train_micro_step(MicroBatch(input_ids=input_ids, target_mask=mask, exec_ids=exec_ids, **t))
    return trainer.optimizer_step(num_executions=len(rows))


def check_update_in_flight(eng, trainer, samples: dict, version: int) -> dict:
    """A publication while requests run (the adapter pauses with "retract", updates, flushes,
    continues): every token matches the old or the new weights, the old ones first."""
    from gyre.workerd.engines.base import SamplingParams

    old = copy.deepcopy(trainer)
    ps, rids = prompts(), [f"f{i}" for i in range(len(prompts()))]
    for rid, p in zip(rids, ps):
        eng.add_request(rid, p, SamplingParams(max_new_tokens=40))
    got = drive(eng, until=lambda g: sum(len(g.get(r, {}).get("ids", [])) >= 3 for r in rids) >= 2)
    at_update, running = {r: len(got.get(r, {}).get("ids", [])) for r in rids}, eng.running
    train_step(trainer, samples)  # SGLang keeps sampling meanwhile: those tokens are old
    t0 = time.perf_counter()
    eng.load_weights(trainer.export_weights().items(), version=version)
    update_s = time.perf_counter() - t0
    merge(got, drive(eng))
    neither, old_then_new, new_tokens = 0, True, 0
    for rid, p in zip(rids, ps):
        d_old = diffs(old, p, got[rid]["ids"], got[rid]["lps"]) <= MATCH
        d_new = diffs(trainer, p, got[rid]["ids"], got[rid]["lps"]) <= MATCH
        neither += int((~d_old & ~d_new).sum())
        only_new = (d_new & ~d_old).tolist()
        first_new = only_new.index(True) if True in only_new else len(only_new)
        old_then_new &= bool(d_new[first_new:].all())
        new_tokens += sum(only_new)
    return {"running_at_update": running, "tokens_at_update": at_update, "update_s": update_s,
            "reasons": {r: got[r]["reason"] for r in rids}, "lengths": {r: len(got[r]["ids"]) for r in rids},
            "neither": neither, "old_then_new": old_then_new, "new_tokens": new_tokens, "version": eng.version}


def stage(report: dict, name: str, value: dict) -> None:
    report[name] = value
    print(json.dumps({"stage": name, **value}), flush=True)


def run_checks(eng, trainer, old, report: dict) -> None:
    """The stages, in order; each leaves the engine idle."""
    # 1) Generation, abort of one of three running requests, other sampling settings.
    gen, samples = generate(eng, trainer, "a")
    stage(report, "generate", gen)
    stage(report, "abort", check_abort(eng, trainer))
    stage(report, "sampling", check_sampling(eng, trainer))
    # 2) A role change each way, then generation again.
    t0 = time.perf_counter()
    freed = eng.release_memory()
    release_s, t0 = time.perf_counter() - t0, time.perf_counter()
    eng.resume_memory()
    resume_s = time.perf_counter() - t0
    gen, _ = generate(eng, trainer, "c")
    stage(report, "role_change", {"release_s": release_s, "resume_s": resume_s, "freed": freed, **gen})
    # 3) A publication from the trainer after a real optimizer step.
    grad_norm = train_step(trainer, samples)
    t0 = time.perf_counter()
    nbytes = eng.load_weights(trainer.export_weights().items(), version=1)
    update_s = time.perf_counter() - t0
    gen, samples = generate(eng, trainer, "d")
    stage(report, "update", {"grad_norm": grad_norm, "bytes": nbytes, "update_s": update_s,
                             "diff_to_old": max_diff(old, samples), **gen})
    # 4) A publication while the weights are released: kept on the host, loaded at resume.
    train_step(trainer, samples)
    eng.release_memory()
    kept = eng.load_weights(trainer.export_weights().items(), version=2)
    t0 = time.perf_counter()
    eng.resume_memory()
    resume_s = time.perf_counter() - t0
    gen, samples = generate(eng, trainer, "r")
    stage(report, "update_while_released", {"bytes": kept, "resume_s": resume_s, **gen})
    # 5) A publication with requests in flight.
    stage(report, "update_in_flight", check_update_in_flight(eng, trainer, samples, version=3))


def main() -> int:
    import sglang

    from gyre.workerd.engines.sglang import SglangEngine
    from gyre.workerd.model import load_model
    from gyre.workerd.modeldir import init_tiny
    from gyre.workerd.trainers.cpu import CpuTrainer

    report: dict = {"sglang": sglang.__version__, "torch": torch.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = init_tiny(Path(tmp) / "tiny", seed=0)
        trainer = CpuTrainer(load_model(model_dir), lr=1e-3)  # Adam's first step: ~lr per weight
        old = CpuTrainer(load_model(model_dir))
        t0 = time.perf_counter()
        eng = SglangEngine(model_dir, options=OPTIONS)
        report["start_s"] = time.perf_counter() - t0
        try:
            run_checks(eng, trainer, old, report)
        finally:
            t0 = time.perf_counter()
            eng.shutdown()
            report["shutdown_s"] = time.perf_counter() - t0
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":  # SGLang starts its scheduler with spawn: this module is re-imported
    sys.exit(main())
