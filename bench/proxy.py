"""bench/proxy.py: the proxy's added latency and CPU per call, and the trajectory tree's sharing.

Part 1 sends the harness pattern (a large repeated history plus one new short user message,
the proxy's own earlier replies sent back) over real HTTP to a ProxyServer whose engine
answers at once with a few tokens, so what is timed is the proxy, not generation. Baselines
from the same run: the same engine through `ThreadEngineBackend.generate` (tests/support.py)
with the prompt ids already built (no HTTP, no rendering), and a null aiohttp endpoint that only
reads the same bodies (the transport floor). The client runs in its own process, so the server process's
CPU per request (process_time between consecutive records: event loop + engine thread) is
the proxy's once the direct call's CPU is subtracted; prepare() and complete() are timed in
thread CPU, and garbage-collector pauses are logged. Part 1b: prepare() after many identical
replies. Part 2 drives a synthetic 600-call execution (tool turns, two compactions,
five sub-agents) through Recorder.prepare/complete and reports storage and admission.
Not a test. Run:
    python bench/proxy.py [--quick] [--verbose] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import multiprocessing as mp
import os
import pstats
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import aiohttp
import orjson
from aiohttp import web

from gyre.proxy import api_openai
from gyre.proxy.admission import admit
from gyre.proxy.backend import GenParams
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.recorder import Recorder
from gyre.proxy.roles import GenericRule
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.proxy.types import ChatRequest, ChatResult, Message, ToolCall, ToolSpec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository root: the in-process backend
from tests.support import ThreadEngineBackend  # noqa: E402 - test scaffolding, not part of the package

STOP = 258  # <|im_end|> in the tiny model
WORDS = ("the of and to in is for def return self value list dict import from class data path file line error "
         "test result config parser token node tree call request output write read assert raise None").split()
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}}}}
    for name, desc, arg in (("read_file", "Read a file from the repository", "path"), ("bash", "Run a command", "cmd"))]


def prose(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) + ("\n" if rng.random() < 0.08 else " ") for _ in range(n // 3 + 2)]
    return "".join(words)[:n]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


Out = namedtuple("Out", "rid token_ids logprobs version finished finish_reason prompt_tokens",
                 defaults=(0, True, "stop", 0))  # what the engine's step() returns per request


class InstantEngine:
    """Answers every request in one step with "ok <n>" + <|im_end|> (unique text; Part 1b
    shows why identical replies would skew the measurement)."""

    version = 0

    def __init__(self, tok: ChatTokenizer):
        self.tok, self.n, self.last_prompt, self.pending = tok, 0, [], {}

    @property
    def running(self) -> int:
        return len(self.pending)

    def add_request(self, rid, prompt_ids, params) -> None:
        self.last_prompt, self.pending[rid] = prompt_ids, len(prompt_ids)

    def step(self) -> list[Out]:
        outs = []
        for rid, n_prompt in self.pending.items():
            self.n += 1
            ids = self.tok.encode(f"ok {self.n}") + [STOP]
            outs.append(Out(rid, ids, [-0.5] * len(ids), prompt_tokens=n_prompt))
        self.pending.clear()
        return outs

    def abort(self, rid):
        return None if self.pending.pop(rid, None) is None else Out(rid, [], [], finish_reason="abort")


def history(target_tokens: int, seed: int = 0) -> list[dict]:
    """System + task + assistant tool-call turns with 500-2000-char tool results, about
    `target_tokens` when rendered with TOOLS (the tiny tokenizer is byte-level)."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": prose(rng, min(3000, target_tokens // 8))},
            {"role": "user", "content": prose(rng, min(600, target_tokens // 20))}]
    size = sum(len(m["content"]) for m in msgs) + 770  # + the tools block, + mean growth within a round
    while size < target_tokens:
        k = len(msgs)
        args = orjson.dumps({"path": f"src/{rng.choice(WORDS)}/{rng.choice(WORDS)}_{k}.py"}).decode()
        result = prose(rng, min(rng.randint(500, 2000), max(40, target_tokens - size - 150)))
        msgs += [{"role": "assistant", "content": prose(rng, rng.randint(20, 120)), "tool_calls": [
                    {"id": f"call_seed{k}", "type": "function", "function": {"name": "read_file", "arguments": args}}]},
                 {"role": "tool", "tool_call_id": f"call_seed{k}", "content": result}]
        size += len(msgs[-2]["content"]) + len(args) + len(result) + 130
    return msgs


# --- the client, in its own process ----------------------------------------------------------


def client_main(tasks, results) -> None:
    async def serve():
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while (task := tasks.get()) is not None:
                results.put(await client_run(session, **task))

    asyncio.run(serve())


async def client_run(session, url, key, seed, n, warmup, round_len=4) -> dict:
    """One request at a time. Each grows the conversation by the reply and one short user
    message; every `round_len` requests it restarts from the seed, so the context stays near
    its nominal size. The body is serialised before the clock starts (harness-side work)."""
    lat, prompt_tokens, msgs, body = [], [], [], b""
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    for i in range(warmup + n):
        msgs = list(seed) if i % round_len == 0 else msgs
        msgs.append({"role": "user", "content": f"Step {i}: go on."})
        body = orjson.dumps({"model": "gyre-policy", "messages": msgs, "tools": TOOLS, "max_tokens": 16})
        t0 = time.perf_counter()
        async with session.post(url, data=body, headers=headers) as r:
            raw = await r.read()
        dt = time.perf_counter() - t0
        assert r.status == 200, (r.status, raw[:300])
        reply = orjson.loads(raw)
        choice = reply.get("choices", [{"message": {"content": "ok"}}])[0]  # the null endpoint has none
        msgs.append({"role": "assistant", "content": choice["message"]["content"]})
        if i >= warmup:
            lat.append(dt)
            prompt_tokens.append(reply["usage"].get("prompt_tokens", 0))
    return {"lat": lat, "prompt_tokens": prompt_tokens, "body": body}


# --- part 1: proxy overhead --------------------------------------------------------------------


async def direct(backend, prompt_ids: list[int], n: int, warmup: int) -> dict:
    params, lat, cpu = GenParams(max_new_tokens=16, stop_token_ids=(256, STOP)), [], []
    for i in range(warmup + n):
        t0, c0 = time.perf_counter(), time.process_time()
        async for _ in backend.generate(f"direct-{i}-{len(prompt_ids)}", prompt_ids, params):
            pass
        if i >= warmup:
            lat.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    return {"lat": lat, "cpu": cpu}


def instrument(ex: Recorder, name: str, sink: list) -> None:
    """CPU time of one method of this execution instance (the server calls it through the
    instance); thread CPU, not wall, so a busy neighbour process does not inflate it."""
    orig = getattr(ex, name)

    def timed(*a, **kw):
        t0 = time.thread_time()
        out = orig(*a, **kw)
        sink.append(time.thread_time() - t0)
        return out

    setattr(ex, name, timed)


async def null_server() -> tuple[web.AppRunner, str]:
    async def null(request):  # the transport floor: read the body, answer a few bytes
        await request.read()
        return web.Response(body=b'{"usage": {}}', content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/null", null)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/null"


async def part1(tok: ChatTokenizer, sizes: dict[str, tuple[int, int]], verbose: bool, warmup: int = 5) -> dict:
    engine = InstantEngine(tok)
    backend = ThreadEngineBackend(engine, sampling_cls=lambda **kw: kw)
    server = ProxyServer(tok, backend, ProxyConfig(max_context=400_000, max_body_bytes=64 << 20),
                         run_dir=Path(tempfile.mkdtemp(prefix="gyre-bench-")))
    chat_url = await server.start() + "/v1/chat/completions"
    marks: list[float] = []
    server.on_record = lambda ex, rec: marks.append(time.process_time())
    null_runner, null_url = await null_server()
    gcs: list[tuple[float, int]] = []  # (pause, generation) of each collection in this process

    t0 = [0.0]  # the current collection's start

    def on_gc(phase, info):
        if phase == "start":
            t0[0] = time.perf_counter()
        else:
            gcs.append((time.perf_counter() - t0[0], info["generation"]))

    gc.callbacks.append(on_gc)
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    client = ctx.Process(target=client_main, args=(tasks, results), daemon=True)
    client.start()

    async def remote(**task) -> dict:
        tasks.put(task)
        return await asyncio.get_running_loop().run_in_executor(None, results.get)

    out = {}
    for label, (tokens, n) in sizes.items():
        seed, plan_t, apply_t, comp_t = history(tokens), [], [], []
        ex = server.register(f"bench-{label}")
        # The server prepares a call in two halves (Recorder.plan, off the loop; then apply):
        # prepare's CPU is their sum, call by call.
        instrument(ex, "plan", plan_t)
        instrument(ex, "apply", apply_t)
        instrument(ex, "complete", comp_t)
        marks.clear()
        gcs.clear()
        b = await remote(url=chat_url, key=ex.key, seed=seed, n=n, warmup=warmup)
        gc_b = list(gcs)
        cpu_b = [y - x for x, y in zip(marks[warmup:], marks[warmup + 1:])]
        prep_t = [x + y for x, y in zip(plan_t, apply_t)]
        floor = await remote(url=null_url, key=ex.key, seed=seed, n=n, warmup=warmup)
        a = await direct(backend, engine.last_prompt, n, warmup)
        t0 = time.thread_time()
        for _ in range(20):
            req = api_openai.parse_request(orjson.loads(b["body"]), {})
        r = out[label] = {
            "parse": (time.thread_time() - t0) / 20, "prompt_tokens": statistics.mean(b["prompt_tokens"]), "n": n,
            "messages": len(req.messages),
            "direct_p50": pct(a["lat"], 50), "direct_p99": pct(a["lat"], 99), "proxy_p50": pct(b["lat"], 50),
            "proxy_p99": pct(b["lat"], 99), "null_http_p50": pct(floor["lat"], 50),
            "prepare_p50": pct(prep_t[warmup:], 50), "prepare_p99": pct(prep_t[warmup:], 99),
            "complete_p50": pct(comp_t[warmup:], 50),
            "cpu_direct": statistics.median(a["cpu"]), "cpu_proxy": statistics.median(cpu_b),
            "gc_per_req": sum(p for p, _ in gc_b) / (n + warmup), "full_gcs": sum(g == 2 for _, g in gc_b),
            "full_gc_max": max((p for p, g in gc_b if g == 2), default=0.0)}
        r["added_p50"], r["added_p99"] = r["proxy_p50"] - r["direct_p50"], r["proxy_p99"] - r["direct_p99"]
        r["added_cpu"] = r["cpu_proxy"] - r["cpu_direct"]
        if verbose and label == list(sizes)[-1]:
            prof = cProfile.Profile()  # the server's event-loop thread only
            prof.enable()
            await remote(url=chat_url, key=ex.key, seed=seed, n=20, warmup=0)
            prof.disable()
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
            pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(r"gyre|/proxy/|jinja2", 12)
            out["profile"] = f"cProfile, server main thread, 20 requests at {label} (own time, then cumulative):\n" \
                             + buf.getvalue()
        server.revoke(ex.id)
    gc.callbacks.remove(on_gc)
    tasks.put(None)
    client.join(10)
    await null_runner.cleanup()
    await server.stop()
    backend.close()
    return out


def record(ex: Recorder, req: ChatRequest, text: str, tok: ChatTokenizer) -> ChatResult:
    """Prepare the call and record `text` as its output, as the server would."""
    return ex.record_reply(req, tok.encode(text) + [STOP], engine="bench")[0]


def repeated_replies(tok: ChatTokenizer, calls: int) -> dict:
    """prepare() time once the history holds `calls` replies, all different or all "ok"."""
    out = {"calls": calls}
    for kind in ("unique", "identical"):
        ex, times = Recorder("r", "k", tok, GenericRule()), []
        instrument(ex, "prepare", times)
        msgs = [Message("system", "You are terse."), Message("user", "Answer ok.")]
        for i in range(calls):
            text = record(ex, ChatRequest(api="openai", model="m", messages=list(msgs)), "ok" if kind == "identical"
                          else f"ok {i}", tok).content
            msgs += [Message("assistant", text), Message("user", f"again {i}")]
        out[kind] = statistics.median(times[-20:])
    return out


# --- part 2: a 600-call execution ----------------------------------------------------------------


def part2(tok: ChatTokenizer, total_calls: int = 600, seed: int = 0) -> dict:
    ex, prep_t = synthetic_execution(tok, total_calls, seed)
    tree = ex.tree
    r = {"calls": len(ex.calls), **tree.stats(), "leaf_roles": sorted(ex.leaf_roles.values()),
         "per_call_tokens": sum(c["prompt_tokens"] + c["output_tokens"] for c in ex.calls),  # a record per call
         "new_prompt_tokens_mean": statistics.mean(c["new_prompt_tokens"] for c in ex.calls),
         "output_copies": sum(n.kind == "output" and not n.policy for n in tree.nodes),  # outputs not recognised
         "max_prompt": max(c["prompt_tokens"] for c in ex.calls),
         "prepare_mean": statistics.mean(prep_t), "prepare_p99": pct(prep_t, 99), "prepare_max": max(prep_t)}
    for j in (1, 5, None):
        trajs = admit(tree, ex.leaf_roles, j_max=j, rng=random.Random(0))
        targets = [t.targets for t in trajs]
        assert sum(map(len, targets)) == len(frozenset().union(*targets)), "a target admitted twice"
        r[f"J{j or 'inf'}"] = {"trajectories": len(trajs), "roles": [t.role for t in trajs],
                               "target_tokens": sum(t.target_tokens(tree) for t in trajs),
                               "forward_tokens": sum(tree.nodes[t.leaf].end for t in trajs)}
    r["J5_forward_pct_of_inf"] = 100 * r["J5"]["forward_tokens"] / r["Jinf"]["forward_tokens"]
    r["J5_target_pct_of_inf"] = 100 * r["J5"]["target_tokens"] / r["Jinf"]["target_tokens"]
    return r


def synthetic_execution(tok: ChatTokenizer, total_calls: int = 600, seed: int = 0) -> tuple[Recorder, list[float]]:
    """The synthetic agent of part 2, recorded: tool turns, two compactions, five sub-agents
    (also bench/tree_train.py's). Returns the recorder and prepare()'s seconds per call."""
    rng = random.Random(seed)
    tools = [ToolSpec(t["function"]["name"], t["function"]["description"], t["function"]["parameters"]) for t in TOOLS]
    ex, prep_t = Recorder("p2", "k", tok, GenericRule()), []
    instrument(ex, "prepare", prep_t)

    def call(msgs: list, text: str) -> None:
        result = record(ex, ChatRequest(api="openai", model="m", messages=list(msgs), tools=tools), text, tok)
        # The harness re-serialises arguments (indent, key order); the proxy restores them by id.
        calls = [ToolCall(c.id, c.name, json.dumps(json.loads(c.arguments), indent=1, sort_keys=True))
                 for c in result.tool_calls]
        msgs.append(Message("assistant", result.content, tool_calls=calls))
        msgs += [Message("tool", prose(rng, rng.randint(200, 600)), tool_call_id=c.id) for c in calls]

    def tool_turn() -> str:
        args = {"path": f"src/{rng.choice(WORDS)}_{rng.randint(0, 99)}.py", "limit": rng.randint(10, 400)}
        call_json = json.dumps({"name": "read_file", "arguments": args})
        return f"{prose(rng, rng.randint(10, 80))}<tool_call>\n{call_json}\n</tool_call>"

    system, sub_system = prose(rng, 3000), prose(rng, 1500)
    sub_turns = [rng.randint(5, 20) for _ in range(5)]
    n_main = total_calls - sum(sub_turns) - 2  # two summary calls
    compact_at, sub_start = {n_main // 3, 2 * n_main // 3}, {int(n_main * (k + 0.5) / 5): k for k in range(5)}
    main, active = [Message("system", system), Message("user", prose(rng, 800))], []
    for i in range(n_main):
        if i in compact_at:
            main.append(Message("user", "Summarize the conversation so far in detail; it will be compacted."))
            call(main, "Summary: " + prose(rng, 1200))
            summary = main[-1].content
            main = [Message("system", system), Message("user", "This session is being continued from a previous "
                                                               f"conversation that ran out of context. {summary}")]
        call(main, tool_turn())
        if i in sub_start:  # the sub-agents share an agent-type system prompt, each with its own task
            active.append([[Message("system", sub_system), Message("user", f"Task {i}: {prose(rng, 300)}")],
                           sub_turns[sub_start[i]]])
        for sub in active:  # each running sub-agent takes one turn per main turn
            sub[1] -= 1
            call(sub[0], tool_turn() if sub[1] > 0 else "Report: " + prose(rng, 400))
        active = [sub for sub in active if sub[1] > 0]
    for msgs, left in active:
        for t in range(left):
            call(msgs, tool_turn() if t < left - 1 else "Report: " + prose(rng, 400))
    return ex, prep_t


# --- report ----------------------------------------------------------------------------------------


def report(r: dict, verbose: bool) -> None:
    def table(title, head, fields, widths):
        print(title)
        print(" ".join(f"{h:>{w}}" for h, w in zip(head, widths)))
        for k, v in p1.items():
            cells = [k] + [f"{v[f]:.0f}" if f in ("prompt_tokens", "messages", "n", "full_gcs") else f"{v[f] * 1e3:.3f}"
                           for f in fields]
            print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))

    p1, t, rr, p = ({k: v for k, v in r["part1"].items() if k != "profile"}, r["targets"], r["repeated_replies"],
                    r["part2"])
    table("Part 1: wall latency per call, ms, at the client (added = proxy - direct; its p99 = p99(proxy) - "
          "p99(direct))", ("context", "prompt tok", "msgs", "n", "direct p50", "p99", "proxy p50", "p99", "added p50",
                           "p99", "null HTTP"),
          ("prompt_tokens", "messages", "n", "direct_p50", "direct_p99", "proxy_p50", "proxy_p99", "added_p50",
           "added_p99", "null_http_p50"), (8, 10, 5, 5, 10, 8, 10, 8, 10, 8, 10))
    table("\nServer side CPU per call, ms (server process per request, median; prepare, complete: main thread;\n"
          "parse: orjson + parse_request on the last body, timed alone; GC: wall pause of this process's\n"
          "collections per proxied request, and the count and longest of full (gen 2) ones)",
          ("context", "CPU direct", "CPU proxy", "added CPU", "parse", "prepare p50", "p99", "complete", "GC/req",
           "full GCs", "max"),
          ("cpu_direct", "cpu_proxy", "added_cpu", "parse", "prepare_p50", "prepare_p99", "complete_p50", "gc_per_req",
           "full_gcs", "full_gc_max"), (8, 10, 10, 10, 8, 11, 8, 8, 8, 8, 8))
    ok = {True: "met", False: "NOT met"}
    print(f"\nTarget added p50 <= 1 ms at 32k: {t['added_p50_32k_ms']:.3f} ms -> {ok[t['added_p50_ok']]}")
    print(f"Target added CPU flat (<= 2x) from 1k to 200k: {t['cpu_ratio_200k_over_1k']:.1f}x -> {ok[t['cpu_flat_ok']]}"
          f"\nAt 32k, p50: proxy/direct {t['proxy_over_direct_32k']:.1f}x, "
          f"proxy/null HTTP {t['proxy_over_null_32k']:.1f}x")
    if verbose and "profile" in r["part1"]:
        print("\n" + r["part1"]["profile"].rstrip())
    print(f"\nPart 1b: prepare() CPU after {rr['calls']} calls (median of the last 20): unique replies "
          f"{rr['unique'] * 1e3:.2f} ms, identical replies {rr['identical'] * 1e3:.2f} ms "
          f"({rr['identical'] / rr['unique']:.1f}x)")
    u = p["unique_tokens"]
    print(f"\nPart 2: {p['calls']}-call execution (2 compactions, 5 sub-agents), longest prompt "
          f"{p['max_prompt']} tokens\n"
          f"  nodes {p['nodes']}, roots {p['roots']}, leaves {p['leaves']} ({', '.join(p['leaf_roles'])})\n"
          f"  new prompt tokens encoded per call {p['new_prompt_tokens_mean']:.0f} (mean); recorded outputs not "
          f"recognised when sent back: {p['output_copies']}\n"
          f"  unique stored tokens {u}, fully expanded (sum of leaf paths) {p['expanded_tokens']} "
          f"({p['expanded_tokens'] / u:.2f}x), policy {p['policy_tokens']}\n"
          f"  one record per call (prompt + output) {p['per_call_tokens']} ({p['per_call_tokens'] / u:.0f}x)")
    for j in ("J1", "J5", "Jinf"):
        a = p[j]
        print(f"  {j:>4}: {a['trajectories']} trajectories, target tokens {a['target_tokens']:>6}, forward tokens "
              f"{a['forward_tokens']:>6} ({', '.join(a['roles'])})")
    print(f"  forward at J=5: {p['J5_forward_pct_of_inf']:.1f}% of unlimited (paper: 74.8%); targets "
          f"{p['J5_target_pct_of_inf']:.1f}%\n  prepare() CPU per call: mean {p['prepare_mean'] * 1e3:.2f} ms, "
          f"p99 {p['prepare_p99'] * 1e3:.2f} ms, max {p['prepare_max'] * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer requests per size, a shorter Part 1b")
    ap.add_argument("--verbose", action="store_true", help="also profile the server at the largest context")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # in a child: torch's objects would slow this process's GC
        subprocess.run([sys.executable, "-c", "import sys; from gyre.workerd.modeldir import init_tiny; "
                        "init_tiny(sys.argv[1])", tmp], check=True)
        tok = ChatTokenizer(tmp)
    q, started = args.quick, time.perf_counter()
    sizes = {"1k": (1_000, 60 if q else 1000), "32k": (32_000, 60 if q else 1000), "200k": (200_000, 30 if q else 400)}
    r = {"quick": q, "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    r["part1"] = p1 = asyncio.run(part1(tok, sizes, args.verbose))
    r["repeated_replies"] = repeated_replies(tok, 150 if q else 400)
    r["part2"] = part2(tok)
    r["targets"] = t = {"added_p50_32k_ms": p1["32k"]["added_p50"] * 1e3,
                        "cpu_ratio_200k_over_1k": p1["200k"]["added_cpu"] / p1["1k"]["added_cpu"],
                        "proxy_over_direct_32k": p1["32k"]["proxy_p50"] / p1["32k"]["direct_p50"],
                        "proxy_over_null_32k": p1["32k"]["proxy_p50"] / p1["32k"]["null_http_p50"]}
    t["added_p50_ok"], t["cpu_flat_ok"] = t["added_p50_32k_ms"] <= 1.0, t["cpu_ratio_200k_over_1k"] <= 2.0
    r["wall_s"] = time.perf_counter() - started
    report(r, args.verbose)
    print(f"\n(total {r['wall_s']:.1f} s)")
    p1.pop("profile", None)
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    print(json.dumps(r))


if __name__ == "__main__":
    main()
