"""engines/sglang.py: the SGLang rollout engine, an in-process `sglang.Engine` behind the
contract of engines/base.py (the same one CpuEngine keeps).

One thread drives it: the workerd main loop calls every method, and each call runs
SGLang's asyncio loop (`engine.loop`) only until what it needs is done; SGLang's scheduler
runs in its own subprocesses. Not a server and not a scheduler: no HTTP, no threads, no
retries. SURFACE lists every SGLang name used here; the tests check it against the
installed SGLang's source. Facts about SGLang 0.5.23 are noted where they are relied on.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from gyre.workerd.engines.base import RolloutEngine, SamplingParams, TokenOutput
from gyre.workerd.engines.cpu import EngineReleased
from gyre.workerd.wire import BackendError, EngineSpec

log = logging.getLogger("gyre.workerd")
_DEFAULT = EngineSpec()  # the options' defaults, written once (wire/messages.py)

# ServerArgs fields an operator may set through `options`, each checked against SGLang
# 0.5.23 (srt/arg_groups/fields/). Left out on purpose: incremental_streaming_output (step()
# reads the default cumulative stream) and tokenizer_worker_num (needs the one tokenizer
# manager that abort and pause talk to).
SERVER_OPTIONS = frozenset({
    "attention_backend", "base_gpu_id", "chunked_prefill_size", "context_length", "device",
    "disable_cuda_graph", "disable_overlap_schedule", "disable_radix_cache", "dtype", "enable_memory_saver",
    "enable_deterministic_inference", "enable_weights_cpu_backup", "kv_cache_dtype",
    "load_format", "log_level", "max_total_tokens", "mem_fraction_static", "nccl_port",
    "page_size", "quantization", "rl_on_policy_target", "sampling_backend", "sleep_on_idle",
    "tp_size", "trust_remote_code", "watchdog_timeout",
})
# ServerArgs fields the adapter sets itself (from the constructor's arguments).
FIXED_SERVER_ARGS = ("model_path", "skip_tokenizer_init", "max_running_requests", "random_seed", "log_level")
# The adapter's own settings, carried in the same options dict.
ADAPTER_OPTIONS = {"bucket_bytes": int, "step_wait_s": float, "flush_timeout_s": float}

# srt/constants.py GPU_MEMORY_TYPE_*: what release_memory_occupation(tags=None) releases.
WEIGHTS, KV_CACHE, CUDA_GRAPH = "weights", "kv_cache", "cuda_graph"
# PauseGenerationReqInput.mode for a publication (see _weight_update).
PAUSE_MODE = "retract"

# Every SGLang call the adapter makes -> the keyword names it passes. Classes map to the
# fields it sets; ServerArgs to every field it may pass.
SURFACE: dict[str, tuple[str, ...]] = {
    "Engine.async_generate": ("input_ids", "sampling_params", "return_logprob", "stream", "rid"),
    "Engine.flush_cache": (),
    "Engine.release_memory_occupation": ("tags",),
    "Engine.resume_memory_occupation": ("tags",),
    "Engine.begin_weight_update": (),
    "Engine.end_weight_update": (),
    "Engine.update_weights_from_tensor": ("named_tensors", "flush_cache"),
    "Engine.shutdown": (),
    "TokenizerManager.abort_request": ("rid",),
    "TokenizerManager.pause_generation": ("obj",),
    "TokenizerManager.continue_generation": ("obj",),
    "TokenizerManager.flush_cache": ("timeout_s",),
    "PauseGenerationReqInput": ("mode",),
    "ContinueGenerationReqInput": (),
    "SamplingParams": ("max_new_tokens", "temperature", "top_p", "stop_token_ids", "sampling_seed"),
    "ServerArgs": tuple(sorted(SERVER_OPTIONS | set(FIXED_SERVER_ARGS))),
}
# The SURFACE methods that are coroutines (run on engine.loop); the others are plain calls.
AWAITED = frozenset({"Engine.async_generate", "TokenizerManager.pause_generation",
                     "TokenizerManager.continue_generation", "TokenizerManager.flush_cache"})
# Attributes of a built Engine the adapter reads.
ATTRIBUTES = ("Engine.loop", "Engine.tokenizer_manager")


class SglangError(RuntimeError):
    """SGLang refused a control call; the message is SGLang's own."""


