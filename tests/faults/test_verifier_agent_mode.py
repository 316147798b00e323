"""`[verifier] environment = "agent"`: scoring system state outside the workdir (issue 36, finding 2).

A task that checks what the agent changed outside its workdir (a file in /etc) declares it;
its tests then run in a copy of the agent's stopped container under the host's static busybox,
and the container's diff is recorded. The default ("fresh") scores a new container from the
image, where that file is not. In the copy, the agent's replaced `sleep`, `sh`, `bash`,
`timeout` and preload list do not run: the container's command and the tests' shell are the
trusted busybox. Real podman containers.
"""

from __future__ import annotations

import json

import pytest

from gyre.coordinator.sandbox.base import LABEL_OWNER
from gyre.coordinator.taskformats import load_harbor_task
from gyre.coordinator.tasks import TaskError
from tests.faults.test_verifier_forgery import CLAIM, _preload_library
from tests.sandbox.conftest import containers, harbor_task, podman, podman_ready, run_task, scripted_proxy, shell_preset

__all__ = ["podman", "podman_ready", "scripted_proxy"]  # fixtures, used by name

AGENT_MODE = '[verifier]\nenvironment = "agent"\n'
# Passes only where the agent's /etc/agent-made.conf is (a busybox applet checks it).
CHECK_ETC = ('if grep -q "^listen 8080$" /etc/agent-made.conf; then echo 1 > /logs/verifier/reward.txt; '
             'else echo 0 > /logs/verifier/reward.txt; fi\n')


@pytest.fixture
def busybox():
    """The host's static busybox, or a skip saying how to install it (.ci/run does)."""
    from gyre.coordinator.evaluator import EvaluatorError
    from gyre.coordinator.verifier import trusted_busybox

    try:
        return trusted_busybox()
    except EvaluatorError as e:
        pytest.skip(str(e))


async def _score(podman, proxy, root, name: str, toml: str, test_sh: str, plant: str, **task_kw):
    folder = harbor_task(root, name, toml=toml, test_sh=test_sh, **task_kw)
    run = await run_task(proxy, podman, load_harbor_task(folder), root / f"run-{name}", shell_preset(plant),
                         owner=f"agentmode-{name}", run_id=name)
    assert containers(podman, **{LABEL_OWNER: f"agentmode-{name}"}) == []  # the agent's and the verifier's, gone
    return run, root / f"run-{name}" / "executions" / name


@pytest.mark.sandbox
async def test_agent_mode_scores_state_outside_the_workdir(podman, busybox, scripted_proxy, tmp_path):
    plant = "echo 'listen 8080' > /etc/agent-made.conf"
    run, folder = await _score(podman, scripted_proxy, tmp_path, "agent", AGENT_MODE, CHECK_ETC, plant)
    assert (run.status, run.reward, run.valid) == ("completed", 1.0, True), run.ref
    diff = json.loads((folder / "agent-diff.json").read_text())
    assert {"path": "/etc/agent-made.conf", "kind": "added"} in diff
    before = {i.id for i in podman.client.images.list(all=True)}
    # The same task verified fresh (the default): the file is not in the image.
    run, folder = await _score(podman, scripted_proxy, tmp_path, "fresh", "", CHECK_ETC, plant)
    assert (run.status, run.reward) == ("completed", 0.0), run.ref
    assert not (folder / "agent-diff.json").exists()
    assert not [i for i in podman.client.images.list(all=True) if i.id not in before
                and any("gyre-verify-" in t for t in i.tags)]  # the temporary image of the copy, removed


