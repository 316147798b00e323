"""Shared fixtures: the tiny model directory (written once per session)."""

from __future__ import annotations

import os

import pytest

# A harness's Bash tool runs the user's login shell, and pyenv's `eval "$(pyenv init -)"` there
# runs `pyenv rehash`, which waits PYENV_REHASH_TIMEOUT (60 s) for a lock file that a shell
# killed mid-rehash leaves behind (one appeared 27 minutes into a suite run), and each later
# Claude Code test then spent 60 s in its first Bash command (72 s against 1 s without the
# lock). A shell that cannot take the lock now gives up after a second, rehashing nothing.
os.environ.setdefault("PYENV_REHASH_TIMEOUT", "1")


# The suite's command (README) runs three xdist workers in three lanes. The main lane holds every
# test that starts a process, a container or a harness, or asserts a deadline, in order, at the
# normal priority. The waiting lane holds the tests that mostly wait (the harness_stall tier:
# Claude Code's 300 s watchdog, a CPU-idle 5.5 minutes; the restart tests, whose agents sleep),
# at the normal priority. The side lane
# holds CPU-bound tests with no deadline shorter than minutes (in-process runs, megatron's cells
# and parity, eval, the learning runs) at nice SIDE_NICE: they take the cores the main lane
# leaves idle and cannot delay its deadlines (running both at one priority failed four deadline
# tests under contention; .ci/run turns the kernel's autogroup off, under which nice would hold
# only within a session). The lanes are chosen by node id, the one thing xdist's controller sees
# (xdist 3.8's own xdist_group cannot rename pytest 9.2's node ids); a test of a waiting tier
# missing here is a usage error. With -n 2 the waiting lane queues behind another; without -n,
# nothing changes.
WAITING_TIERS = ("harness_stall",)
WAITING_TESTS = frozenset({
    "tests/harness/test_claude_code.py::test_a_pause_past_the_300s_watchdog_inside_a_streamed_answer",
    # Its agents sleep between calls, and while the coordinator is down.
    "tests/faults/test_restart.py::test_a_killed_coordinators_executions_carry_on_in_their_sandboxes",
    "tests/faults/test_restart.py::test_gyre_restart_hands_the_running_executions_to_the_resume",
    "tests/faults/test_restart.py::test_a_coordinator_killed_in_training_keeps_the_slow_groups_executions",
    "tests/faults/test_restart.py::test_a_coordinator_killed_in_publication_or_a_checkpoint_keeps_the_running_groups[publication]",
    "tests/faults/test_restart.py::test_a_coordinator_killed_in_publication_or_a_checkpoint_keeps_the_running_groups[checkpoint]",
    "tests/harness/test_restart_harnesses.py::test_a_real_harness_in_podman_outlives_its_coordinator[claude-code]",
    "tests/harness/test_restart_harnesses.py::test_a_real_harness_in_podman_outlives_its_coordinator[codex]",
})
SIDE_MODULES = frozenset({
    "tests/coordinator/test_learning.py", "tests/coordinator/test_heldout.py",
    "tests/coordinator/test_keep_checkpoints.py", "tests/coordinator/test_release.py",
    "tests/coordinator/test_reroute.py", "tests/coordinator/test_sim.py", "tests/cli/test_sim_cli.py",
    "tests/real_model/test_tito.py", "tests/real_model/test_smollm2.py", "tests/real_model/test_properties.py",
    "tests/workerd/test_megatron.py", "tests/workerd/test_reducer.py", "tests/workerd/test_learning.py",
    "tests/workerd/test_tree_training.py", "tests/cli/test_export.py",
    "tests/real_model/test_sandbox_runs.py",
})
SIDE_TESTS = frozenset({  # (test_eval's podman case runs its tasks under their deadlines: main lane)
    "tests/cli/test_eval.py::test_the_demo_on_the_tiny_model_is_heldout_score_of_its_outcomes",
    "tests/cli/test_eval.py::test_the_table_names_unscored_tasks_and_prints_pass_at_k",
    "tests/cli/test_eval.py::test_a_run_directory_evaluates_its_checkpoints_weights",
    "tests/cli/test_eval.py::test_refusals_are_one_line_and_make_no_run_directory",
    "tests/coordinator/test_inproc.py::test_a_run_on_inproc_workers_starts_no_workerd[inproc]",
    "tests/real_model/test_runs.py::test_two_steps_of_gyre_up_on_smollm2",
    "tests/coordinator/test_coordinator_e2e.py::test_a_run_on_tensor_parallel_megatron_cells",
    "tests/coordinator/test_coordinator_e2e.py::test_an_elastic_run_on_pipeline_parallel_megatron_trainers",
})
# Whole modules of the waiting lane (none now: the fault matrix there, beside the restart tests,
# missed its rollout windows in .ci/run at 0fe4e45).
WAITING_MODULES: frozenset[str] = frozenset()
SIDE_NICE = 10


def side_lane(nodeid: str) -> bool:
    return not waiting_lane(nodeid) and (nodeid in SIDE_TESTS or nodeid.split("::", 1)[0] in SIDE_MODULES)


