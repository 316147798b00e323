"""SglangEngine against a fake of SGLang's surface (sglang_fake.py), and SURFACE against the
installed SGLang's source, read with `ast` (never imported; skipped when not installed)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
from pathlib import Path

import pytest
import torch

from gyre.workerd.backends import BackendError
from gyre.workerd.engines import sglang as adapter
from gyre.workerd.engines.base import SamplingParams, TokenOutput
from gyre.workerd.engines.cpu import EngineReleased
from gyre.workerd.engines.sglang import SglangEngine, SglangError
from tests.workerd import sglang_fake
from tests.workerd.sglang_fake import FakeSglangEngine, abort_reason


@pytest.fixture
def make(monkeypatch):
    """Builds SglangEngines over fakes; shuts them down and restores process state after."""
    for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "SGLANG_USE_CPU_ENGINE"):  # the adapter sets them
        monkeypatch.setenv(name, "")  # recorded, so they are restored after the test
        monkeypatch.delenv(name)
    strategy = torch.multiprocessing.get_sharing_strategy()
    built = []

    def _make(options=None, **kw):
        fakes = []

        def factory(**server_args):
            fakes.append(FakeSglangEngine(**server_args))
            return fakes[-1]

        options = {"step_wait_s": 0.005, **(options or {})}
        eng = SglangEngine("/models/tiny", options=options, engine_factory=factory,
                           io_struct=sglang_fake.io_struct, **kw)
        built.append((eng, fakes[0]))
        return eng, fakes[0]

    yield _make
    for eng, fake in built:
        if not fake.is_shut_down:
            eng.shutdown()
        fake.loop.close()
    torch.multiprocessing.set_sharing_strategy(strategy)


def names(fake, since: int = 0) -> list[str]:
    return [name for name, _ in fake.calls[since:]]


def kwargs_of(fake, method: str) -> list[dict]:
    return [kw for name, kw in fake.calls if name == method]


def started(eng, fake, *rids: str, params: SamplingParams | None = None):
    """Adds requests and lets their streams reach the scheduler (the first step's reads)."""
    for i, rid in enumerate(rids):
        eng.add_request(rid, [3, 4 + i], params or SamplingParams(max_new_tokens=8))
    assert eng.step() == []
    reqs = [fake.req(rid) for rid in rids]
    assert all(r.dispatched for r in reqs)
    return reqs


# --- 1. generate --------------------------------------------------------------------------

def test_generate_streams_only_new_tokens_with_mapped_params(make):
    eng, fake = make(version=4)
    eng.add_request("a", [5, 6, 7], SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9,
                                                   stop_token_ids=(2,), seed=11))
    eng.add_request("b", [8], SamplingParams(max_new_tokens=2))
    assert eng.running == 2
    assert eng.step() == []
    a, b = fake.req("a"), fake.req("b")
    gen_a, gen_b = kwargs_of(fake, "async_generate")
    assert gen_a == {"input_ids": [5, 6, 7], "return_logprob": True, "stream": True, "rid": a.rid,
                     "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "top_p": 0.9,
                                         "stop_token_ids": [2], "sampling_seed": 11}}
    assert gen_b["sampling_params"] == {"max_new_tokens": 2, "temperature": 1.0, "top_p": 1.0}
    assert os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] == "0"  # log-probs after temperature, as sampled

    fake.emit(a.rid, [(10, -0.5), (11, -0.25)])
    [first] = eng.step()
    assert (first.rid, first.token_ids, first.logprobs, first.finished, first.version) == \
        ("a", [10, 11], [-0.5, -0.25], False, 4)

    # Two chunks queue up before the next read: SGLang delivers only the latest (cumulative).
    fake.emit(a.rid, [(12, -1.0)])
    fake.emit(a.rid, [(2, -0.125)], finish={"type": "stop", "matched": 2})
    fake.emit(b.rid, [(30, -2.0), (31, -3.0)], finish={"type": "length", "length": 2})
    eng.version = 5
    outs = {o.rid: o for o in eng.step()}
    assert outs["a"] == TokenOutput(rid="a", token_ids=[12, 2], logprobs=[-1.0, -0.125], version=5,
                                    finished=True, finish_reason="stop", prompt_tokens=3, cached_tokens=0)
    assert outs["b"] == TokenOutput(rid="b", token_ids=[30, 31], logprobs=[-2.0, -3.0], version=5,
                                    finished=True, finish_reason="length", prompt_tokens=1, cached_tokens=0)
    assert first.token_ids == [10, 11]  # copied, not SGLang's live list
    assert eng.running == 0 and eng.step() == []