# The agent's way back in, had its files run the verification: its `sleep` (the container's
# command) loops the claim, its sh / bash / timeout claim at their exit, its preload library
# claims in every dynamically linked program.
PLANT = f'''set -e
echo 41 > answer.txt
CLAIM='{CLAIM}'
wrap() {{ printf '#!/usr/bin/dash\\n"%s" "$@"; rc=$?\\n%s\\nexit $rc\\n' "$2" "$CLAIM" > "$1"; chmod 755 "$1"; }}
mv /usr/bin/bash /usr/bin/bash.real && wrap /usr/bin/bash /usr/bin/bash.real
mv /usr/bin/timeout /usr/bin/timeout.real && wrap /usr/bin/timeout /usr/bin/timeout.real
mv /usr/bin/sleep /usr/bin/sleep.real
LOOP='touch /sleep-ran; (while :; do '"$CLAIM"'; /usr/bin/sleep.real 0.01; done) &'
printf '#!/usr/bin/dash\\n%s\\nexec /usr/bin/sleep.real "$@"\\n' "$LOOP" > /usr/bin/sleep
chmod 755 /usr/bin/sleep
cp /opt/claim.so /usr/lib/claim.so && echo /usr/lib/claim.so > /etc/ld.so.preload
rm /usr/bin/sh && wrap /usr/bin/sh /usr/bin/dash
'''
# 1.0 for the right answer (42), 0.25 for any other; busybox applets only.
CHECK_ANSWER = ('if grep -qx 42 /app/answer.txt; then echo 1.0 > /logs/verifier/reward.txt; '
                'else echo 0.25 > /logs/verifier/reward.txt; fi\n'
                '[ -e /sleep-ran ] && echo 1.0 > /logs/verifier/reward.txt; true\n')


@pytest.mark.sandbox
async def test_agents_sleep_sh_and_preload_do_not_run_in_agent_mode(podman, busybox, scripted_proxy, tmp_path):
    dockerfile = "FROM localhost/gyre-base:bookworm\nWORKDIR /app\nCOPY claim.so /opt/claim.so\n"
    folder = harbor_task(tmp_path, "forge", toml=AGENT_MODE, test_sh=CHECK_ANSWER, dockerfile=dockerfile)
    _preload_library(folder)
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(PLANT),
                         owner="agentmode-forge")
    log = (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
    assert run.status == "completed", (run.status, run.ref, log[-2000:])  # every plant went in (set -e)
    assert (run.reward, run.valid, run.ref) == (0.25, True, "reward.txt 0.25 (test.sh exit 0)"), run.ref
    diff = {c["path"] for c in json.loads((tmp_path / "run" / "executions" / "e1" / "agent-diff.json").read_text())}
    assert {"/usr/bin/sleep", "/usr/bin/sh", "/etc/ld.so.preload"} <= diff  # what was replaced, on record
    assert containers(podman, **{LABEL_OWNER: "agentmode-forge"}) == []


def test_an_unknown_verifier_environment_is_a_one_line_load_error(tmp_path):
    folder = harbor_task(tmp_path, "bad", toml='[verifier]\nenvironment = "host"\n')
    with pytest.raises(TaskError) as e:
        load_harbor_task(folder)
    assert "\n" not in str(e.value)
    assert "[verifier].environment" in str(e.value) and "'host'" in str(e.value), str(e.value)
    assert load_harbor_task(harbor_task(tmp_path, "default")).verifier.get("environment", "fresh") == "fresh"
    assert load_harbor_task(harbor_task(tmp_path, "agent", toml=AGENT_MODE)).verifier["environment"] == "agent"


def test_an_agent_mode_task_is_refused_at_start_without_a_static_busybox(tmp_path, monkeypatch):
    """Without the trusted shell every score would be an evaluator_error: the run's start
    refuses the task instead, naming the package (a dynamically linked busybox is no better)."""
    from gyre.coordinator.sandbox.preflight import task_refusal

    folder = harbor_task(tmp_path, "agent", toml=AGENT_MODE, test_sh=CHECK_ETC)
    task = load_harbor_task(folder)
    monkeypatch.setenv("GYRE_BUSYBOX", "/bin/sh")  # not statically linked
    why = task_refusal(task, backend="podman", needs_image=True, internet=False)
    assert why is not None and "'agent'" in why and "busybox-static" in why and "\n" not in why, why
    monkeypatch.delenv("GYRE_BUSYBOX")
    fresh = load_harbor_task(harbor_task(tmp_path, "fresh", test_sh=CHECK_ETC))
    assert task_refusal(fresh, backend="podman", needs_image=True, internet=False) is None
