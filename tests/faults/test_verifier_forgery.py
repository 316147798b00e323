"""A wrong answer stays wrong whatever the agent did to its container (issue 36, finding 2).

The "agent" (a harness script run as root in the container) writes a wrong answer (worth 0.25
to the verifier below) and then plants every way of claiming the full score it had: a `bash`,
`sh`, `timeout` or `python3` that runs the real one and then writes 1.0, a `bash` and a
`python3` earlier on PATH, Python's sitecustomize.py, usercustomize.py and a .pth file, a
library in /etc/ld.so.preload, and a `sleep` whose `sleep infinity` (the container's command)
rewrites the reward in a loop; on a SWE row, a line in /etc/profile for a login shell. Each of
them, had it run while the tests ran, writes 1.0 (or makes every test pass): the verifier
must run from the task's image alone and give the honest score. The vectors do not undo one
another, so one execution carries all of the Harbor ones (a single vector that ran would show
as 1.0); the SWE row is its own. Real podman containers.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap

import pytest

from gyre.coordinator.sandbox.base import LABEL_OWNER
from gyre.coordinator.taskformats import load_harbor_task, load_swe_tasks
from tests.sandbox.conftest import containers, harbor_task, podman, podman_ready, run_task, scripted_proxy, shell_preset

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name
pytestmark = pytest.mark.sandbox

# The claim every planted tool makes once it has done its real work (only while the tests run).
CLAIM = '[ -e /tests/test.sh ] && [ -d /logs/verifier ] && echo 1.0 > /logs/verifier/reward.txt'
PY_CLAIM = ("import atexit, os; atexit.register(lambda: os.path.exists('/tests/test.sh') and "
            "os.path.isdir('/logs/verifier') and open('/logs/verifier/reward.txt', 'w').write('1.0\\n'))")
PRELOAD_C = textwrap.dedent('''\
    #include <stdio.h>
    #include <unistd.h>
    __attribute__((destructor)) static void claim(void) {
        if (access("/tests/test.sh", F_OK) == 0 && access("/logs/verifier", F_OK) == 0) {
            FILE *f = fopen("/logs/verifier/reward.txt", "w");
            if (f) { fputs("1.0\\n", f); fclose(f); }
        }
    }
''')
# The agent's part: `wrap TOOL REAL` makes TOOL run REAL and then claim the full score.
PROLOGUE = textwrap.dedent(f'''\
    set -e
    echo 41 > answer.txt
    CLAIM='{CLAIM}'
    wrap() {{ printf '#!/usr/bin/dash\\n"%s" "$@"; rc=$?\\n%s\\nexit $rc\\n' "$2" "$CLAIM" > "$1"; chmod 755 "$1"; }}
    STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
    USERSITE=$(python3 -m site --user-site)
    SITE=/usr/local/lib/$(basename "$STDLIB")/dist-packages
    mkdir -p "$USERSITE" "$SITE"
''')
# Each way, as the agent plants it (in this order: the PATH ones wrap the real tools first).
VECTORS = {
    "bash on PATH": "wrap /usr/local/bin/bash /usr/bin/bash",
    "python3 on PATH": "wrap /usr/local/bin/python3 /usr/bin/python3",
    "bash": "mv /usr/bin/bash /usr/bin/bash.real && wrap /usr/bin/bash /usr/bin/bash.real",
    "sh": "rm /usr/bin/sh && wrap /usr/bin/sh /usr/bin/dash",
    "timeout": "mv /usr/bin/timeout /usr/bin/timeout.real && wrap /usr/bin/timeout /usr/bin/timeout.real",
    "python3": 'PY=$(readlink -f /usr/bin/python3) && mv "$PY" "$PY.real" && wrap "$PY" "$PY.real"',
    "sitecustomize.py": f'rm -f "$STDLIB/sitecustomize.py"; printf "%s\\\\n" "{PY_CLAIM}" > "$STDLIB/sitecustomize.py"',
    "usercustomize.py": f'printf "%s\\\\n" "{PY_CLAIM}" > "$USERSITE/usercustomize.py"',
    ".pth": f'printf "%s\\\\n" "{PY_CLAIM}" > "$SITE/zz-claim.pth"',
    # `sleep infinity`, the container's own command, comes back as a reward loop.
    "sleep": textwrap.dedent('''\
        mv /usr/bin/sleep /usr/bin/sleep.real
        LOOP='if [ "$1" = infinity ]; then (while :; do '"$CLAIM"'; /usr/bin/sleep.real 0.01; done) & fi'
        printf '#!/usr/bin/dash\\n%s\\nexec /usr/bin/sleep.real "$@"\\n' "$LOOP" > /usr/bin/sleep
        chmod 755 /usr/bin/sleep'''),
    # Every dynamically linked program loads this library (and claims at its exit).
    "ld.so.preload": "cp /opt/claim.so /usr/lib/claim.so && echo /usr/lib/claim.so > /etc/ld.so.preload",
}
PLANT = PROLOGUE + "\n".join(VECTORS.values()) + "\n"
# The verifier: bash runs python3; 1.0 for the right answer (42), 0.25 for any other.
CHECK = textwrap.dedent('''\
    import pathlib
    answer = pathlib.Path("/app/answer.txt").read_text().strip()
    pathlib.Path("/logs/verifier/reward.txt").write_text("1.0\\n" if answer == "42" else "0.25\\n")
''')


def _preload_library(folder) -> None:
    """claim.so, built here (the base image has no compiler), into the task's image at /opt."""
    if shutil.which("gcc") is None:
        pytest.skip("gcc is needed to build the ld.so.preload library")
    src = folder / "claim.c"
    src.write_text(PRELOAD_C)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(folder / "environment" / "claim.so"), str(src)],
                   check=True)