def test_requests_sglang_ends_are_aborts(make):
    eng, fake = make()
    a, b = started(eng, fake, "a", "b")
    fake.emit(a.rid, [(9, -0.5)], finish=abort_reason("input too long", status_code=400))
    fake.emit(b.rid, error=ValueError("prompt exceeds the context"))
    outs = sorted(eng.step(), key=lambda o: o.rid)
    assert [(o.rid, o.token_ids, o.finished, o.finish_reason) for o in outs] == \
        [("a", [9], True, "abort"), ("b", [], True, "abort")]
    assert eng.running == 0


def test_add_request_validates_like_the_cpu_engine(make):
    eng, fake = make()
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("a", [], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="negative"):
        eng.add_request("a", [1, -2], SamplingParams(max_new_tokens=1))
    eng.add_request("a", [1], SamplingParams(max_new_tokens=1))
    with pytest.raises(ValueError, match="already running"):
        eng.add_request("a", [1], SamplingParams(max_new_tokens=1))
    assert eng.running == 1 and len(kwargs_of(fake, "async_generate")) == 1


# --- 2. abort -------------------------------------------------------------------------------

def test_abort_by_prefix_free_request_id(make):
    eng, fake = make(version=2)
    r1, r10 = started(eng, fake, "r1", "r10")
    # SGLang's scheduler aborts by id prefix: the ids it gets must not prefix each other.
    assert not r10.rid.startswith(r1.rid) and not r1.rid.startswith(r10.rid)

    out = eng.abort("r1")
    assert out == TokenOutput(rid="r1", version=2, finished=True, finish_reason="abort", prompt_tokens=2)
    assert kwargs_of(fake, "abort_request") == [{"rid": r1.rid, "abort_all": False}]
    assert eng.running == 1
    fake.emit(r10.rid, [(7, -0.5)])
    assert [(o.rid, o.token_ids) for o in eng.step()] == [("r10", [7])]
    assert fake.aborted == [r1.rid] and not r10.finished

    calls = len(fake.calls)
    assert eng.abort("unknown") is None
    assert eng.abort("r1") is None
    assert len(fake.calls) == calls


def test_abort_before_the_stream_started_sends_nothing(make):
    eng, fake = make()
    eng.add_request("a", [1, 2], SamplingParams(max_new_tokens=3))
    assert eng.abort("a").finish_reason == "abort"
    assert not fake.req("a").dispatched and eng.running == 0 and eng.step() == []


def finish(eng, fake, rid: str, prompt: list[int], tokens: list[int]) -> list[TokenOutput]:
    """Runs one request to its end through the fake scheduler; returns its outputs."""
    eng.add_request(rid, prompt, SamplingParams(max_new_tokens=8))
    assert eng.step() == []
    req = fake.req(rid)
    fake.emit(req.rid, [(t, -0.5) for t in tokens[:1]])
    outs = eng.step()
    fake.emit(req.rid, [(t, -0.5) for t in tokens[1:]], finish={"type": "length", "length": len(tokens)})
    return outs + eng.step()


def test_cached_tokens_flow_from_sglangs_radix_cache(make):
    """meta_info["cached_tokens"] (the radix cache, on by default) reaches every output of
    the request, the abort too; a multi-turn prompt hits what the last turn left."""
    eng, fake = make()
    assert "disable_radix_cache" not in fake.server_args  # SGLang's default: the radix cache is on
    first = finish(eng, fake, "t1", [1, 2, 3, 4], [5, 6, 7])
    assert [o.cached_tokens for o in first] == [0, 0]
    second = finish(eng, fake, "t2", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11])
    assert [o.cached_tokens for o in second] == [7, 7]
    [r] = started(eng, fake, "t3")  # prompt [3, 4]: nothing cached
    fake.emit(r.rid, [(5, -0.5)])
    assert [o.cached_tokens for o in eng.step()] == [0]
    assert eng.abort("t3").cached_tokens == 0
    repeat = finish(eng, fake, "t4", [1, 2, 3, 4], [5])  # a prompt the cache holds whole: its last token is prefilled
    assert repeat[-1].cached_tokens == 3


