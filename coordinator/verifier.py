"""verifier.py: scoring inside the sandbox, on the state the agent left: Harbor and SWE-style.

Runs after the agent has stopped, in the same sandbox. Harbor: the task's tests/ folder is
copied to /tests only now (the agent never saw it), `bash /tests/test.sh` runs under the
verifier's deadline, and the reward is read from /logs/verifier/reward.txt (a number) or
reward.json (`{"reward": x}`, or one numeric value); any finite number is a score, binary or
not. SWE-style: the row's test_patch is applied, its test_cmd runs, and the FAIL_TO_PASS and
PASS_TO_PASS ids are looked up in the output (pytest -rA / -v lines, unittest's "... ok");
reward 1 when all pass, else 0, or the FAIL_TO_PASS fraction (`swe_score = "fraction"`).
A verifier that cannot produce a reward fails the attempt (EvaluatorFailed, retried, then
evaluator_error): never a 0. What the launcher guarantees before a verifier runs: nothing of
the agent's still runs, /tests and /logs/verifier are fresh (`prepare_sandbox`), and the
workspace has been copied out. Logs and test output are capped. Not the host-side
evaluators (evaluator.py).
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from pathlib import Path

from gyre.coordinator.evaluator import EvaluatorError, EvaluatorFailed, Outcome
from gyre.coordinator.sandbox.base import CappedLog, Sandbox
from gyre.coordinator.tasks import Task

TESTS_DIR, SOLUTION_DIR, VERIFIER_LOGS = "/tests", "/solution", "/logs/verifier"
SCORE_MODES = ("all", "fraction")
LOG_LIMIT_BYTES = 16 << 20  # of verifier.log, and of a SWE test run's output
# Before the tests go in (the agent's processes are gone by then): whatever the agent left at
# /tests (a planted conftest.py, a link elsewhere) or at /logs (a link) is removed, and the
# verifier's output folder is made anew.
_FRESH = (f'if [ -L /logs ] || {{ [ -e /logs ] && [ ! -d /logs ]; }}; then rm -f /logs; fi; '
          f'rm -rf {TESTS_DIR} {VERIFIER_LOGS} && mkdir -p {VERIFIER_LOGS}')
# In the workdir when it still exists, else / (an agent may have removed it).
_IN_WORKDIR = 'cd "$1" 2>/dev/null || cd /; shift; exec "$@"'


def _tail(data: bytes, limit: int = 300) -> str:
    return " ".join(data.decode("utf-8", errors="replace").split())[-limit:]


def _number(text: str, where: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        raise EvaluatorFailed(f"{where} does not hold a number: {text.strip()[:80]!r}") from None
    if not math.isfinite(value):
        raise EvaluatorFailed(f"{where} holds {value}")
    return value


def reward_from_json(text: str) -> float:
    try:
        data = json.loads(text)
    except ValueError as e:
        raise EvaluatorFailed(f"reward.json is not JSON: {e}") from None
    if isinstance(data, (int, float)) and not isinstance(data, bool):
        return _number(str(data), "reward.json")
    if isinstance(data, dict):
        if "reward" in data:
            value = data["reward"]
        else:
            numbers = [v for v in data.values() if isinstance(v, (int, float)) and not isinstance(v, bool)]
            if len(numbers) != 1:
                raise EvaluatorFailed(f"reward.json has no 'reward' key and {len(numbers)} numeric values")
            value = numbers[0]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise EvaluatorFailed(f"reward.json: 'reward' must be a number, got {value!r}")
        return _number(str(value), "reward.json")
    raise EvaluatorFailed(f"reward.json must hold a number or an object, got {type(data).__name__}")


async def in_workdir(sandbox: Sandbox, argv: list[str], **kw):
    return await sandbox.exec(["sh", "-c", _IN_WORKDIR, "sh", sandbox.workdir, *argv], cwd="/", **kw)


async def prepare_sandbox(sandbox: Sandbox, tests_dir: Path | None) -> None:
    """A Harbor task's /tests and /logs/verifier as the verifier's own, then its tests copied
    to /tests (a SWE row brings its tests as a patch: nothing to do). Called by the launcher
    once the agent's processes are gone and its workspace is out."""
    if tests_dir is None:
        return
    r = await sandbox.exec(["sh", "-c", _FRESH], cwd="/", timeout_s=60)
    if r.code != 0:
        raise EvaluatorFailed(f"could not clear {TESTS_DIR} and {VERIFIER_LOGS} (exit {r.code}): {_tail(r.output)}")
    await sandbox.upload(Path(tests_dir), TESTS_DIR)


class HarborVerifier:
    """tests/test.sh in the sandbox; the reward from /logs/verifier."""

    def __init__(self, sandbox: Sandbox, spec: dict, log_path: Path | None = None):
        self.sandbox = sandbox
        self.timeout_s = float(spec.get("timeout_s") or 600.0)
        self.env = dict(spec.get("env") or {})
        self.log_path = log_path

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        sb = self.sandbox
        await sb.exec(["sh", "-c", f"rm -rf {VERIFIER_LOGS} && mkdir -p {VERIFIER_LOGS}"], cwd="/", timeout_s=60)
        with open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile() as logf:
            r = await in_workdir(sb, ["bash", f"{TESTS_DIR}/test.sh"], env=self.env, timeout_s=self.timeout_s,
                                 log=CappedLog(logf, LOG_LIMIT_BYTES, "verifier.log"))
        if r.timed_out:
            raise EvaluatorFailed(f"tests/test.sh timed out after {self.timeout_s:g}s")
        text = await sb.read_file(f"{VERIFIER_LOGS}/reward.txt")
        if text is not None and text.strip():
            score = _number(text.decode("utf-8", errors="replace"), "reward.txt")
            return Outcome(score=score, valid=True, ref=f"reward.txt {score:g} (test.sh exit {r.code})")
        text = await sb.read_file(f"{VERIFIER_LOGS}/reward.json")
        if text is not None:
            score = reward_from_json(text.decode("utf-8", errors="replace"))
            return Outcome(score=score, valid=True, ref=f"reward.json {score:g} (test.sh exit {r.code})")
        raise EvaluatorFailed(f"tests/test.sh (exit {r.code}) wrote neither {VERIFIER_LOGS}/reward.txt nor "
                              "reward.json")


