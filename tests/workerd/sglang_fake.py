"""A fake of the part of SGLang 0.5.23 that engines/sglang.py uses: `sglang.Engine`, its
tokenizer manager and the pause/continue request types.

Signatures are the real ones (a keyword SGLang lacks is a TypeError), streamed chunks have
the real shape and cumulative semantics (intermediate chunks share the live lists), and
the rules the adapter must honour fail as SGLang fails. Not a model: the test decides what
the "scheduler" outputs, with `emit`. Every call lands in `calls`, in order. Its radix
cache is a list of the sequences finished since the last flush: a request's cached_tokens
is its longest common prefix with any of them, at most all but its last prompt token.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Literal

import torch

# Real ServerArgs fields (checked against the installed SGLang by the contract tests).
SERVER_ARGS_FIELDS = frozenset({
    "model_path", "skip_tokenizer_init", "max_running_requests", "random_seed", "enable_memory_saver",
    "log_level", "attention_backend", "base_gpu_id", "chunked_prefill_size", "context_length", "device",
    "disable_cuda_graph", "disable_overlap_schedule", "disable_radix_cache", "dtype",
    "enable_deterministic_inference", "enable_weights_cpu_backup", "kv_cache_dtype", "load_format",
    "max_total_tokens", "mem_fraction_static", "nccl_port", "page_size", "quantization",
    "rl_on_policy_target", "sampling_backend", "sleep_on_idle", "tp_size", "trust_remote_code",
    "watchdog_timeout", "incremental_streaming_output", "tokenizer_worker_num",
})
ALL_TAGS = ("kv_cache", "weights", "cuda_graph")  # srt/constants.py GPU_MEMORY_ALL_TYPES


# --- io_struct: the request types the adapter builds ------------------------------------

@dataclass(kw_only=True)
class PauseGenerationReqInput:
    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclass(kw_only=True)
class ContinueGenerationReqInput:
    torch_empty_cache: bool = True


@dataclass(kw_only=True)
class FlushCacheReqOutput:
    success: bool
    message: str = ""


class io_struct:  # noqa: N801 - stands in for the module sglang.srt.managers.io_struct
    PauseGenerationReqInput = PauseGenerationReqInput
    ContinueGenerationReqInput = ContinueGenerationReqInput


def abort_reason(message: str = "Aborted", status_code: int | None = None) -> dict:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


@dataclass(eq=False)
class FakeRequest:
    """The tokenizer manager's ReqState and the scheduler's view of one request."""

    rid: str
    input_ids: list[int]
    sampling_params: dict
    output_ids: list[int] = field(default_factory=list)  # cumulative, shared with chunks
    logprobs: list[tuple] = field(default_factory=list)  # (logprob, token_id, None), shared too
    out_list: list[dict] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)
    error: Exception | None = None
    dispatched: bool = False  # sent to the scheduler (on the stream's first read)
    cached_tokens: int = 0  # prompt tokens the radix cache held, known at dispatch
    finished: bool = False
    abort_sent: bool = False


class FakeTokenizerManager:
    def __init__(self, engine: FakeSglangEngine):
        self._e = engine

    def abort_request(self, rid: str = "", abort_all: bool = False):
        self._e.calls.append(("abort_request", {"rid": rid, "abort_all": abort_all}))
        self._e.abort(rid, abort_all)

    async def pause_generation(self, obj: PauseGenerationReqInput):
        self._e.calls.append(("pause_generation", {"mode": obj.mode}))
        assert obj.mode in ("abort", "retract", "in_place")
        if obj.mode == "abort":
            self._e.abort("", abort_all=True)
        self._e.paused = obj.mode

    async def continue_generation(self, obj: ContinueGenerationReqInput):
        self._e.calls.append(("continue_generation", {}))
        self._e.paused = None
        self._e.changed()

    async def flush_cache(self, timeout_s: float | None = None) -> FlushCacheReqOutput:
        """With a timeout, SGLang's scheduler defers the flush until it is fully idle
        (waiting requests count, paused or not) or the deadline passes."""
        self._e.calls.append(("flush_cache", {"timeout_s": timeout_s}))
        if not timeout_s:
            return self._e.flushed(FlushCacheReqOutput(success=self._e.flushable()))
        try:
            await asyncio.wait_for(self._e.until(lambda: not self._e.busy()), timeout_s)
        except TimeoutError:
            return FlushCacheReqOutput(success=False, message="Timed out waiting for idle state.")
        return self._e.flushed(FlushCacheReqOutput(success=True))


class FakeSglangEngine:
    """`sglang.Engine(**server_args)`; `fail[method] = message` makes that call fail."""

    def __init__(self, **kwargs):
        unknown = set(kwargs) - SERVER_ARGS_FIELDS
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got unexpected keyword arguments {sorted(unknown)}")
        self.server_args = kwargs
        self.calls: list[tuple[str, dict]] = []
        self.loop = asyncio.new_event_loop()
        self.tokenizer_manager = FakeTokenizerManager(self)
        self.reqs: dict[str, FakeRequest] = {}
        self.aborted: list[str] = []  # rids the scheduler aborted
        self.fail: dict[str, str] = {}
        self.paused: str | None = None
        self.session_open = False
        self.offloaded: set[str] = set()
        self.weights: dict[str, torch.Tensor] = {}
        self.is_shut_down = False
        self._waiters: list[asyncio.Event] = []
        self.radix: list[list[int]] = []  # sequences whose KV the cache holds (until a flush)
        self.report_cached = True  # False: meta_info lacks "cached_tokens" (a build that omits it)

    # --- test controls ------------------------------------------------------------------

    def req(self, rid: str) -> FakeRequest:
        """The latest request the adapter made for its request id `rid` (ids are "<n>:<rid>")."""
        return [r for r in self.reqs.values() if r.rid.split(":", 1)[1] == rid][-1]

    def emit(self, rid: str, tokens=(), finish: dict | None = None, error: Exception | None = None):
        """The scheduler's output for `rid` reaches the tokenizer manager: new (token, logprob)
        pairs, and a finish_reason dict on the last one."""
        req = self.reqs[rid]
        assert req.dispatched and not req.finished, f"{rid} is not running in the scheduler"
        for token, lp in tokens:
            req.output_ids.append(token)
            req.logprobs.append((lp, token, None))
        req.finished = finish is not None or error is not None
        req.error = error
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(req.input_ids),
                "weight_version": "default", "num_retractions": 0, "input_token_logprobs": [],
                "output_token_logprobs": req.logprobs, "output_token_logprobs_length": len(req.logprobs),
                "reasoning_tokens": 0, "completion_tokens": len(req.output_ids)}
        if self.report_cached:
            meta["cached_tokens"] = req.cached_tokens
        if finish is not None:
            self.radix.append(req.input_ids + req.output_ids)
        # Intermediate chunks pass SGLang's live list; the final one a copy.
        ids = list(req.output_ids) if req.finished else req.output_ids
        req.out_list.append({"output_ids": ids, "meta_info": meta})
        req.event.set()
        self.changed()

    def cached_prefix(self, input_ids: list[int]) -> int:
        """The radix cache's match: the longest prefix held, leaving the last token to prefill."""
        best = 0
        for seq in self.radix:
            n = 0
            while n < min(len(seq), len(input_ids)) and seq[n] == input_ids[n]:
                n += 1
            best = max(best, n)
        return min(best, len(input_ids) - 1)

    def flushed(self, result: FlushCacheReqOutput) -> FlushCacheReqOutput:
        if result.success:
            self.radix.clear()
        return result

    def busy(self) -> list[FakeRequest]:
        return [r for r in self.reqs.values() if r.dispatched and not r.finished]

    def flushable(self) -> bool:
        """Scheduler.flush_cache: idle, where a retract pause has moved running requests to
        the waiting queue, which a paused engine ignores."""
        return not self.busy() or self.paused == "retract"

    def changed(self) -> None:
        waiters, self._waiters = self._waiters, []
        for event in waiters:
            event.set()

    async def until(self, predicate) -> None:
        while not predicate():
            event = asyncio.Event()
            self._waiters.append(event)
            await event.wait()

    def abort(self, rid: str, abort_all: bool = False) -> None:
        if not abort_all and not rid:
            return
        for req in self.reqs.values():
            # The scheduler matches ids by prefix; the tokenizer manager ignores an id it has
            # no state for (a stream never read).
            live = req.dispatched and not req.finished and not req.abort_sent
            if live and (abort_all or req.rid.startswith(rid)):
                req.abort_sent = True
                # Its abort output comes back a scheduler step later.
                self.loop.call_soon(self._finish_aborted, req)

    def _finish_aborted(self, req: FakeRequest) -> None:
        if not req.finished:
            self.aborted.append(req.rid)
            self.emit(req.rid, finish=abort_reason())

    def _locked(self, method: str) -> None:
        # Unpaused, SGLang's weight calls take model_update_lock as writer, which waits for
        # every request in flight (readers): with one thread driving the loop, forever.
        if self.paused is None and self.busy():
            raise RuntimeError(f"{method} would wait forever: {len(self.busy())} requests hold "
                               "model_update_lock (pause generation first)")

    def _session(self, method: str) -> tuple[bool, str] | None:
        if self.is_shut_down:
            raise RuntimeError("engine is shut down")
        if method in self.fail:
            return False, self.fail[method]
        if not self.session_open:
            return False, f"{method} must run between begin_weight_update() and end_weight_update()"
        return None

    # --- sglang.Engine ------------------------------------------------------------------

    async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False,
                             logprob_start_len=None, top_logprobs_num=None, stream=False, rid=None):
        self.calls.append(("async_generate", {"input_ids": input_ids, "sampling_params": sampling_params,
                                              "return_logprob": return_logprob, "stream": stream, "rid": rid}))
        assert stream and input_ids and rid not in self.reqs
        req = FakeRequest(rid, list(input_ids), dict(sampling_params or {}))
        self.reqs[rid] = req
        return self._stream(req)

    async def _stream(self, req: FakeRequest):
        """TokenizerManager.generate_request: waits out a pause, dispatches, then yields the
        latest chunk whenever outputs arrived (cumulative: older ones are dropped)."""
        try:
            await self.until(lambda: self.paused is None)
            req.dispatched = True
            req.cached_tokens = self.cached_prefix(req.input_ids)
            while True:
                await req.event.wait()
                out_list, req.out_list = req.out_list, []
                finished = req.finished
                req.event.clear()
                if req.error is not None:
                    raise req.error
                yield out_list[-1]
                if finished:
                    break
        except BaseException:
            # _release_req_states_on_failure: a dispatched request is aborted.
            if req.dispatched and not req.finished:
                self.abort(req.rid)
            raise

    def flush_cache(self):
        self.calls.append(("flush_cache", {}))
        return self.flushed(FlushCacheReqOutput(success=self.flushable()))

    def release_memory_occupation(self, tags: list[str] | None = None):
        self.calls.append(("release_memory_occupation", {"tags": tags}))
        # The scheduler asserts this; a failed assert there kills the scheduler process.
        assert not self.busy(), "release_memory_occupation should be called only when server is idle."
        for tag in tags or ALL_TAGS:
            assert tag not in self.offloaded, f"{tag} is already released"
            self.offloaded.add(tag)

    def resume_memory_occupation(self, tags: list[str] | None = None):
        self.calls.append(("resume_memory_occupation", {"tags": tags}))
        for tag in tags or ALL_TAGS:
            self.offloaded.remove(tag)  # KeyError for a tag not released, as in the scheduler

    def begin_weight_update(self, selector: str = "all"):
        self.calls.append(("begin_weight_update", {}))
        self._locked("begin_weight_update")
        if "begin_weight_update" in self.fail:
            return False, self.fail["begin_weight_update"]
        if self.session_open:
            return False, "a weight-update session is already open; call end_weight_update() first"
        self.session_open = True
        return True, "Success"

    def end_weight_update(self):
        self.calls.append(("end_weight_update", {}))
        if not self.session_open:
            return False, "no weight-update session is open; call begin_weight_update() first"
        self.session_open = False
        return True, "Success"

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update_weights_from_tensor", {
            "names": [n for n, _ in named_tensors], "flush_cache": flush_cache,
            "nbytes": sum(t.numel() * t.element_size() for _, t in named_tensors)}))
        self._locked("update_weights_from_tensor")
        if (refused := self._session("update_weights_from_tensor")) is not None:
            return refused
        if any(t.device.type == "cpu" for _, t in named_tensors) and \
                torch.multiprocessing.get_sharing_strategy() != "file_system":
            raise RuntimeError("scheduler died deserializing CPU tensors (sender's sharing strategy)")
        self.weights.update({n: t.clone() for n, t in named_tensors})
        if flush_cache and not self.flushable():
            return False, ("Weights were updated, but the cache was not flushed because requests are "
                           "still running or queued.")
        if flush_cache:
            self.radix.clear()
        return True, "Success"

    def shutdown(self):
        self.calls.append(("shutdown", {}))
        self.is_shut_down = True
