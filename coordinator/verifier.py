"""verifier.py: scoring in a fresh sandbox from the task's image: Harbor and SWE-style.

SWE-bench's rule: the tests never run where the agent ran. Once the agent's processes are
gone and its working directory is copied out, each attempt starts a new container from the
task's image with that copy put into its working directory (merged over the image's own
files there; a file the agent deleted comes back from the image) and, for Harbor, the
task's tests/ at /tests; its own command is the verifier's. So the shell, `timeout`,
`python3`, the preload list and Python's site hooks it runs with are the image's, whatever
the agent replaced in its own container (which is removed or, kept, never started again).
Harbor: `bash /tests/test.sh` runs in the working directory under the verifier's deadline
and the reward is read from /logs/verifier/reward.txt (a number) or reward.json
(`{"reward": x}`, or one numeric value); any finite number is a score. SWE-style: the row's
test_patch is applied with the image's git, its test_cmd runs under `bash -c` (no login
shell: no /etc/profile), and the FAIL_TO_PASS and PASS_TO_PASS ids are looked up in the
output (pytest -rA / -v lines, unittest's "... ok"); reward 1 when all pass, else 0, or the
FAIL_TO_PASS fraction (`swe_score = "fraction"`). A verifier that cannot produce a reward
fails the attempt (EvaluatorFailed, retried, then evaluator_error): never a 0. An image whose
working directory is / cannot be verified this way (the agent's copy would be the whole
system): evaluator_error. Logs and test output are capped. Not the host-side evaluators
(evaluator.py).

Harbor's `[verifier] environment = "agent"` (default "fresh") is for tasks that must check
system state the agent changed outside its workdir ("install nginx and configure
/etc/nginx"). The killed agent container is committed to a temporary image and the tests run
once in a new container from it (never a restart: its own command, `sleep`, is the agent's),
removed after with the image. Before scoring, the container's layer against its image
(`podman diff`) is written to RUN_DIR/executions/ID/agent-diff.json. What this mode
guarantees: no process of the agent's runs (its container's init was killed); the container's
command, the shell that runs test.sh (`busybox sh`, not bash), `timeout` and every busybox
applet that shell runs by name (rm, cat, grep, ...: applets beat PATH) come from the host's
statically linked busybox, mounted read-only, so no preload list or replaced library reaches
them; /tests is the task's, mounted read-only over whatever the agent left there;
/logs/verifier is made anew; an empty file is mounted over /etc/ld.so.preload and LD_PRELOAD,
BASH_ENV and ENV are emptied, PYTHONNOUSERSITE and PYTHONSAFEPATH set (no user site, no
usercustomize, no script folder first on sys.path). What it cannot: any program of the
image the tests call that is not a busybox applet (python3, pytest, bash, nginx, curl) is
the agent's to have replaced, and Python still loads sitecustomize.py and .pth files from its
site-packages (unless the tests run `python3 -I -S`); so a score in this mode is only as
trustworthy as those programs, and agent-diff.json is the record to audit (a changed
/usr/bin/python3 or a new .pth file shows there). Tests that can check through busybox alone
(`grep -q listen /etc/nginx/nginx.conf`) are fully trusted. It needs a local engine (the
busybox is the host's: Debian's busybox-static, /bin/busybox) and a test.sh that busybox sh
can run; SWE rows are always verified fresh.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path

from gyre.coordinator.evaluator import EvaluatorError, EvaluatorFailed, Outcome
from gyre.coordinator.sandbox.base import TRUSTED_BUSYBOX, CappedLog, Put, Sandbox, SandboxError
from gyre.coordinator.tasks import Task

TESTS_DIR, SOLUTION_DIR, VERIFIER_LOGS = "/tests", "/solution", "/logs/verifier"
SCORE_MODES = ("all", "fraction")
LOG_LIMIT_BYTES = 16 << 20  # of verifier.log, and of a SWE test run's output
# The Harbor verifier's command in its fresh sandbox: its output folder made anew, then the
# tests in the working directory (or / should it be missing).
_HARBOR = (f'rm -rf {VERIFIER_LOGS} && mkdir -p {VERIFIER_LOGS} && {{ cd "$1" 2>/dev/null || cd /; }} && shift '
           '&& exec "$@"')
# In a copy of the agent's container (environment = "agent"): the same, every step by the
# host's busybox (its applets run by name before anything on PATH).
_HARBOR_IN_COPY = (f'B={TRUSTED_BUSYBOX}; $B rm -rf {VERIFIER_LOGS} && $B mkdir -p {VERIFIER_LOGS} && '
                   '{ cd "$1" 2>/dev/null || cd /; } && shift && exec "$@"')
# What the agent could have left to run inside the tests' programs, turned off where an
# environment variable can: the preload variable, shells' startup files, Python's user site.
NEUTRAL_ENV = {"LD_PRELOAD": "", "BASH_ENV": "", "ENV": "", "PYTHONNOUSERSITE": "1", "PYTHONSAFEPATH": "1"}
BUSYBOX_PATHS = ("/bin/busybox", "/usr/bin/busybox")  # Debian's busybox-static; GYRE_BUSYBOX overrides
PATCH_INSIDE = "/tmp/gyre-test.patch"
MARK = "gyre-verifier:"  # the SWE command's first line says how the patch went: nothing of the agent's runs before it
_SWE = (f'cd "$1" 2>/dev/null || cd /; if [ -s {PATCH_INSIDE} ]; then '
        f'if ! command -v git >/dev/null 2>&1; then echo "{MARK} no git"; exit 0; fi; '
        f'if ! git -c core.fsmonitor=false apply -v {PATCH_INSIDE} >/tmp/gyre-apply.log 2>&1; then '
        f'echo "{MARK} test_patch did not apply"; cat /tmp/gyre-apply.log; exit 0; fi; fi; '
        f'echo "{MARK} ready"; exec bash -c "$2"')


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


def _static_elf(path: str) -> bool:
    """A 64-bit little-endian ELF executable without an interpreter (PT_INTERP): statically
    linked, so no preload list or library in the container reaches it."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 64 or head[:4] != b"\x7fELF" or head[4:6] != b"\x02\x01":
                return False
            (phoff,), (phentsize, phnum) = struct.unpack_from("<Q", head, 32), struct.unpack_from("<HH", head, 54)
            f.seek(phoff)
            table = f.read(phentsize * phnum)
    except OSError:
        return False
    return len(table) == phentsize * phnum and all(
        struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))