def test_cached_tokens_are_none_when_sglang_does_not_say(make):
    eng, fake = make()
    fake.report_cached = False
    finish(eng, fake, "t1", [1, 2, 3], [4, 5])
    outs = finish(eng, fake, "t2", [1, 2, 3, 4, 5, 6], [7, 8])
    assert [o.cached_tokens for o in outs] == [None, None]  # unknown, never read as 0
    [r] = started(eng, fake, "t3")
    assert eng.abort("t3").cached_tokens is None  # no chunk read yet: nothing known


def test_weight_updates_and_role_changes_still_flush_the_radix_cache(make):
    eng, fake = make()
    finish(eng, fake, "t1", [1, 2, 3], [4, 5])
    eng.load_weights([("w", torch.zeros(2))], version=1)
    assert finish(eng, fake, "t2", [1, 2, 3, 4, 5, 6], [7])[-1].cached_tokens == 0
    assert fake.radix
    eng.release_memory()
    eng.resume_memory()
    assert finish(eng, fake, "t3", [1, 2, 3, 4, 5, 6, 7, 8], [9])[-1].cached_tokens == 0


# --- 3. role changes ------------------------------------------------------------------------

def test_role_change_flushes_then_releases_and_resumes_weights_first(make):
    eng, fake = make()
    started(eng, fake, "a", "b")
    mark = len(fake.calls)
    eng.abort("a"), eng.abort("b")  # the worker's abort_all, then release
    assert eng.release_memory() == 0
    assert names(fake, mark) == ["abort_request", "abort_request", "flush_cache", "release_memory_occupation"]
    assert kwargs_of(fake, "flush_cache")[-1]["timeout_s"] > 0  # waits out the aborts, bounded
    assert kwargs_of(fake, "release_memory_occupation") == [{"tags": None}]
    assert fake.offloaded == {"weights", "kv_cache", "cuda_graph"}

    with pytest.raises(EngineReleased):
        eng.add_request("c", [1], SamplingParams(max_new_tokens=1))
    assert eng.release_memory() == 0  # already released: nothing sent
    assert names(fake).count("release_memory_occupation") == 1

    mark = len(fake.calls)
    eng.resume_memory()
    assert fake.calls[mark:] == [("resume_memory_occupation", {"tags": ["weights"]}),
                                 ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]
    assert fake.offloaded == set()
    eng.resume_memory()
    assert len(fake.calls) == mark + 2
    eng.add_request("c", [1], SamplingParams(max_new_tokens=1))


def test_release_with_requests_running_is_refused_before_sglang(make):
    eng, fake = make()
    started(eng, fake, "a")
    mark = len(fake.calls)
    with pytest.raises(RuntimeError, match="abort them first"):
        eng.release_memory()
    assert names(fake, mark) == []


def test_release_fails_when_sglang_never_goes_idle(make):
    eng, fake = make(options={"flush_timeout_s": 0.01})
    [a] = started(eng, fake, "a")
    eng._streams.clear()  # as if the adapter had lost track of a request SGLang still runs
    with pytest.raises(SglangError, match="Timed out waiting for idle state"):
        eng.release_memory()
    assert "release_memory_occupation" not in names(fake) and not fake.offloaded


def test_weights_can_come_back_before_the_cache(make):
    eng, fake = make()
    eng.release_memory()
    eng.resume_weights()
    assert fake.offloaded == {"kv_cache", "cuda_graph"}
    eng.load_weights([("w", torch.ones(2))], version=1)
    with pytest.raises(EngineReleased):
        eng.add_request("a", [1], SamplingParams(max_new_tokens=1))
    eng.resume_memory()
    assert fake.offloaded == set()
    assert kwargs_of(fake, "resume_memory_occupation") == [{"tags": ["weights"]},
                                                           {"tags": ["kv_cache", "cuda_graph"]}]