@dataclass(slots=True, eq=False)
class _Stream:
    seq: int
    rid: str
    sglang_rid: str
    prompt_tokens: int
    gen: AsyncIterator[dict]  # SGLang's stream of cumulative chunks
    task: asyncio.Task | None = None  # the pending read of its next chunk
    seen: int = 0  # output tokens already returned
    cached_tokens: int | None = None  # meta_info["cached_tokens"] of its latest chunk


class SglangEngine(RolloutEngine):
    """Rollout engine over an in-process `sglang.Engine`; see engines/base.py for the
    contract. Built by backends.py; driven only by the workerd's main thread."""

    def __init__(self, model_dir, *, version: int = 0, max_running: int = _DEFAULT.max_running,
                 seed: int = _DEFAULT.seed, options: dict[str, Any] | None = None,
                 engine_factory: Callable[..., Any] | None = None, io_struct: Any = None):
        """`engine_factory` (default `sglang.Engine`) and `io_struct` (default
        `sglang.srt.managers.io_struct`, for the pause/continue request types) are where
        tests put their fakes."""
        server, adapter = _split_options(options or {})
        self.version = version
        self.bucket_bytes = adapter.get("bucket_bytes", 512 << 20)
        self.step_wait_s = adapter.get("step_wait_s", 0.02)
        self.flush_timeout_s = adapter.get("flush_timeout_s", 30.0)
        if engine_factory is None:
            import sglang

            engine_factory = sglang.Engine
        if io_struct is None:
            from sglang.srt.managers import io_struct
        self._io = io_struct
        # The contract's log-probs are those of the distribution sampled from (after
        # temperature, renormalised over top-p): SGLang's default. With this set it would
        # return temperature-1 log-probs instead, so it is cleared whatever the caller's
        # environment says. Its scheduler subprocess reads it at import, so it must be in
        # the environment before the Engine starts.
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "0"
        server.setdefault("log_level", "warning")
        # SGLang's radix cache stays on (disable_radix_cache is the operator's): an agent's next
        # call reuses the KV its last one left. Weight updates and role changes flush it.
        # release/resume_memory_occupation free memory only with the memory saver
        # (torch_memory_saver, CUDA-only: on CPU they run their bookkeeping and free nothing).
        server.setdefault("enable_memory_saver", server.get("device") != "cpu")
        if server.get("device") == "cpu":
            # SGLang takes its CPU code paths only with this; its scheduler reads it at import.
            os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        if server.get("device") == "cpu":
            # "auto" serves a float32 checkpoint in float16 (log-probs ~1e-3 off the trainer's):
            # on CPU the checkpoint's own dtype. On GPUs "auto" stays: their attention kernels
            # take fp16/bf16 only (set dtype = "bfloat16" to match a bf16 Megatron trainer).
            server.setdefault("dtype", _checkpoint_dtype(model_dir))
        self.engine = engine_factory(model_path=str(model_dir), skip_tokenizer_init=True,
                                     max_running_requests=max_running, random_seed=seed, **server)
        self._streams: dict[str, _Stream] = {}
        self._seq = itertools.count()
        self._released: set[str] = set()  # memory tags released and not yet resumed
        self._pending: tuple[list[tuple[str, torch.Tensor]], int] | None = None  # published while released
        # Released weights come back without their contents (torch_memory_saver discards them
        # unless enable_weights_cpu_backup): a load must follow, unchanged weights or not.
        self._dropped = False

    @property
    def running(self) -> int:
        return len(self._streams)

    def _run(self, awaitable):
        return self.engine.loop.run_until_complete(awaitable)

    # --- rollout ------------------------------------------------------------------------

    def add_request(self, rid: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if self._released:
            raise EngineReleased("engine memory is released (cell is training)")
        if rid in self._streams:
            raise ValueError(f"request id {rid!r} is already running")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty")
        if min(prompt_ids) < 0:
            raise ValueError("prompt_ids holds a negative token id")
        seq = next(self._seq)
        # SGLang's scheduler aborts every request whose id *starts with* the given one, so
        # ids are made prefix-free: a unique number, a colon, then ours (for its logs).
        sglang_rid = f"{seq}:{rid}"
        # With stream=True this returns SGLang's generator at once; nothing is sent until
        # its first chunk is read, in step().
        gen = self._run(self.engine.async_generate(
            input_ids=list(prompt_ids), sampling_params=_sampling_params(params),
            return_logprob=True, stream=True, rid=sglang_rid))
        stream = _Stream(seq, rid, sglang_rid, len(prompt_ids), gen)
        stream.task = self.engine.loop.create_task(_read(gen))
        self._streams[rid] = stream

    def step(self) -> list[TokenOutput]:
        """Waits up to `step_wait_s` for the first chunk, then returns every chunk ready."""
        reading = {s.task: s for s in self._streams.values()}
        if not reading:
            return []
        done, _ = self._run(asyncio.wait(set(reading), timeout=self.step_wait_s,
                                         return_when=asyncio.FIRST_COMPLETED))
        outs, ended = [], []
        for stream in sorted((reading[t] for t in done), key=lambda s: s.seq):
            out = self._take(stream)
            if out is not None:
                outs.append(out)
                if out.finished:
                    ended.append(stream)
        self._close(ended)
        return outs

    def _take(self, s: _Stream) -> TokenOutput | None:
        """The output of one read: the tokens new since the last, or the request's end."""
        task, s.task = s.task, None
        try:
            chunk = task.result()
        except Exception as e:  # noqa: BLE001 - SGLang refused the request: it ends here
            log.warning("request %s failed in SGLang: %s: %s", s.rid, type(e).__name__, e)
            return self._end(s, [], [], "abort")
        if chunk is None:
            log.warning("SGLang's stream for request %s ended without a finish reason", s.rid)
            return self._end(s, [], [], "abort")
        ids, lps = _new_tokens(s, chunk)
        # Prompt tokens SGLang's radix cache served (srt/managers/tokenizer_manager.py puts it
        # in every chunk's meta_info); absent, the engine does not say.
        cached = chunk["meta_info"].get("cached_tokens")
        if cached is not None:
            s.cached_tokens = int(cached)
        reason = _finish_reason(chunk["meta_info"].get("finish_reason"), s.rid)
        if reason is not None:
            return self._end(s, ids, lps, reason)
        s.task = self.engine.loop.create_task(_read(s.gen))
        return self._out(s, ids, lps) if ids else None

    def _end(self, s: _Stream, ids, lps, reason: str) -> TokenOutput:
        del self._streams[s.rid]
        return self._out(s, ids, lps, reason)

    def _out(self, s: _Stream, ids, lps, reason: str | None = None) -> TokenOutput:
        return TokenOutput(rid=s.rid, token_ids=ids, logprobs=lps, version=self.version,
                           finished=reason is not None, finish_reason=reason, prompt_tokens=s.prompt_tokens,
                           cached_tokens=s.cached_tokens)

    def abort(self, rid: str) -> TokenOutput | None:
        stream = self._streams.pop(rid, None)
        if stream is None:
            return None
        # By id, never abort_all: other requests go on. SGLang ignores an id it has not
        # seen yet (a stream never read); closing the stream then drops it before sending.
        self.engine.tokenizer_manager.abort_request(rid=stream.sglang_rid)
        self._close([stream])
        return self._out(stream, [], [], "abort")

    def _close(self, streams: list[_Stream]) -> None:
        """Cancels the streams' pending reads and closes their generators. SGLang treats a
        closed stream as an abort; tokens not yet read are dropped."""
        tasks = [s.task for s in streams if s.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            self._run(asyncio.wait(tasks, timeout=5.0))
        for task in tasks:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a late failure of an abandoned read is not news
        gens = [s.gen for s in streams if s.task is None or s.task.done()]
        if len(gens) < len(streams):
            log.warning("%d SGLang streams did not stop within 5 s", len(streams) - len(gens))
        if gens:
            for err in self._run(_aclose_all(gens)):
                if err is not None:
                    log.warning("closing an SGLang stream failed: %s", err)

    # --- role changes -------------------------------------------------------------------

    def release_memory(self) -> int:
        """For a role change to training, after the worker aborted every request: frees the
        weights, KV cache and CUDA graphs. Returns 0: SGLang does not say what it freed."""
        if self._released:
            return 0
        if self._streams:
            raise RuntimeError(f"release_memory with {len(self._streams)} requests running: abort them first")
        # 1) Aborted requests leave the scheduler a step later, and release asserts an idle
        #    scheduler (a failed assert kills it): this flush waits for idle, with a deadline.
        _check(self._run(self.engine.tokenizer_manager.flush_cache(timeout_s=self.flush_timeout_s)),
               "flush_cache before release_memory_occupation")
        # 2) tags=None releases all three.
        _check(self.engine.release_memory_occupation(tags=None), "release_memory_occupation")
        self._released = {WEIGHTS, KV_CACHE, CUDA_GRAPH}
        self._dropped = True
        return 0

    def resume_memory(self) -> None:
        """Back to rollout: weights first, then a publication that arrived while they were
        released, then the KV cache and CUDA graphs."""
        self.resume_weights()
        if self._pending is not None:
            named, version = self._pending
            self._load(named, version)  # on failure it stays pending, and the version unclaimed
            self._pending = None
        self.resume_cache()

    def resume_weights(self) -> None:
        """Restores only the weights, so a publication can load into them before the KV
        cache takes its share of the device again (then call resume_cache)."""
        self._resume([WEIGHTS])

    def resume_cache(self) -> None:
        self._resume([KV_CACHE, CUDA_GRAPH])

    def _resume(self, tags: list[str]) -> None:
        # Only tags that are released: the scheduler fails on resuming one that is not.
        tags = [t for t in tags if t in self._released]
        if tags:
            _check(self.engine.resume_memory_occupation(tags=tags), "resume_memory_occupation")
            self._released -= set(tags)

    # --- weights ------------------------------------------------------------------------

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        """A publication from tensors in this process (received frames, or the colocated
        trainer's), sent in calls of at most `bucket_bytes` (one tensor may exceed it).
        While the weights are released (a training cell's engine follows publications too)
        the tensors are kept on the host and loaded by `resume_memory`, before the cache.

        The only way in: every transfer path (frames, Mooncake, broadcast) ends with the
        tensors in the workerd, whose trainer takes them too. SGLang's own receive
        (update_weights_from_distributed) would put its ranks in the broadcast group, and a
        member must join every broadcast: trainer-only ones, and those that find its
        weights released."""
        if WEIGHTS in self._released:
            kept = [(name, t.detach().to("cpu", copy=True)) for name, t in named]
            self._pending = (kept, version)  # self.version moves when they are loaded
            return sum(t.numel() * t.element_size() for _, t in kept)
        self._pending = None  # newer than any publication a failed resume left pending
        return self._load(named, version)

    def _load(self, named: Iterable[tuple[str, torch.Tensor]], version: int) -> int:
        # CPU tensors reach the scheduler through shared memory; with torch's default
        # strategy its scheduler crashed, with file_system it works (DEPS-NOTES).
        torch.multiprocessing.set_sharing_strategy("file_system")
        nbytes = 0
        with self._weight_update():
            for bucket in _buckets(named, self.bucket_bytes):
                _check(self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False),
                       "update_weights_from_tensor")
                nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
        self.version, self._dropped = version, False
        return nbytes

    def holds(self, version: int) -> bool:
        return self.version == version and not self._dropped

    @contextmanager
    def _weight_update(self) -> Iterator[None]:
        """pause -> begin -> (the update calls) -> end -> flush -> continue. End and continue
        also run when an update fails, and the failure propagates. Tokens sampled before the
        pause but read by a later step() carry the new version (those since the last step)."""
        tm = self.engine.tokenizer_manager
        # "retract" moves running requests back to the waiting queue (their KV is recomputed
        # under the new weights on continue), so the flush succeeds with requests in flight;
        # "in_place" keeps them in the running batch and the flush fails; "abort" ends them.
        # While paused, SGLang's update calls skip the lock that in-flight requests hold.
        self._run(tm.pause_generation(obj=self._io.PauseGenerationReqInput(mode=PAUSE_MODE)))
        try:
            _check(self.engine.begin_weight_update(), "begin_weight_update")
            try:
                yield
            except BaseException:
                # Close the session and drop caches of possibly half-new weights; the update's
                # own failure is the one to raise.
                for call, what in ((self.engine.end_weight_update, "end_weight_update"),
                                   (self.engine.flush_cache, "flush_cache")):
                    try:
                        _check(call(), what)
                    except Exception as e:  # noqa: BLE001 - secondary to the failure being raised
                        log.error("%s after a failed weight update: %s", what, e)
                raise
            _check(self.engine.end_weight_update(), "end_weight_update")
            # The cache holds KV computed by the old weights. Engine.flush_cache flushes at
            # once; paused, SGLang counts only running requests (none after a retract).
            _check(self.engine.flush_cache(), "flush_cache")
        finally:
            self._run(tm.continue_generation(obj=self._io.ContinueGenerationReqInput()))

    def shutdown(self) -> None:
        self._close(list(self._streams.values()))
        self._streams.clear()
        self.engine.shutdown()


async def _read(gen: AsyncIterator[dict]) -> dict | None:
    """The next chunk of an SGLang stream; None once it has ended."""
    return await anext(gen, None)


async def _aclose_all(gens: list[AsyncIterator[dict]]) -> list[BaseException | None]:
    return await asyncio.gather(*(g.aclose() for g in gens), return_exceptions=True)


def _sampling_params(p: SamplingParams) -> dict[str, Any]:
    """Field names of SGLang's srt/sampling/sampling_params.py. It also stops at the model's
    EOS ids; sampling_seed only takes effect with enable_deterministic_inference."""
    out: dict[str, Any] = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p}
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def _new_tokens(s: _Stream, chunk: dict) -> tuple[list[int], list[float]]:
    """SGLang streams cumulatively by default (incremental_streaming_output=False): each
    chunk's output_ids and meta_info["output_token_logprobs"] ((logprob, token_id, text)
    tuples) hold everything so far, and intermediate chunks are the live lists SGLang
    keeps appending to. So: take what is past `seen`, as copies, now."""
    ids = chunk["output_ids"]
    lps = chunk["meta_info"].get("output_token_logprobs") or []
    n = max(min(len(ids), len(lps)), s.seen)
    new = [int(t) for t in ids[s.seen:n]], [float(e[0]) for e in lps[s.seen:n]]
    s.seen = n
    return new