def trusted_busybox() -> str:
    """The host's statically linked busybox for the "agent" environment; EvaluatorError if none."""
    wanted = os.environ.get("GYRE_BUSYBOX")
    for path in (wanted,) if wanted else BUSYBOX_PATHS:
        if _static_elf(path):
            return path
    raise EvaluatorError(f"[verifier] environment = \"agent\" needs a statically linked busybox on this host "
                         f"({wanted or ' or '.join(BUSYBOX_PATHS)}; apt-get install busybox-static)")


class HarborVerifier:
    """tests/test.sh in a fresh sandbox holding the agent's copied-out workdir; the reward
    from its /logs/verifier."""

    def __init__(self, sandbox: Sandbox, spec: dict, log_path: Path | None = None,
                 owners: Mapping[str, tuple[int, int]] | None = None, diff_path: Path | None = None):
        self.sandbox = sandbox
        self.timeout_s = float(spec.get("timeout_s") or 600.0)
        self.env = dict(spec.get("env") or {})
        self.log_path = log_path
        self.owners = dict(owners or {})
        self.in_agent = spec.get("environment") == "agent"
        self.busybox = trusted_busybox() if self.in_agent else None
        self.diff_path = diff_path

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        rewards = (f"{VERIFIER_LOGS}/reward.txt", f"{VERIFIER_LOGS}/reward.json")
        with open(self.log_path, "ab") if self.log_path else tempfile.TemporaryFile() as logf:
            log = CappedLog(logf, LOG_LIMIT_BYTES, "verifier.log")
            if self.in_agent:
                r, got = await self._in_agent_copy(task, log, rewards)
            else:
                r, got = await self._fresh(task, workspace, log, rewards)
        return self._reward(r, got, rewards)

    async def _fresh(self, task: Task, workspace: Path, log: CappedLog, rewards: tuple[str, str]):
        sb = self.sandbox
        puts = [Put(Path(workspace), sb.workdir, self.owners)]
        if task.tests_dir is not None:
            puts.append(Put(Path(task.tests_dir), TESTS_DIR))
        return await sb.run_fresh(["sh", "-c", _HARBOR, "sh", sb.workdir, "bash", f"{TESTS_DIR}/test.sh"],
                                  puts=puts, env=self.env, timeout_s=self.timeout_s, log=log, read=rewards)

    async def _in_agent_copy(self, task: Task, log: CappedLog, rewards: tuple[str, str]):
        """test.sh by the trusted busybox sh in a copy of the agent's container; its layer's
        diff recorded first (once)."""
        sb = self.sandbox
        if self.diff_path is not None and not self.diff_path.exists():
            try:
                changes = await sb.changes()
            except SandboxError as e:
                raise EvaluatorFailed(f"the agent's container diff: {e}") from None
            tmp = self.diff_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(changes, indent=1) + "\n")
            tmp.replace(self.diff_path)
        mounts = {str(Path(task.tests_dir).resolve()): TESTS_DIR} if task.tests_dir is not None else {}
        argv = [TRUSTED_BUSYBOX, "sh", "-c", _HARBOR_IN_COPY, "sh", sb.workdir, TRUSTED_BUSYBOX, "sh",
                f"{TESTS_DIR}/test.sh"]
        return await sb.run_in_copy(argv, busybox=Path(self.busybox), mounts=mounts,
                                    env={**self.env, **NEUTRAL_ENV}, timeout_s=self.timeout_s, log=log, read=rewards)

    def _reward(self, r, got: dict[str, bytes | None], rewards: tuple[str, str]) -> Outcome:
        if r.timed_out:
            raise EvaluatorFailed(f"tests/test.sh timed out after {self.timeout_s:g}s")
        text = got[rewards[0]]
        if text is not None and text.strip():
            score = _number(text.decode("utf-8", errors="replace"), "reward.txt")
            return Outcome(score=score, valid=True, ref=f"reward.txt {score:g} (test.sh exit {r.code})")
        text = got[rewards[1]]
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
    """The row's test_patch and test_cmd in a fresh sandbox holding the agent's copied-out
    workdir; the score from the test ids in the output."""

    def __init__(self, sandbox: Sandbox, spec: dict, mode: str = "all", log_path: Path | None = None,
                 owners: Mapping[str, tuple[int, int]] | None = None):
        if mode not in SCORE_MODES:
            raise EvaluatorError(f"swe_score must be one of {', '.join(SCORE_MODES)}, got {mode!r}")
        self.sandbox = sandbox
        self.spec = spec
        self.mode = mode
        self.log_path = log_path
        self.owners = dict(owners or {})

    async def evaluate(self, task: Task, workspace: Path) -> Outcome:
        timeout = float(self.spec.get("timeout_s") or 1800.0)
        kept = _HeadAndTail(LOG_LIMIT_BYTES)
        with tempfile.TemporaryDirectory(prefix="gyre-swe-") as tmp:
            patch = Path(tmp, "test.patch")
            patch.write_text(self.spec.get("test_patch") or "")
            puts = [Put(Path(workspace), self.sandbox.workdir, self.owners), Put(patch, PATCH_INSIDE)]
            r, _ = await self.sandbox.run_fresh(["sh", "-c", _SWE, "sh", self.sandbox.workdir, self.spec["test_cmd"]],
                                                puts=puts, timeout_s=timeout, log=kept)
        output = kept.value()
        if self.log_path is not None:
            with open(self.log_path, "ab") as f:
                f.write(output)
        text = output.decode("utf-8", errors="replace")
        first = text.split("\n", 1)[0].strip()
        if first == f"{MARK} test_patch did not apply":  # the agent's changes conflict with the tests
            return Outcome(score=0.0, valid=True, ref="test_patch did not apply")
        if first == f"{MARK} no git":
            raise EvaluatorFailed("git is not installed in the image (needed for test_patch)")
        if first != f"{MARK} ready":
            raise EvaluatorFailed(f"test_cmd did not start (exit {r.code}): {_tail(output)}")
        results = test_results(text)
        if not results:
            raise EvaluatorFailed(f"test_cmd (exit {r.code}{', timed out' if r.timed_out else ''}) reported no "
                                  f"test results: {_tail(output)}")
        score, ref = swe_score(results, list(self.spec["fail_to_pass"]), list(self.spec.get("pass_to_pass") or []),
                               self.mode)
        return Outcome(score=score, valid=True, ref=ref + (" (timed out)" if r.timed_out else ""))


def build_verifier(task: Task, sandbox: Sandbox, *, swe_mode: str = "all", log_path: Path | None = None,
                   owners: Mapping[str, tuple[int, int]] | None = None, diff_path: Path | None = None):
    """The task's verifier, to run in fresh sandboxes made from `sandbox`'s image (or, for a
    Harbor task in the "agent" environment, from a copy of `sandbox`, its diff to `diff_path`);
    `owners` the copied-out workdir's (CopyReport.owners)."""
    kind = task.verifier.get("type")
    if kind not in ("harbor", "swe"):
        raise EvaluatorError(f"task {task.id!r}: verifier type must be harbor or swe, got {kind!r}")
    if sandbox.workdir.rstrip("/") == "" and task.verifier.get("environment") != "agent":
        raise EvaluatorError(f"task {task.id!r}: the image's working directory is /, so the agent's work cannot be "
                             "told from the system; set WORKDIR in its Dockerfile")
    if kind == "harbor":
        return HarborVerifier(sandbox, task.verifier, log_path, owners, diff_path)
    return SweVerifier(sandbox, task.verifier, swe_mode, log_path, owners)