def test_a_publication_while_released_loads_between_weights_and_cache(make):
    """A training cell's engine follows publications: nothing reaches SGLang while its
    weights are released; on resume the weights come back, take the publication, and only
    then does the KV cache return."""
    eng, fake = make()
    eng.release_memory()
    mark = len(fake.calls)
    w = torch.ones(2)
    assert eng.load_weights([("w", w)], version=4) == 8
    w.add_(1)  # the sender's buffer changes after the call: the kept copy must not
    assert names(fake, mark) == [] and eng.version == 0  # the version moves when the weights do
    eng.resume_memory()
    assert eng.version == 4
    assert names(fake, mark) == ["resume_memory_occupation"] + BRACKET + ["update_weights_from_tensor"] + CLOSE \
        + ["resume_memory_occupation"]
    assert kwargs_of(fake, "resume_memory_occupation")[-2:] == [{"tags": ["weights"]},
                                                                {"tags": ["kv_cache", "cuda_graph"]}]
    assert torch.equal(fake.weights["w"], torch.ones(2))
    mark = len(fake.calls)
    eng.release_memory(), eng.resume_memory()  # loaded once: nothing pending the next time
    assert "update_weights_from_tensor" not in names(fake, mark)


def test_a_deferred_publication_that_fails_stays_pending(make):
    """The update at resume fails: the error is raised, the engine keeps its old version
    (its rollouts are not labelled with weights it does not run), and the next resume tries
    the same publication again."""
    eng, fake = make()
    eng.release_memory()
    eng.load_weights([("w", torch.full((2,), 3.0))], version=5)
    fake.fail["update_weights_from_tensor"] = "out of memory"
    with pytest.raises(SglangError, match="out of memory"):
        eng.resume_memory()
    assert eng.version == 0 and "kv_cache" in fake.offloaded  # the cache did not come back either
    del fake.fail["update_weights_from_tensor"]
    eng.resume_memory()
    assert eng.version == 5 and torch.equal(fake.weights["w"], torch.full((2,), 3.0))
    assert fake.offloaded == set()


# --- 4. weight updates from tensors ---------------------------------------------------------

BRACKET = ["pause_generation", "begin_weight_update"]
CLOSE = ["end_weight_update", "flush_cache", "continue_generation"]


def test_load_weights_brackets_bucketed_updates_with_requests_in_flight(make):
    eng, fake = make(options={"bucket_bytes": 64})
    [a] = started(eng, fake, "a")
    named = [("w1", torch.zeros(8)), ("w2", torch.zeros(8)), ("w3", torch.zeros(20)), ("w4", torch.ones(4))]
    mark = len(fake.calls)
    assert eng.load_weights(iter(named), version=3) == 160
    assert names(fake, mark) == BRACKET + ["update_weights_from_tensor"] * 3 + CLOSE
    assert kwargs_of(fake, "pause_generation") == [{"mode": "retract"}]
    updates = kwargs_of(fake, "update_weights_from_tensor")
    assert [(kw["names"], kw["nbytes"], kw["flush_cache"]) for kw in updates] == \
        [(["w1", "w2"], 64, False), (["w3"], 80, False), (["w4"], 16, False)]
    assert torch.equal(fake.weights["w4"], torch.ones(4))
    assert eng.version == 3 and fake.paused is None and not fake.session_open
    # The request in flight goes on, stamped with the new version.
    fake.emit(a.rid, [(5, -0.5)])
    assert [(o.rid, o.version) for o in eng.step()] == [("a", 3)]


def test_a_failing_update_still_closes_the_bracket_and_raises(make):
    eng, fake = make(options={"bucket_bytes": 16})
    started(eng, fake, "a")
    fake.fail["update_weights_from_tensor"] = "size mismatch for w2"
    mark = len(fake.calls)
    with pytest.raises(SglangError, match="size mismatch for w2"):
        eng.load_weights([("w2", torch.zeros(4)), ("w3", torch.zeros(4))], version=9)
    assert names(fake, mark) == BRACKET + ["update_weights_from_tensor"] + CLOSE
    assert eng.version == 0 and fake.paused is None and not fake.session_open


def test_a_refused_begin_raises_and_continues_generation(make):
    eng, fake = make()
    fake.fail["begin_weight_update"] = "a weight-update session is already open"
    mark = len(fake.calls)
    with pytest.raises(SglangError, match="session is already open"):
        eng.load_weights([("w", torch.zeros(2))], version=1)
    assert names(fake, mark) == BRACKET + ["continue_generation"]
    assert eng.version == 0 and fake.paused is None


