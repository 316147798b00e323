"""On the process backend a sibling cannot act as another execution (issue 36, finding 9).

Every process-backend harness runs as the coordinator's user, so one can read another's
environment (/proc/PID/environ) and with it its key: before, 32 of 32 executions wrote into a
sibling's record that way. Two executions run at once through the launcher's whole lifecycle on
the real process backend: the sibling reads the victim's key from the victim's environment and
calls the proxy with it. The proxy now serves a key only to the sessions its sandbox started
(proxy/binding.py): the sibling is refused 401, the victim's record holds only its own calls,
the victim's own child processes are served, and one of them that left the session is not.
"""

from __future__ import annotations

import asyncio
import json
import textwrap

import pytest

from gyre.coordinator.sandbox.process import ProcessBackend
from gyre.coordinator.tasks import Task
from tests.sandbox.conftest import run_task, scripted_proxy, shell_preset

__all__ = ["scripted_proxy"]  # a fixture, used by name

# One model call with the given key, from a child process (stdlib only): prints the status.
CALL = textwrap.dedent('''\
    import json, os, sys, urllib.error, urllib.request
    key, text = sys.argv[1], sys.argv[2]
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions",
        data=json.dumps({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": text}]}).encode(),
        headers={"Authorization": "Bearer " + key, "Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=60).read()
        print(200)
    except urllib.error.HTTPError as e:
        print(e.code, json.load(e)["error"]["message"])
''')

# The victim: its pid where the sibling finds it, one call of its own (a child process in its
# session), one from a process that left the session (setsid), then waits for the sibling.
VICTIM = textwrap.dedent('''\
    echo $$ > {shared}/victim.pid
    python3 {shared}/call.py "$OPENAI_API_KEY" "the victim's own call" > {shared}/victim-own
    setsid python3 {shared}/call.py "$OPENAI_API_KEY" "from a process that left the session" > {shared}/victim-setsid
    for i in $(seq 600); do [ -e {shared}/sibling-done ] && exit 0; sleep 0.1; done
    exit 1
''')

# The sibling: the victim's key out of the victim's environment, then a call with it.
SIBLING = textwrap.dedent('''\
    for i in $(seq 600); do [ -s {shared}/victim.pid ] && break; sleep 0.1; done
    key=$(tr '\\0' '\\n' < /proc/$(cat {shared}/victim.pid)/environ | sed -n 's/^OPENAI_API_KEY=//p')
    echo "$key" > {shared}/stolen
    python3 {shared}/call.py "$key" "FORGED by the sibling" > {shared}/sibling-call
    touch {shared}/sibling-done
''')


@pytest.mark.asyncio
async def test_a_sibling_with_anothers_key_is_refused_and_writes_nothing_into_its_record(scripted_proxy, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "call.py").write_text(CALL)
    backend = ProcessBackend()
    run_dir = tmp_path / "run"
    victim, sibling = await asyncio.gather(
        run_task(scripted_proxy, backend, Task(id="t", prompt="work", target="Done."), run_dir,
                 shell_preset(VICTIM.format(shared=shared)), run_id="victim"),
        run_task(scripted_proxy, backend, Task(id="t", prompt="work", target="Done."), run_dir,
                 shell_preset(SIBLING.format(shared=shared)), run_id="sibling"))
    stolen = (shared / "stolen").read_text().strip()
    assert stolen == victim.recorder.key  # the environment was readable: the key was had
    status, _, message = (shared / "sibling-call").read_text().strip().partition(" ")
    assert status == "401" and "another execution's processes" in message, message
    assert (shared / "victim-own").read_text().strip() == "200"  # its own child, in its session
    assert (shared / "victim-setsid").read_text().startswith("401")  # a process that left its session
    calls = [json.loads(line) for line in (run_dir / "executions" / "victim" / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1, calls  # the victim's own call, and nothing the sibling sent
    assert victim.status == sibling.status == "completed", (victim.status, victim.ref, sibling.status, sibling.ref)
    assert not scripted_proxy.bindings.bound("victim")  # revoked with the key


@pytest.mark.asyncio
async def test_a_call_before_the_harness_session_is_told_waits_for_it_then_is_checked(tmp_path):
    """The proxy can hear a call before the launcher is told the session: it waits for it."""
    from gyre.proxy.binding import Bindings

    class Transport:  # a connection from port 1 to port 2 that no process holds
        def get_extra_info(self, name):
            return {"peername": ("127.0.0.1", 1), "sockname": ("127.0.0.1", 2)}[name]

    bindings = Bindings()
    bindings.bind("e")
    pending = asyncio.ensure_future(bindings.refusal("e", Transport()))
    await asyncio.sleep(0)
    assert not pending.done()
    bindings.add("e", 999_999_999)  # no process has this session
    assert await asyncio.wait_for(pending, 10) == "this key belongs to another execution's processes"
    assert await bindings.refusal("unbound", None) is None