def waiting_lane(nodeid: str) -> bool:
    return nodeid in WAITING_TESTS or nodeid.split("::", 1)[0] in WAITING_MODULES


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; absent without it
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup`: the two lanes above (any other --dist: xdist's own)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Lanes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "waiting" if waiting_lane(nodeid) else "side" if side_lane(nodeid) else "suite"

    return Lanes(config, log)


def _renice(niceness: int) -> None:
    """Every thread of this process (Linux's nice is per thread; torch's pool is already up)
    to `niceness`; children started later inherit it. Raising it back needs CAP_SYS_NICE,
    without which a side-lane worker stays low for its waiting test too (it only waits)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
        except (PermissionError, ProcessLookupError):
            pass


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook, on the controller; a worker's own dist is "no"
def pytest_configure_node(node):
    node.workerinput["gyre_lanes"] = node.config.getvalue("dist") == "loadgroup"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if not getattr(item.config, "workerinput", {}).get("gyre_lanes"):
        return
    want = SIDE_NICE if side_lane(item.nodeid) else 0
    if os.getpriority(os.PRIO_PROCESS, 0) != want:
        _renice(want)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from gyre.workerd.modeldir import init_tiny

    return init_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
CORPUS = [
    "You are a helpful assistant.\n\nDo the task.\n", "hello world, hello there!\n\n\n", "  indented\n    more\n",
    '{"path": "notes/a.txt", "content": "hi\\n"}\n', "def f(x):\n    return x + 1\n\n", "result\n\n", "ok\n\n\n\n",
    "The quick brown fox jumps over the lazy dog.  Twice.\t\ttabs\r\n", "<tool_call>\n</tool_call>\n",
    "é 42 ! {} : \" x word", "".join(chr(c) for c in range(32, 127)),
]


def build_bpe_dir(root, *, split: str, added: list[str]):
    """A tokenizer with real merges (a BPE trained on a small corpus) and the tiny model's chat
    template: `split` "qwen2" (byte-level, Qwen2's pre-tokenizer regex), "gpt2" (byte-level,
    GPT-2's, as SmolLM2) or "metaspace" (SentencePiece-style, prepend_scheme "first"), `added`
    the added tokens (Qwen's has the tool tags, SmolLM2's only ChatML's). Enough for the
    proxy's tokenisation properties; there are no weights."""
    import json

    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from gyre.workerd.modeldir import CHAT_TEMPLATE

    if split == "metaspace":  # SentencePiece-style (Mistral, Llama 2): "▁" marks spaces, prepended at offset 0
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
        tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, special_tokens=["<unk>"])
    else:
        tok = Tokenizer(models.BPE())
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split == "gpt2")
        tok.pre_tokenizer = byte_level if split == "gpt2" else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"), byte_level])
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer)
    tok.add_special_tokens([AddedToken(t, special=t.startswith("<|"), normalized=False) for t in added])
    root.mkdir(parents=True, exist_ok=True)
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))
    return root


@pytest.fixture(scope="session")
def bpe_dirs(tmp_path_factory):
    """name -> a tokenizer directory with merges: Qwen2's split regex with the tool tags as
    added tokens, and GPT-2's (SmolLM2's) with only ChatML's."""
    from gyre.workerd.modeldir import SPECIAL_TOKENS

    root = tmp_path_factory.mktemp("bpe")
    return {"qwen2": build_bpe_dir(root / "qwen2", split="qwen2", added=SPECIAL_TOKENS),
            "gpt2": build_bpe_dir(root / "gpt2", split="gpt2", added=SPECIAL_TOKENS[:3]),
            "metaspace": build_bpe_dir(root / "metaspace", split="metaspace", added=SPECIAL_TOKENS)}


@pytest.fixture(scope="session", params=["tiny", "qwen2", "gpt2", "metaspace"])
def any_tokenizer(request, tiny_dir, bpe_dirs):
    """The tiny model's byte tokenizer and the three BPE ones, each a ChatTokenizer."""
    from gyre.proxy.chat import ChatTokenizer

    return ChatTokenizer(tiny_dir if request.param == "tiny" else bpe_dirs[request.param])


@pytest.fixture(scope="session")
def chat_tokenizer(tiny_dir):
    from gyre.proxy.chat import ChatTokenizer

    return ChatTokenizer(tiny_dir)


@pytest.fixture
def tiny_model(tiny_dir):
    from gyre.workerd.model import load_model

    return load_model(tiny_dir)


def pytest_collection_modifyitems(config, items):
    unlisted = [item.nodeid for item in items if item.nodeid not in WAITING_TESTS
                and any(item.get_closest_marker(tier) for tier in WAITING_TIERS)]
    if unlisted:
        raise pytest.UsageError(f"tests/conftest.py: add {', '.join(unlisted)} to WAITING_TESTS (its tier only waits)")
    stale = [m for m in SIDE_MODULES | WAITING_MODULES if not (config.rootpath / m).is_file()]
    collected = {item.nodeid for item in items}
    stale += [t for t in SIDE_TESTS if t not in collected and any(i.startswith(t.split("::")[0]) for i in collected)]
    if stale:
        raise pytest.UsageError(f"tests/conftest.py: SIDE_MODULES/SIDE_TESTS name no test: {', '.join(sorted(stale))}")
    if os.environ.get("GYRE_TEST_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="GPU test: set GYRE_TEST_GPU=1 on a GPU machine")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a folder named gpu
            item.add_marker(skip)