async def test_no_planted_tool_or_hook_forges_a_harbor_score(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "forge", test_sh="python3 /tests/check.py\n", dockerfile=(
        "FROM localhost/gyre-base:bookworm\nWORKDIR /app\nCOPY claim.so /opt/claim.so\n"))
    (folder / "tests" / "check.py").write_text(CHECK)
    _preload_library(folder)
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(PLANT),
                         owner="forge-harbor")
    log = (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
    assert run.status == "completed", (run.status, run.ref, log[-2000:])  # every plant went in (set -e)
    assert (run.reward, run.valid, run.ref) == (0.25, True, "reward.txt 0.25 (test.sh exit 0)")
    assert (tmp_path / "run" / "executions" / "e1" / "workspace" / "answer.txt").read_text() == "41\n"
    assert containers(podman, **{LABEL_OWNER: "forge-harbor"}) == []  # the agent's and the verifier's, gone


CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a + b\n"
TESTS = textwrap.dedent('''\
    import unittest
    from calc import add, mul

    class T(unittest.TestCase):
        def test_add(self):
            self.assertEqual(add(2, 3), 5)

        def test_mul(self):
            self.assertEqual(mul(2, 3), 6)
''')
# Half the fix, then a login shell's /etc/profile that reports every test as passed at its exit.
PROFILE = textwrap.dedent('''\
    sed -i '2s/a - b/a + b/' calc.py
    OK='echo "test_add (test_calc.T.test_add) ... ok"; echo "test_mul (test_calc.T.test_mul) ... ok"'
    printf 'trap %s EXIT\\n' "'$OK'" >> /etc/profile
''')


async def test_a_login_profile_does_not_forge_a_swe_score(podman, scripted_proxy, tmp_path):
    env = tmp_path / "env"
    env.mkdir()
    (env / "calc.py").write_text(CALC)
    (env / "test_calc.py").write_text(TESTS)
    (env / "Dockerfile").write_text("FROM localhost/gyre-base:bookworm\nWORKDIR /repo\nCOPY . /repo\n")
    row = {"instance_id": "calc__forge-1", "problem_statement": "add and mul are wrong; fix them.",
           "dockerfile": "env/Dockerfile", "test_cmd": "python3 -m unittest -v test_calc",
           "FAIL_TO_PASS": ["test_add (test_calc.T.test_add)", "test_mul (test_calc.T.test_mul)"]}
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    (task,) = load_swe_tasks(tmp_path / "rows.jsonl")
    run = await run_task(scripted_proxy, podman, task, tmp_path / "run", shell_preset(PROFILE), owner="forge-swe")
    assert (run.status, run.reward, run.ref) == ("completed", 0.0, "FAIL_TO_PASS 1/2, PASS_TO_PASS 0/0"), run.ref
    assert containers(podman, **{LABEL_OWNER: "forge-swe"}) == []


async def test_the_agents_files_keep_their_owner_in_the_verifiers_container(podman, scripted_proxy, tmp_path):
    """An image that runs as a user: the copy put into the fresh container is that user's
    again (the host copy belongs to whoever copied it), so tests that write there still can."""
    folder = harbor_task(tmp_path, "owned", dockerfile=(
        "FROM localhost/gyre-base:bookworm\nRUN mkdir -p /app /logs && chown 1000:1000 /app /logs\n"
        "WORKDIR /app\nUSER 1000\n"), test_sh=(
        'mkdir -p /app/sub/deeper 2>/dev/null; echo checked >> /app/sub/answer.txt && [ "$(id -u)" = 1000 ] '
        '&& [ "$(head -n1 /app/sub/answer.txt)" = 42 ] && echo 1 > /logs/verifier/reward.txt '
        '|| echo 0 > /logs/verifier/reward.txt\n'))
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run",
                         shell_preset("mkdir sub && echo 42 > sub/answer.txt"), owner="forge-owned")
    assert (run.status, run.reward) == ("completed", 1.0), run.ref