# pytest -rA: "PASSED id", "FAILED id - msg"; pytest -v: "id PASSED [ 10%]"; unittest: "name (mod.Class) ... ok".
_RA = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\s+(\S+)")
_V = re.compile(r"^(\S+)\s+(PASSED|FAILED|ERROR|XFAIL|XPASS|SKIPPED)\b")
_UNITTEST = re.compile(r"^(.+?) \.\.\. (ok|FAIL|ERROR|skipped|expected failure|unexpected success)\b")
_PASS = {"PASSED", "XFAIL", "ok", "expected failure"}


def test_results(output: str) -> dict[str, bool]:
    """Test id -> passed, from a test run's output (the last line about an id wins)."""
    out: dict[str, bool] = {}
    for raw in output.splitlines():
        line = raw.strip()
        if m := _RA.match(line):
            out[m.group(2)] = m.group(1) in _PASS
        elif m := _V.match(line):
            out[m.group(1)] = m.group(2) in _PASS
        elif m := _UNITTEST.match(line):
            out[m.group(1)] = m.group(2) in _PASS
    return out


def swe_score(results: dict[str, bool], f2p: list[str], p2p: list[str], mode: str) -> tuple[float, str]:
    f_ok = sum(results.get(t, False) for t in f2p)
    p_ok = sum(results.get(t, False) for t in p2p)
    ref = f"FAIL_TO_PASS {f_ok}/{len(f2p)}, PASS_TO_PASS {p_ok}/{len(p2p)}"
    if mode == "fraction":
        return f_ok / len(f2p), ref
    return float(f_ok == len(f2p) and p_ok == len(p2p)), ref


class _HeadAndTail:
    """A test run's output, its first and last `limit / 2` bytes kept (pytest -v names each
    test as it runs, -rA in a summary at the end): a log that writes forever stays bounded."""

    def __init__(self, limit: int):
        self.half = limit // 2
        self.head, self.tail = bytearray(), bytearray()
        self.dropped = 0

    def write(self, data: bytes) -> int:
        room = self.half - len(self.head)
        self.head += data[:max(room, 0)]
        self.tail += data[max(room, 0):]
        if (over := len(self.tail) - self.half) > 0:
            del self.tail[:over]
            self.dropped += over
        return len(data)

    def flush(self) -> None:
        pass

    def value(self) -> bytes:
        gap = f"\ngyre: {self.dropped} bytes of the test output dropped here\n".encode() if self.dropped else b""
        return bytes(self.head) + gap + bytes(self.tail)


class SweVerifier:
    def __init__(self, sandbox: Sandbox, spec: dict, mode: str = "all", log_path: Path | None = None):
        if mode not in SCORE_MODES:
            raise EvaluatorError(f"swe_score must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        self.sandbox = sandbox
        self.spec = spec
        self.mode = mode
        self.log_path = log_path
        self._patched: bool | None = None

    async def _apply_patch(self) -> bool:
        patch = self.spec.get("test_patch")
        if not patch:
            return True
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "p").write_text(patch)
            await self.sandbox.upload(Path(tmp, "p"), "/tmp/gyre-test.patch")
        r = await in_workdir(self.sandbox, ["git", "apply", "-v", "/tmp/gyre-test.patch"], timeout_s=120)
        if r.code == 127:
            raise EvaluatorFailed("git is not installed in the image (needed for test_patch)")
        return r.code == 0

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        if self._patched is None:
            self._patched = await self._apply_patch()
        if not self._patched:  # the agent's changes conflict with the tests: its work fails them
            return Outcome(score=0.0, valid=True, ref="test_patch did not apply")
        timeout = float(self.spec.get("timeout_s") or 1800.0)
        kept = _HeadAndTail(LOG_LIMIT_BYTES)
        r = await in_workdir(self.sandbox, ["bash", "-lc", self.spec["test_cmd"]], timeout_s=timeout, log=kept)
        output = kept.value()
        if self.log_path is not None:
            with open(self.log_path, "ab") as f:
                f.write(output)
        results = test_results(output.decode("utf-8", errors="replace"))
        if not results:
            raise EvaluatorFailed(f"test_cmd (exit {r.code}{', timed out' if r.timed_out else ''}) reported no "
                                  f"test results: {_tail(output)}")
        score, ref = swe_score(results, list(self.spec["fail_to_pass"]), list(self.spec.get("pass_to_pass") or []),
                               self.mode)
        return Outcome(score=score, valid=True, ref=ref + (" (timed out)" if r.timed_out else ""))


def build_verifier(task: Task, sandbox: Sandbox, *, swe_mode: str = "all", log_path: Path | None = None):
    kind = task.verifier.get("type")
    if kind == "harbor":
        return HarborVerifier(sandbox, task.verifier, log_path)
    if kind == "swe":
        return SweVerifier(sandbox, task.verifier, swe_mode, log_path)
    raise EvaluatorError(f"task {task.id!r}: verifier type must be harbor or swe, got {kind!r}")