# --- 5. options -----------------------------------------------------------------------------

def test_server_args_from_arguments_and_options(make):
    eng, fake = make(version=1, max_running=8, seed=3,
                     options={"tp_size": 2, "sleep_on_idle": True, "bucket_bytes": 1024})
    assert fake.server_args == {"model_path": "/models/tiny", "skip_tokenizer_init": True,
                                "max_running_requests": 8, "random_seed": 3, "enable_memory_saver": True,
                                "log_level": "warning", "tp_size": 2, "sleep_on_idle": True}  # dtype: SGLang's
    assert eng.bucket_bytes == 1024 and eng.version == 1 and "SGLANG_USE_CPU_ENGINE" not in os.environ


def test_cpu_device_and_checkpoint_dtype(make, tiny_dir):
    """device="cpu": SGLang's CPU code paths (an environment switch its scheduler reads at
    import), no CUDA-only memory saver, and the checkpoint's dtype, never "auto" serving a
    float32 checkpoint in float16. The operator's own choices win."""
    built = []

    def factory(**server_args):
        built.append(FakeSglangEngine(**server_args))
        return built[-1]

    eng = SglangEngine(tiny_dir, options={"device": "cpu"}, engine_factory=factory, io_struct=sglang_fake.io_struct)
    args = built[0].server_args
    assert args["enable_memory_saver"] is False and args["dtype"] == "float32"
    assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
    eng.shutdown(), built[0].loop.close()
    eng = SglangEngine(tiny_dir, options={"dtype": "bfloat16"}, engine_factory=factory,
                       io_struct=sglang_fake.io_struct)
    assert built[1].server_args["dtype"] == "bfloat16" and built[1].server_args["enable_memory_saver"] is True
    eng.shutdown(), built[1].loop.close()


@pytest.mark.parametrize("bad", ["tp_sise", "random_seed", "incremental_streaming_output"])
def test_unknown_options_are_rejected_by_name(make, bad):
    with pytest.raises(BackendError) as e:
        make(options={bad: 1, "mem_fraction_static": 0.5})
    assert repr(bad) in str(e.value) and "mem_fraction_static" in str(e.value)  # names it, lists the known


def test_importing_the_adapter_does_not_load_sglang():
    import subprocess
    import sys

    code = "import sys, gyre.workerd.engines.sglang; assert 'sglang' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_shutdown_closes_streams(make):
    eng, fake = make()
    started(eng, fake, "a")
    eng.shutdown()
    assert names(fake)[-1] == "shutdown" and eng.running == 0


# --- 6. SURFACE against the installed SGLang's source ---------------------------------------

MODULES = {"Engine": "sglang.srt.entrypoints.engine",
           "TokenizerManager": "sglang.srt.managers.tokenizer_manager",
           "PauseGenerationReqInput": "sglang.srt.managers.io_struct",
           "ContinueGenerationReqInput": "sglang.srt.managers.io_struct",
           "SamplingParams": "sglang.srt.sampling.sampling_params", "ServerArgs": "sglang.srt.server_args"}