def _finish_reason(reason: dict | None, rid: str) -> str | None:
    """SGLang's finish_reason: None while running, then a dict whose "type" is "stop" (stop
    token or EOS), "length" or "abort" (with "message"; errors also carry "status_code")."""
    if reason is None:
        return None
    kind = reason.get("type")
    if kind in ("stop", "length"):
        return kind
    if kind != "abort" or reason.get("status_code"):
        log.warning("request %s ended by SGLang: %s", rid, reason)
    return "abort"


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _check(result: Any, what: str) -> None:
    """SGLang answers control calls with (success, message), with an object carrying
    .success and .message (flush_cache), or with None (memory release/resume)."""
    if result is None:
        return
    if isinstance(result, tuple):
        success, message = result[0], result[1] if len(result) > 1 else ""
    else:
        success, message = result.success, getattr(result, "message", "")
    if not success:
        raise SglangError(f"{what} failed: {message or 'SGLang gave no reason'}")


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(ServerArgs keywords, adapter settings); an unknown name is an error naming it."""
    unknown = sorted(set(options) - SERVER_OPTIONS - set(ADAPTER_OPTIONS))
    if unknown:
        raise BackendError(f"unknown SGLang engine option(s) {', '.join(map(repr, unknown))} (known: "
                           f"{', '.join(sorted(SERVER_OPTIONS | set(ADAPTER_OPTIONS)))})")
    server = {k: v for k, v in options.items() if k in SERVER_OPTIONS}
    adapter = {k: ADAPTER_OPTIONS[k](v) for k, v in options.items() if k in ADAPTER_OPTIONS}
    return server, adapter


def _checkpoint_dtype(model_dir) -> str:
    """config.json's dtype (transformers 5 writes `dtype`, older `torch_dtype`), else "auto"."""
    import json
    from pathlib import Path

    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return str(raw.get("dtype") or raw.get("torch_dtype") or "auto")
