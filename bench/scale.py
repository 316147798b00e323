"""bench/scale.py: the data plane at scale: many live executions, a call rate, and a training step packed mid-load.

N executions are registered on a real ProxyServer (127.0.0.1, port 0, a run dir as the
coordinator gives it, its GcPolicy as the coordinator runs it: a gc.freeze() after start-up and
every --gc-freeze-every-s, the preload standing for the hours before the window) whose backend is a
scripted responder: every call is answered at once, in the loop, with one short tool call and
its log-probs (no model). Before the timed window each execution is driven in-process through
the public paths a call takes (api_openai.parse_request with the execution's memo,
Recorder.record_reply, render_result) to a random point of its life: up to two earlier
contexts compacted at 0.5-1x --max-context, a current main context uniform in
[0, --max-context], up to five sub-agents. Its main history then goes to a client process that,
over real HTTP, sends a few idle calls one at a time and then a fixed total call rate for
--seconds (random idle executions; each call appends tool results to that execution's history,
sends it whole and appends the reply). In this process a 10 ms sleep probe measures event-loop
lateness while serving; half-way through, a real coordinator.training.Batch packs --groups x
--group-size of the executions (Execution / Group / TrajectoryBuffer as the coordinator builds
them) and sends its micro-steps to a stand-in link, and the probe's samples during Batch.run()
are the packing lag. After the window the same step is packed again quietly for its CPU time
and its wire bytes.

Figures: loop lag = lateness of each 10 ms probe sleep (while serving: the window outside
Batch.run(); while packing: samples that overlap it); proxy latency = the client's wall time
per call, body serialised before the clock (the responder takes ~0, so it is the proxy's and
the transport's), idle = one at a time before the load; bytes_per_unique_token = RSS growth
over the preload (gc.collect() before each reading) / the trees' unique tokens (Tree.stats);
pack_cpu_s_per_step = process_time() around the quiet Batch.run(); wire_bytes_over_unique =
the frames' bytes of that step / (4 x the tokens of the nodes on any admitted path, once per
execution; admission as packing runs it). Indicative on a shared machine: each stall also
gives the loop thread's CPU in it (little CPU: the process was descheduled). Not a test. Run:
    python bench/scale.py [--quick] [--executions N] [--seconds S] [--rate R] [--model DIR] [--json PATH]
--model DIR takes that directory's tokenizer and chat template (a real BPE such as SmolLM2's, about
4 characters a token, where the tiny model's is one a byte), so bytes per token are a real model's.
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
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import orjson
import uvloop

from gyre.coordinator.buffer import Execution, Group, TrajectoryBuffer
from gyre.coordinator.config import CoordinatorConfig
from gyre.coordinator.training import Batch
from gyre.coordinator.waterlevel import ExecState, Tracked
from gyre.proxy import api_openai

try:
    from gyre.coordinator.gcpolicy import GcPolicy
except ImportError:  # older code: one gc.freeze() at the end of start-up, nothing after
    class GcPolicy:  # noqa: D101 - the stand-in for measuring the code before the policy
        def __init__(self, every_s: float = 0.0):
            self.every_s = 0.0

        def start(self) -> None:
            gc.collect()
            gc.freeze()

        def freeze(self) -> None:
            pass

        async def stop(self) -> None:
            pass

        def status(self) -> dict:
            return {"freeze_every_s": 0.0}

        @staticmethod
        def collect_frozen() -> dict:
            return {}
try:
    from gyre.coordinator.main import SWITCH_INTERVAL_S
except ImportError:  # older code: CPython's default
    SWITCH_INTERVAL_S = 0.005
from gyre.proxy.admission import admit
from gyre.proxy.backend import Chunk
from gyre.proxy.chat import ChatTokenizer
from gyre.proxy.recorder import Recorder
from gyre.proxy.server import ProxyConfig, ProxyServer
from gyre.workerd import wire

MODEL = "gyre-policy"
WORDS = ("the of and to in is for def return self value list dict import from class data path file line error "
         "test result config parser token node tree call request output write read assert raise None").split()
TOOLS = [{"type": "function", "function": {"name": name, "description": desc, "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}}}}
    for name, desc, arg in (("read_file", "Read a file from the repository", "path"), ("bash", "Run a command", "cmd"))]
SUMMARIZE = "Summarize the conversation so far in detail; it will be compacted."


def corpus(seed: int, n: int = 1 << 22) -> str:
    """Random prose; texts are slices of it at random offsets (cheaper than drawing words)."""
    rng = random.Random(seed)
    return "".join(rng.choice(WORDS) + ("\n" if rng.random() < 0.08 else " ") for _ in range(n // 4))


def text(rng: random.Random, prose: str, lo: int, hi: int) -> str:
    n = rng.randint(lo, hi)
    i = rng.randrange(len(prose) - n)
    return prose[i:i + n]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def summary(xs: list[float], scale: float = 1e3) -> dict:
    """p50, p99, max (None when there are no samples) and the count."""
    if not xs:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    return {"p50": pct(xs, 50) * scale, "p99": pct(xs, 99) * scale, "max": max(xs) * scale, "n": len(xs)}


def ms(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def stop_id(tok: ChatTokenizer) -> int:
    """The id that ends a ChatML turn (<|im_end|>: the tiny model and SmolLM2 are ChatML)."""
    ids = tok.encode("<|im_end|>")
    return ids[0] if len(ids) == 1 and ids[0] in tok.stop_token_ids else min(tok.stop_token_ids)


def reserialise(msg: dict) -> dict:
    """The harness re-serialises tool-call arguments (indent, key order); the proxy restores them by id."""
    for c in msg.get("tool_calls") or []:
        c["function"]["arguments"] = json.dumps(json.loads(c["function"]["arguments"]), indent=1, sort_keys=True)
    return msg


def tool_results(rng: random.Random, prose: str, msgs: list[dict], lo: int, hi: int) -> None:
    calls = msgs[-1].get("tool_calls") or []
    msgs += [{"role": "tool", "tool_call_id": c["id"], "content": text(rng, prose, lo, hi)} for c in calls]
    if not calls:
        msgs.append({"role": "user", "content": text(rng, prose, lo, hi)})


# --- the scripted responder (the proxy's backend) ---------------------------------------------


class InstantBackend:
    """Answers every call at once, in this loop, with one chunk: a short tool call + <|im_end|>."""

    def __init__(self, tok: ChatTokenizer):
        self.tok, self.n, self.stop = tok, 0, stop_id(tok)

    async def generate(self, rid, prompt_ids, params, execution=None):
        self.n += 1
        ids = self.tok.encode(f'<tool_call>\n{{"name": "bash", "arguments": {{"cmd": "ls {self.n}"}}}}\n</tool_call>')
        ids = (ids + [self.stop])[:params.max_new_tokens]
        yield Chunk(token_ids=ids, logprobs=[-0.5] * len(ids), version=0, finished=True, finish_reason="stop",
                    engine="bench")

    async def abort(self, rid) -> None:
        return None

    def forget(self, execution) -> None:
        return None


# --- an execution's life before the window, in-process ------------------------------------------


class Life:
    """Drives one Recorder as the server would drive it for each call (parse with the memo,
    prepare, the model's output parsed and completed, the reply rendered for the harness)."""

    def __init__(self, ex: Recorder, tok: ChatTokenizer, rng: random.Random, prose: str):
        self.ex, self.tok, self.rng, self.prose, self.calls = ex, tok, rng, prose, 0
        self.stop = stop_id(tok)

    def call(self, msgs: list[dict], output: str) -> tuple[dict, int]:
        """The reply message as the harness receives it, and the call's context (prompt + output)."""
        ex, tok = self.ex, self.tok
        req = api_openai.parse_request({"model": MODEL, "messages": list(msgs), "tools": TOOLS}, {},
                                       memo=ex.parse_memo)
        result, _ = ex.record_reply(req, tok.encode(output) + [self.stop], engine="bench")
        self.calls += 1
        reply = reserialise(api_openai.render_result(result, req)["choices"][0]["message"])
        return reply, result.usage.input_tokens + result.usage.output_tokens

    def tool_turn(self) -> str:
        rng = self.rng
        args = {"path": f"src/{rng.choice(WORDS)}_{rng.randint(0, 99)}.py", "limit": rng.randint(10, 400)}
        return f"{text(rng, self.prose, 10, 80)}<tool_call>\n{json.dumps({'name': 'read_file', 'arguments': args})}" \
               "\n</tool_call>"

    def sub_agent(self, system: str) -> None:
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": f"Task: {text(self.rng, self.prose, 100, 300)}"}]
        turns = self.rng.randint(5, 20)
        for t in range(turns):
            last = t == turns - 1
            reply, _ = self.call(msgs, "Report: " + text(self.rng, self.prose, 200, 400) if last else self.tool_turn())
            msgs.append(reply)
            if not last:
                tool_results(self.rng, self.prose, msgs, 200, 600)

    def run(self, system: str, sub_system: str, max_context: int) -> tuple[list[dict], int]:
        """Earlier contexts compacted at 0.5-1x max_context (0-2 of them), then the current one
        to a uniform size; sub-agents at uniform points of the whole life. Returns the main
        history (ending with the model's last reply) and its context."""
        rng = self.rng
        targets = [rng.uniform(0.5, 1.0) * max_context for _ in range(rng.randint(0, 2))]
        targets.append(rng.uniform(0, max_context))
        subs = sorted(rng.uniform(0, sum(targets)) for _ in range(rng.randint(0, 5)))
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": text(rng, self.prose, 200, 800)}]
        grown = 0.0
        for k, target in enumerate(targets):
            ctx = before = 0
            while True:
                reply, ctx = self.call(msgs, self.tool_turn())
                msgs.append(reply)
                grown, before = grown + ctx - before, ctx
                while subs and subs[0] <= grown:
                    subs.pop(0)
                    self.sub_agent(sub_system)
                if ctx >= target:
                    break
                tool_results(rng, self.prose, msgs, 200, 4000)
            if k < len(targets) - 1:  # compaction: a summary call, then a fresh context that carries it
                tool_results(rng, self.prose, msgs, 200, 4000)
                msgs.append({"role": "user", "content": SUMMARIZE})
                reply, _ = self.call(msgs, "Summary: " + text(rng, self.prose, 800, 1200))
                carry = f"This session is being continued from a previous conversation that ran out of context. " \
                        f"{reply['content']}"
                msgs = [msgs[0], {"role": "user", "content": carry}]
        return msgs, ctx


def preload(server: ProxyServer, tok: ChatTokenizer, args, histories: Path) -> dict:
    prose = corpus(args.seed)
    rng = random.Random(args.seed)
    system, sub_system = text(rng, prose, 3000, 3000), text(rng, prose, 1500, 1500)
    contexts, calls, t0 = [], 0, time.perf_counter()
    with open(histories, "wb") as f:
        for i in range(args.executions):
            ex = server.register(f"bench-{i:05d}")
            life = Life(ex, tok, random.Random(args.seed * 1_000_003 + i), prose)
            msgs, ctx = life.run(system, sub_system, args.max_context)
            f.write(orjson.dumps({"key": ex.key, "messages": msgs}) + b"\n")
            contexts.append(ctx)
            calls += life.calls
            if (i + 1) % max(1, args.executions // 10) == 0:
                print(f"  preloaded {i + 1}/{args.executions} executions, {calls} calls, "
                      f"{time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return {"calls": calls, "seconds": time.perf_counter() - t0, "context_mean": sum(contexts) / len(contexts),
            "context_max": max(contexts)}


# --- the client, in its own process -----------------------------------------------------------------


def client_main(conn) -> None:
    uvloop.run(client(conn, **conn.recv()))


async def client(conn, url: str, histories: str, idle_calls: int, rate: float, seconds: float, seed: int,
                 timeout_s: float) -> None:
    execs = [orjson.loads(line) for line in Path(histories).read_bytes().splitlines()]
    rng, prose = random.Random(seed + 7), corpus(seed + 7)
    busy: set[int] = set()
    failures: dict[str, int] = {}
    done: list[tuple[float, float, float]] = []  # (start, finish, latency) of each ok call, monotonic

    async def one(session, i: int) -> float | None:
        e = execs[i]
        msgs, n = e["messages"], len(e["messages"])
        tool_results(rng, prose, msgs, 200, 4000)
        body = orjson.dumps({"model": MODEL, "messages": msgs, "tools": TOOLS})  # harness-side work, untimed
        headers = {"Authorization": f"Bearer {e['key']}", "Content-Type": "application/json"}
        busy.add(i)
        m0, t0 = time.monotonic(), time.perf_counter()
        try:
            async with session.post(url, data=body, headers=headers) as r:
                raw = await r.read()
            dt = time.perf_counter() - t0
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {raw[:200].decode(errors='replace')}")
            msgs.append(reserialise(orjson.loads(raw)["choices"][0]["message"]))
            done.append((m0, time.monotonic(), dt))
            return dt
        except Exception as ex:  # noqa: BLE001 - counted and reported by kind
            kind = f"{type(ex).__name__}: {ex}"[:160]
            failures[kind] = failures.get(kind, 0) + 1
            del msgs[n:]  # the harness would retry from where it was
            return None
        finally:
            busy.discard(i)

    def pick() -> int | None:
        for _ in range(16):
            i = rng.randrange(len(execs))
            if i not in busy:
                return i
        free = [i for i in range(len(execs)) if i not in busy]
        return rng.choice(free) if free else None

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        idle = [dt for _ in range(idle_calls) if (dt := await one(session, pick())) is not None]
        idle_failed = sum(failures.values())
        done.clear()
        t0 = time.monotonic()
        conn.send(("load", t0))
        tasks, k, skipped, behind = set(), 0, 0, 0.0
        while (due := t0 + k / rate) < t0 + seconds:
            if (delay := due - time.monotonic()) > 0:
                await asyncio.sleep(delay)  # the rate scheduler
            else:
                behind = max(behind, -delay)
            k += 1
            if (i := pick()) is None:
                skipped += 1
                continue
            task = asyncio.create_task(one(session, i))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        end = t0 + seconds
        await asyncio.sleep(max(0.0, end - time.monotonic()))  # the scheduler's window ends
        in_flight_at_end = len(tasks)
        await asyncio.gather(*tasks)
    conn.send(("done", {
        "idle": idle, "idle_failed": idle_failed, "scheduled": k, "skipped_busy": skipped,
        "sent": k - skipped, "ok": len(done), "failed": sum(failures.values()) - idle_failed,
        "failures": failures, "in_flight_at_end": in_flight_at_end, "scheduler_behind_max_s": behind,
        "load": done, "ok_in_window": sum(t <= end for _, t, _ in done), "t0": t0, "end": end}))


# --- the training step: a real Batch over a stand-in link ----------------------------------------



def target_tokens(tensors) -> int:
    """Trained tokens of a micro-step in either form: path rows' target mask, or the tree
    form's target segments (getattr: older code has only the path form)."""
    named = {f.name: f.data for f in tensors}
    if getattr(wire, "TREE_INPUT_IDS", None) in named:
        return int(named[wire.TREE_SEG_LEN][named[wire.TREE_SEG_TARGET].astype(bool)].sum())
    return int(named[wire.TARGET_MASK].sum())

class StandInLink:
    """Implements what Batch uses of coordinator/link.py. Each reply is ready at once; the
    await yields to the loop once, as the real link's wait on its reply future does."""

    def __init__(self):
        self.wire_bytes = self.micro_steps = self.target_tokens = 0

    async def request(self, node, msg, tensors=None, timeout=None):
        await asyncio.sleep(0)
        if isinstance(msg, wire.TrainMicroStep):
            self.micro_steps += 1
            self.wire_bytes += sum(f.data.nbytes for f in tensors)
            tokens = target_tokens(tensors)
            self.target_tokens += tokens
            return wire.TrainResult(req_id=msg.req_id, loss=0.0, tokens=tokens, executions=0, seconds=0.0,
                                    mismatch_kl=0.0)
        if isinstance(msg, wire.SetParticipants):
            return wire.Done(req_id=msg.req_id)
        if isinstance(msg, wire.OptimizerStep):
            return wire.StepResult(req_id=msg.req_id, version=1, grad_norm=0.0, seconds=0.0)
        raise TypeError(f"the stand-in link does not answer {type(msg).__name__}")


def ready_buffer(recorders: list[Recorder], groups: int, size: int, seed: int) -> TrajectoryBuffer:
    """The step's groups as the coordinator holds them: closed, valid, rewarded, ready."""
    rng = random.Random(seed)
    buf = TrajectoryBuffer(min_valid=2)
    for g in range(groups):
        runs = [Execution(id=ex.id, group=g, index=j, task=None, tracked=Tracked(state=ExecState.CLOSED),
                          version_dispatched=0, status="ok", reward=rng.random(), valid=True, recorder=ex)
                for j, ex in enumerate(recorders[g * size:(g + 1) * size])]
        group = Group(id=g, task=None, version=0, size=size, runs=runs)
        buf.add(group)
        buf.on_closed(runs[-1])
        assert group.state == "ready", group.state
    return buf


async def pack_step(recorders: list[Recorder], cfg: CoordinatorConfig, size: int, state=None) -> dict:
    link, buffer = StandInLink(), ready_buffer(recorders, cfg.groups_per_step, size, cfg.seed)
    batch = Batch([0], link=link, nodes=["bench-cell-0"], buffer=buffer, config=cfg, changed=asyncio.Event(),
                  trains=lambda cell: True, step=0, train_busy_s={})
    if state is not None:
        state.packing, state.epoch, state.pack_span = True, state.epoch + 1, (time.monotonic(), float("inf"))
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        res = await batch.run()
    finally:
        if state is not None:
            state.packing, state.epoch, state.pack_span = False, state.epoch + 1, (state.pack_span[0],
                                                                                   time.monotonic())
    return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "wire_bytes": link.wire_bytes,
            "micro_steps": link.micro_steps, "target_tokens": link.target_tokens, "executions": res.executions}


def unique_admitted(recorders: list[Recorder], cfg: CoordinatorConfig, size: int) -> int:
    """Tokens of the tree nodes on any admitted path, each node once per execution (the
    admission packing.py runs: same j_max, same seed per group)."""
    total = 0
    for g in range(cfg.groups_per_step):
        for ex in recorders[g * size:(g + 1) * size]:
            trajs = admit(ex.tree, ex.leaf_roles, j_max=cfg.j_max, rng=random.Random(cfg.seed + g))
            if any(t.targets for t in trajs):
                total += sum(len(ex.tree.nodes[n].tokens) for n in set().union(*(t.path for t in trajs)))
    return total


# --- the server side -----------------------------------------------------------------------------------


async def probe(state, period: float = 0.01) -> None:
    """Event-loop lateness of a `period` sleep, filed under packing or serving, with the
    loop thread's CPU over the sample (a stall with little CPU: the process was descheduled)."""
    while True:
        epoch, t0, c0 = state.epoch, time.perf_counter(), time.thread_time()
        await asyncio.sleep(period)
        late = max(0.0, time.perf_counter() - t0 - period)
        phase = "packing" if state.packing or state.epoch != epoch else "serving" if state.window else None
        if phase is not None:
            state.lag[phase].append(late)
            state.stalls[phase].append((late, time.monotonic() - state.t0, time.thread_time() - c0))


def watch_gc(state) -> None:
    """Each collection's (generation, pause), filed under packing or serving."""
    start = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            start[0] = time.perf_counter()
        elif state.packing or state.window:
            state.gcs["packing" if state.packing else "serving"].append(
                (info["generation"], time.perf_counter() - start[0]))

    gc.callbacks.append(on_gc)


def gc_figures(pauses: list[tuple[int, float]]) -> dict:
    full = [p for g, p in pauses if g == 2]
    return {"collections": len(pauses), "total_ms": 1e3 * sum(p for _, p in pauses),
            "max_ms": 1e3 * max((p for _, p in pauses), default=0.0), "full": len(full),
            "full_max_ms": 1e3 * max(full, default=0.0)}


def listen(loop, conn, proc, inbox: asyncio.Queue) -> None:
    """The client's messages, then ("exit", code) once it has gone, onto `inbox` (no thread)."""

    def receive() -> None:
        try:
            while conn.poll():
                inbox.put_nowait(conn.recv())
        except (EOFError, OSError):
            loop.remove_reader(conn.fileno())

    def gone() -> None:
        receive()  # whatever it sent before exiting comes first
        loop.remove_reader(proc.sentinel)
        proc.join(5)
        inbox.put_nowait(("exit", proc.exitcode))

    loop.add_reader(conn.fileno(), receive)
    loop.add_reader(proc.sentinel, gone)


async def serve(args, tok: ChatTokenizer, model_dir: Path, root: Path) -> dict:
    server = ProxyServer(tok, InstantBackend(tok), ProxyConfig(max_context=2 * args.max_context + 65536),
                         run_dir=root / "run")
    url = await server.start() + "/v1/chat/completions"
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    client_proc = ctx.Process(target=client_main, args=(child_conn,), daemon=True)
    client_proc.start()
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as the coordinator sets it (its packing runs in a thread)
    policy = GcPolicy(args.gc_freeze_every_s)
    policy.start()  # as the coordinator does at the end of its start-up
    rss0 = rss()
    print(f"preloading {args.executions} executions (contexts up to {args.max_context} tokens) ...", file=sys.stderr)
    r = {"preload": preload(server, tok, args, root / "histories.jsonl")}
    gc.collect()
    if args.gc_freeze_every_s:
        policy.freeze()  # the preload stands for hours of the coordinator's life, freezes included
    recorders = list(server.executions.values())
    unique = sum(ex.tree.stats()["unique_tokens"] for ex in recorders)
    grown = rss() - rss0
    r.update(rss_growth_bytes=grown, unique_tokens=unique, bytes_per_unique_token=grown / unique)

    state = SimpleNamespace(window=False, packing=False, epoch=0, t0=0.0, cpu_s=0.0, records=[], pack_span=(0.0, 0.0),
                            **{k: {"serving": [], "packing": []} for k in ("lag", "stalls", "gcs")})
    server.on_record = lambda ex, rec: state.window and state.records.append(
        (rec["status"], rec["prompt_tokens"], rec["new_prompt_tokens"]))
    loop, inbox = asyncio.get_running_loop(), asyncio.Queue()
    listen(loop, conn, client_proc, inbox)
    watch_gc(state)
    probe_task = asyncio.create_task(probe(state))
    cfg = CoordinatorConfig(run_dir=root / "run", model_dir=model_dir, groups_per_step=args.groups,
                            group_size=args.group_size, j_max=args.j_max or None,
                            micro_step_tokens=args.micro_step_tokens, seed=args.seed,
                            **({"packing": args.packing} if hasattr(args, "packing") else {}))
    step_execs = random.Random(args.seed).sample(recorders, args.groups * args.group_size)
    conn.send({"url": url, "histories": str(root / "histories.jsonl"), "idle_calls": args.idle_calls,
               "rate": args.rate, "seconds": args.seconds, "seed": args.seed, "timeout_s": args.call_timeout})
    packing: dict = {}

    async def pack_midway() -> None:
        await asyncio.sleep(args.seconds * 0.5)  # part-way through the window
        packing["rss_before_growth_bytes"] = rss() - rss0  # what serving added since loading (no collection)
        packing.update(await pack_step(step_execs, cfg, args.group_size, state))

    pack_task = None
    while True:
        kind, payload = await inbox.get()
        if kind == "exit":
            raise SystemExit(f"bench/scale.py: the client process exited ({payload}) before reporting")
        if kind == "load":
            state.window, state.t0, cpu0 = True, payload, time.process_time()
            pack_task = asyncio.create_task(pack_midway())
        elif kind == "done":
            state.window, state.cpu_s = False, time.process_time() - cpu0
            break
    calls = payload
    if pack_task is not None:
        await pack_task  # a window shorter than the packing: it finished after
    probe_task.cancel()
    for fd in (conn.fileno(), client_proc.sentinel):
        loop.remove_reader(fd)
    client_proc.join(30)

    r["unique_admitted_tokens"] = unique_admitted(step_execs, cfg, args.group_size)
    quiet = await pack_step(step_execs, cfg, args.group_size)
    if args.profile:  # a third packing, so the profiler's overhead stays out of the figures
        prof = cProfile.Profile()
        prof.enable()
        await pack_step(step_execs, cfg, args.group_size)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(18)
        r["profile"] = buf.getvalue()
    gc.collect()
    r["gc_policy"] = {**policy.status(), "collect_frozen": policy.collect_frozen()}
    await policy.stop()
    r.update(rss_after_window_growth_bytes=rss() - rss0, rss_peak_growth_bytes=rss_peak() - rss0,
             unique_tokens_after_window=sum(ex.tree.stats()["unique_tokens"] for ex in recorders))
    await server.stop()
    r.update(calls=calls, packing_in_window=packing, quiet=quiet, state=state)
    return r


def results(args, r: dict) -> dict:
    c, s = r.pop("calls"), r.pop("state")
    p0, p1 = s.pack_span
    load = [dt for _, _, dt in c["load"]]
    during = [dt for a, b, dt in c.pop("load") if a < p1 and b > p0]  # overlapping Batch.run()
    achieved = c["ok_in_window"] / args.seconds

    def top(phase: str) -> list[dict]:
        return [{"ms": late * 1e3, "at_s": at, "cpu_ms": cpu * 1e3}
                for late, at, cpu in sorted(s.stalls[phase], reverse=True)[:5]]
    records = s.records
    q, packed = r.pop("quiet"), r.pop("packing_in_window")
    out = {
        "packing_form": getattr(args, "packing", "paths"), "executions": args.executions, "rate": args.rate,
        "seconds": args.seconds, "max_context": args.max_context,
        "groups": args.groups, "group_size": args.group_size, "cpus": os.cpu_count(), "loadavg": os.getloadavg(),
        "rate_achieved": achieved, "rate_met": achieved >= 0.95 * args.rate and c["skipped_busy"] == 0,
        "calls_done": c["ok_in_window"], **{f"calls_{k}": v for k, v in c.items() if k not in ("idle", "t0", "end")},
        "proxy_latency_ms": {"idle": summary(c["idle"]), "load": summary(load), "during_packing": summary(during)},
        "serving": {"loop_lag_ms": summary(s.lag["serving"]),
                    "top_stalls": top("serving"),
                    "gc": gc_figures(s.gcs["serving"]),
                    "records": len(records), "record_errors": sum(st != "ok" for st, _, _ in records),
                    "prompt_tokens_mean": sum(p for _, p, _ in records) / max(1, len(records)),
                    "new_prompt_tokens_mean": sum(n for _, _, n in records) / max(1, len(records)),
                    # this process's CPU in the window (its packing and the probe included); per call:
                    # less the quiet packing's CPU (in the window, packing and serving interleave)
                    "cpu_s": s.cpu_s, "cpu_ms_per_call": 1e3 * max(0.0, s.cpu_s - q["cpu_s"]) / max(1, len(records))},
        "packing": {"loop_lag_ms": summary(s.lag["packing"]), "top_stalls": top("packing"),
                    "gc": gc_figures(s.gcs["packing"]), **packed},
        "pack_cpu_s_per_step": q["cpu_s"], "pack_wall_s_quiet": q["wall_s"], "wire_bytes": q["wire_bytes"],
        "micro_steps": q["micro_steps"], "step_target_tokens": q["target_tokens"], "step_executions": q["executions"],
        **r,
    }
    idle_p50, load_p50 = out["proxy_latency_ms"]["idle"]["p50"], out["proxy_latency_ms"]["load"]["p50"]
    out["proxy_latency_ms"]["load_over_idle_p50"] = load_p50 / idle_p50 if idle_p50 and load_p50 else None
    out["wire_bytes_over_unique"] = q["wire_bytes"] / (4 * r["unique_admitted_tokens"])
    return out


def gc_policy(g: dict) -> str:
    if not g.get("freeze_every_s"):
        return "off: Python's collector, one gc.freeze() at start-up"
    cf = g.get("collect_frozen", {})
    return (f"gc.freeze() every {g['freeze_every_s']:g} s ({g['freezes']} in all); a full collection of the "
            f"{cf.get('frozen_objects', 0):,} frozen objects found {cf.get('unreachable_found', 0)} unreachable "
            f"({cf.get('pause_ms', 0):,.0f} ms)")


def report(o: dict) -> None:
    lat, sl, pk, pre = o["proxy_latency_ms"], o["serving"]["loop_lag_ms"], o["packing"], o["preload"]

    def lag(x):
        return f"p50 {ms(x['p50'])}  p99 {ms(x['p99'])}  max {ms(x['max'], 1)}  (n {x['n']})"

    def gcs(x):
        return (f"{x['collections']} collections, {x['total_ms']:.0f} ms in all, longest {x['max_ms']:.0f} ms; "
                f"full: {x['full']}, longest {x['full_max_ms']:.0f} ms")

    def stalls(xs):
        return ", ".join(f"{x['ms']:.0f} ({x['cpu_ms']:.0f}) @{x['at_s']:.0f}s" for x in xs)

    rows = [
        ("tokenizer", f"{o.get('model', 'tiny')}, vocabulary {o.get('vocab_size', '-'):,}"),
        ("executions (preloaded in-process)", f"{o['executions']}: {pre['calls']} calls in {pre['seconds']:.0f} s; "
                                              f"main context mean {pre['context_mean']:.0f}, max {pre['context_max']}"),
        ("unique stored tokens (all trees)", f"{o['unique_tokens']:,}"),
        ("coordinator RSS growth, loaded", f"{o['rss_growth_bytes'] / 2**20:,.0f} MiB = "
                                           f"{o['bytes_per_unique_token']:.1f} B/unique token"),
        ("  before the in-window packing", f"{o['packing'].get('rss_before_growth_bytes', 0) / 2**20:,.0f} MiB"),
        ("  after the window and the packings", f"{o['rss_after_window_growth_bytes'] / 2**20:,.0f} MiB "
                                              f"({o['unique_tokens_after_window']:,} unique tokens); peak "
                                              f"{o['rss_peak_growth_bytes'] / 2**20:,.0f} MiB over start"),
        ("call rate target / achieved", f"{o['rate']:.2f} / {o['rate_achieved']:.2f} calls/s over {o['seconds']:g} s"
                                        f" -> {'met' if o['rate_met'] else 'FELL SHORT'}"),
        ("calls scheduled / sent / ok / failed", f"{o['calls_scheduled']} / {o['calls_sent']} / {o['calls_ok']} / "
                                                 f"{o['calls_failed']} (skipped, all busy: {o['calls_skipped_busy']};"
                                                 f" in flight at end {o['calls_in_flight_at_end']})"),
        ("ok within the window", f"{o['calls_done']}; client scheduler behind by at most "
                                 f"{o['calls_scheduler_behind_max_s'] * 1e3:.0f} ms"),
        ("proxy latency idle, ms", f"p50 {ms(lat['idle']['p50'])}  p99 {ms(lat['idle']['p99'])}  "
                                   f"(n {lat['idle']['n']}, one at a time)"),
        ("proxy latency under load, ms", f"p50 {ms(lat['load']['p50'])}  p99 {ms(lat['load']['p99'])}  "
                                         f"(load/idle p50 {ms(lat['load_over_idle_p50'])}x, n {lat['load']['n']})"),
        ("  calls overlapping Batch.run()", f"p50 {ms(lat['during_packing']['p50'])}  max "
                                            f"{ms(lat['during_packing']['max'])}  (n {lat['during_packing']['n']})"),
        ("window calls: prompt / new tokens", f"{o['serving']['prompt_tokens_mean']:.0f} / "
                                              f"{o['serving']['new_prompt_tokens_mean']:.0f} mean per call"),
        ("server CPU in the window", f"{o['serving']['cpu_s'] / o['seconds']:.0%} of a core, packing and probe "
                                     f"included; {o['serving']['cpu_ms_per_call']:.1f} ms per call"),
        ("loop lag while serving, ms", lag(sl)),
        ("  longest, ms (loop CPU in it)", stalls(o["serving"]["top_stalls"])),
        ("  GC pauses while serving", gcs(o["serving"]["gc"])),
        ("loop lag while packing, ms", lag(pk["loop_lag_ms"])),
        ("  longest, ms (loop CPU in it) ", stalls(pk["top_stalls"])),
        ("  GC pauses while packing", gcs(pk["gc"])),
        ("GC policy (coordinator/gcpolicy.py)", gc_policy(o.get("gc_policy", {}))),
        ("step packed in the window", f"{o['groups']} x {o['group_size']} executions, {pk.get('wall_s', 0):.2f} s "
                                      f"wall, {pk.get('micro_steps', 0)} micro-steps"),
        ("pack CPU per step (quiet)", f"{o['pack_cpu_s_per_step']:.2f} s CPU, {o['pack_wall_s_quiet']:.2f} s wall, "
                                      f"{o['micro_steps']} micro-steps, {o['step_target_tokens']:,} target tokens"),
        ("wire bytes per step", f"{o['wire_bytes']:,} over 4 x {o['unique_admitted_tokens']:,} unique admitted = "
                                f"{o['wire_bytes_over_unique']:.2f}x"),
    ]
    w = max(len(k) for k, _ in rows)
    print(f"\n{'bench/scale.py':<{w}}  (indicative: {o['cpus']} CPUs, load average "
          f"{', '.join(f'{x:.1f}' for x in o['loadavg'])})")
    for k, v in rows:
        print(f"{k:<{w}}  {v}")
    if "profile" in o:
        print("\ncProfile of the quiet Batch.run():\n" + o["profile"].rstrip())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--executions", type=int, default=1152)
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=None, help="total calls/s (default: executions / 30)")
    ap.add_argument("--max-context", type=int, default=200_000)
    ap.add_argument("--groups", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=16)
    defaults = CoordinatorConfig.__dataclass_fields__
    ap.add_argument("--j-max", type=int, default=defaults["j_max"].default, help="0: no limit")
    ap.add_argument("--micro-step-tokens", type=int, default=defaults["micro_step_tokens"].default)
    if "packing" in defaults:  # the micro-step form (older code had only path rows)
        ap.add_argument("--packing", choices=("tree", "paths", "packed"), default=defaults["packing"].default)
    ap.add_argument("--idle-calls", type=int, default=100)
    ap.add_argument("--call-timeout", type=float, default=120.0, help="client-side limit per call, s")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", metavar="DIR", help="a model directory whose tokenizer and chat template the proxy uses "
                    "(default: the tiny model, one token per byte; e.g. gyre init-model smollm2 DIR for a real BPE)")
    freeze = defaults.get("gc_freeze_every_s")  # older code: none
    ap.add_argument("--gc-freeze-every-s", type=float, default=freeze.default if freeze else 0.0,
                    help="the coordinator's GcPolicy (0: Python's collector as it is)")
    ap.add_argument("--profile", action="store_true", help="also profile the quiet Batch.run()")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 64 executions, 20 s, 20k contexts, 4 x 8")
    ap.add_argument("--json", metavar="PATH", help="also write the figures to PATH")
    if ap.parse_args().quick:  # the smoke run's sizes, each still open to its own flag
        ap.set_defaults(executions=64, seconds=20.0, max_context=20_000, groups=4, group_size=8)
    args = ap.parse_args()
    args.rate = args.rate or args.executions / 30
    if args.groups * args.group_size > args.executions:
        ap.error(f"--groups x --group-size ({args.groups * args.group_size}) exceeds --executions ({args.executions})")
    with tempfile.TemporaryDirectory(prefix="gyre-scale-") as tmp:
        root = Path(tmp)
        model = Path(args.model) if args.model else root / "model"
        if not args.model:  # the tiny model, written in a child: torch's objects would slow this process's GC
            subprocess.run([sys.executable, "-c", "import sys; from gyre.workerd.modeldir import init_tiny; "
                            "init_tiny(sys.argv[1])", str(model)], check=True)
        tok = ChatTokenizer(model)
        out = results(args, uvloop.run(serve(args, tok, model, root)))
        out["model"] = model.name if args.model else "tiny (byte-level tokenizer)"
        out["vocab_size"] = tok.vocab_size
    report(out)
    out.pop("profile", None)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    failed, recorded = out["calls_failed"] + out["calls_idle_failed"], out["serving"]["record_errors"]
    if failed or recorded:
        kinds = "; ".join(f"{n} x {k}" for k, n in out["calls_failures"].items())
        sys.exit(f"bench/scale.py: the proxy failed {failed} call(s) (client side; {recorded} recorded as errors in "
                 f"the window, server side): {kinds or '-'}")


if __name__ == "__main__":
    main()