class Source:
    """Classes and methods of an installed SGLang, found by parsing, following imports and
    base classes (mixins) within the package."""

    def __init__(self, root: Path):
        self.root = root
        self._trees: dict[str, ast.Module] = {}

    def tree(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = self.root.joinpath(*module.split(".")[1:]).with_suffix(".py")
            self._trees[module] = ast.parse(path.read_text(), str(path))
        return self._trees[module]

    def cls(self, module: str, name: str) -> tuple[str, ast.ClassDef]:
        body = self.tree(module).body
        for node in body:
            if isinstance(node, ast.ClassDef) and node.name == name:
                return module, node
        for node in body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sglang") \
                    and any(a.name == name and a.asname is None for a in node.names):
                return self.cls(node.module, name)
        raise LookupError(f"class {name} not in {module}")

    def method(self, module: str, cls: str, name: str):
        module, node = self.cls(module, cls)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == name:
                return item
        for base in node.bases:
            if isinstance(base, ast.Name):
                try:
                    return self.method(module, base.id, name)
                except LookupError:
                    continue
        raise LookupError(f"{cls}.{name} not found")

    def fields(self, module: str, cls: str) -> set[str]:
        _, node = self.cls(module, cls)
        return {n.target.id for n in node.body
                if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
                and "ClassVar" not in ast.unparse(n.annotation)}

    def server_args_fields(self) -> set[str]:
        """0.5.23 assembles ServerArgs from the namespace classes in _INPUT_NAMESPACES."""
        module = MODULES["ServerArgs"]
        fields = self.fields(module, "ServerArgs")
        for node in self.tree(module).body:
            targets = [getattr(t, "id", None) for t in getattr(node, "targets", [])]
            if isinstance(node, ast.Assign) and "_INPUT_NAMESPACES" in targets:
                for ns in node.value.elts:
                    fields |= self.fields(module, ns.id)
        return fields

    def constants(self, module: str) -> dict[str, object]:
        return {t.id: n.value.value for n in self.tree(module).body if isinstance(n, ast.Assign)
                and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}


@pytest.fixture(scope="module")
def source() -> Source:
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang is not installed")
    return Source(Path(next(iter(spec.submodule_search_locations))))


def params(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> set[str]:
    a = fn.args
    return {p.arg for p in a.posonlyargs + a.args + a.kwonlyargs} - {"self"}


@pytest.mark.parametrize("entry", sorted(adapter.SURFACE))
def test_surface_matches_sglang_source(source, entry):
    keywords = set(adapter.SURFACE[entry])
    if entry == "ServerArgs":
        missing = keywords - source.server_args_fields()
    elif "." in entry:
        cls, name = entry.split(".")
        fn = source.method(MODULES[cls], cls, name)
        assert isinstance(fn, ast.AsyncFunctionDef) == (entry in adapter.AWAITED), f"{entry}: sync/async"
        missing = keywords - params(fn)
    else:
        missing = keywords - source.fields(MODULES[entry], entry)
    assert not missing, f"{entry} has no {sorted(missing)} in the installed SGLang"


def test_engine_attributes_tags_and_pause_mode_match_sglang_source(source):
    init = source.method(MODULES["Engine"], "Engine", "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}
    assert {a.split(".")[1] for a in adapter.ATTRIBUTES} <= assigned
    consts = source.constants("sglang.srt.constants")
    assert {adapter.WEIGHTS, adapter.KV_CACHE, adapter.CUDA_GRAPH} == \
        {consts[f"GPU_MEMORY_TYPE_{t}"] for t in ("WEIGHTS", "KV_CACHE", "CUDA_GRAPH")}
    _, pause = source.cls(MODULES["PauseGenerationReqInput"], "PauseGenerationReqInput")
    [mode] = [n for n in pause.body if isinstance(n, ast.AnnAssign) and n.target.id == "mode"]
    assert repr(adapter.PAUSE_MODE) in ast.unparse(mode.annotation)
    # Streaming is cumulative unless this is set, and the adapter never lets it be set.
    serving = source.fields("sglang.srt.arg_groups.fields.serving", "Serving")
    assert "incremental_streaming_output" in serving
    assert "incremental_streaming_output" not in adapter.SERVER_OPTIONS


def test_the_fake_keeps_to_sglangs_signatures(source):
    assert sglang_fake.SERVER_ARGS_FIELDS <= source.server_args_fields()
    owners = {"Engine": FakeSglangEngine, "TokenizerManager": sglang_fake.FakeTokenizerManager}
    for entry in adapter.SURFACE:
        cls, _, name = entry.partition(".")
        if cls in owners:
            fake = set(inspect.signature(getattr(owners[cls], name)).parameters) - {"self"}
            assert fake <= params(source.method(MODULES[cls], cls, name)), entry


# --- the worker's role changes across SGLang and the trainer ------------------------------

class _RecordingTrainer:
    """A CPU trainer whose offload/onload land in the fake's call log, so one sequence shows
    the order across engine and trainer."""

    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def offload(self):
        self.log.append(("trainer.offload", {}))
        return 123

    def onload(self):
        self.log.append(("trainer.onload", {}))

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_worker_role_changes_order_engine_and_trainer(make, tiny_model):
    """To training: abort by id, flush, release, and only then the trainer onloads. To
    rollout: the trainer offloads first, then weights come back before the KV cache."""
    from gyre.workerd import wire
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.trainers.cpu import CpuTrainer
    from gyre.workerd.worker import Role, Worker

    eng, fake = make()
    worker = Worker(WorkerConfig(coordinator="tcp://127.0.0.1:1", node_id="n0"))
    worker.engine, worker.role = eng, Role.ROLLOUT
    worker.trainer = _RecordingTrainer(CpuTrainer(tiny_model), fake.calls)
    worker.generate(wire.Generate(req_id=7, rid="r1", prompt_ids=[3, 4], max_new_tokens=4), [])
    assert eng.step() == []  # the stream reaches the scheduler
    mark = len(fake.calls)
    outs = worker.set_role(wire.SetRole(req_id=8, role="training"), [])
    assert names(fake, mark) == ["abort_request", "flush_cache", "release_memory_occupation", "trainer.onload"]
    assert kwargs_of(fake, "abort_request")[-1]["rid"].endswith(":r1")
    final, changed = outs[0][0], outs[-1][0]
    assert (final.rid, final.finished, final.finish_reason) == ("r1", True, "abort")
    assert changed.role == "training" and worker.role is Role.TRAINING
    mark = len(fake.calls)
    outs = worker.set_role(wire.SetRole(req_id=9, role="rollout"), [])
    assert fake.calls[mark:] == [("trainer.offload", {}),
                                 ("resume_memory_occupation", {"tags": ["weights"]}),
                                 ("resume_memory_occupation", {"tags": ["kv_cache", "cuda_graph"]})]
    assert outs[-1][0].freed_bytes == 123 and worker.role is Role.ROLLOUT


@pytest.mark.parametrize("role", ["rollout", "training"])
def test_welcome_never_holds_engine_and_trainer_memory_together(make, monkeypatch, tiny_dir, role):
    """Start-up on one device: SGLang starts, releases its memory, then the trainer is built;
    a rollout cell then offloads the trainer before SGLang takes its memory back."""
    from gyre.workerd import backends, wire
    from gyre.workerd.config import WorkerConfig
    from gyre.workerd.trainers import cpu
    from gyre.workerd.worker import Role, Worker

    built = []

    class Engine(SglangEngine):
        def __init__(self, model_dir, **kw):
            def factory(**server_args):
                built.append(FakeSglangEngine(**server_args))
                return built[-1]

            super().__init__(model_dir, engine_factory=factory, io_struct=sglang_fake.io_struct, **kw)

    class Trainer(cpu.CpuTrainer):
        def __init__(self, *a, **kw):
            built[0].calls.append(("trainer.build", {}))
            super().__init__(*a, **kw)

        def offload(self):
            built[0].calls.append(("trainer.offload", {}))
            return 0

    monkeypatch.setattr(backends, "check_backends", lambda engine, trainer: None)
    monkeypatch.setattr(adapter, "SglangEngine", Engine)
    monkeypatch.setattr(cpu, "CpuTrainer", Trainer)
    worker = Worker(WorkerConfig(coordinator="tcp://127.0.0.1:1", node_id="n0", engine_backend="sglang"))
    (ready, _), = worker.welcome(wire.Welcome(req_id=1, node_id="n0", cell=0, role=role, model_dir=str(tiny_dir),
                                              engine=wire.EngineSpec(options={"server": {"device": "cpu"}})), [])
    fake = built[0]
    try:
        start = ["flush_cache", "release_memory_occupation", "trainer.build"]
        if role == "rollout":
            assert names(fake) == start + ["trainer.offload", "resume_memory_occupation", "resume_memory_occupation"]
        else:
            assert names(fake) == start
        assert ready.role == role and worker.role is Role(role)
    finally:
        worker.engine.shutdown()
        fake.loop.close()


def test_a_direct_publication_supersedes_one_left_pending(make):
    """A resume failed after the weights came back (the publication stays pending); a newer
    publication then loads directly: the next resume must not roll back to the older one."""
    eng, fake = make()
    eng.release_memory()
    eng.load_weights([("w", torch.full((2,), 1.0))], version=5)
    fake.fail["update_weights_from_tensor"] = "out of memory"
    with pytest.raises(SglangError):
        eng.resume_memory()
    del fake.fail["update_weights_from_tensor"]
    eng.load_weights([("w", torch.full((2,), 2.0))], version=6)  # weights are resident: direct
    eng.resume_memory()
    assert eng.version == 6 and torch.equal(fake.weights["w"], torch.full((2,), 2.0))
