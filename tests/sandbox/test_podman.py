"""Executions in real podman containers: the lifecycle, the deadline inside, the tests kept
from the agent, resource limits, the proxy-only network, infrastructure failures."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import socket
import textwrap

import pytest

from gyre.coordinator.sandbox import Limits, SandboxSpec, reaper
from gyre.coordinator.sandbox.base import LABEL_EXECUTION, LABEL_OWNER
from gyre.coordinator.taskformats import load_harbor_task
from tests.sandbox.conftest import CALL_PROXY, containers, harbor_task, run_task, shell_preset

# Inside the container: the agent's view while it works, then a long sleep the deadline must end.
AGENT = CALL_PROXY + textwrap.dedent('''\
    if [ -e /tests ]; then echo yes > seen-tests; else echo no > seen-tests; fi
    pwd > where; ls > listing
    echo 42 > answer.txt
    sleep 600
''')
# The verifier: full marks for an answer written by an agent that never saw the tests.
SCORE = textwrap.dedent('''\
    if [ "$(cat /app/answer.txt)" = 42 ] && [ "$(cat /app/seen-tests)" = no ]; then echo 1 > /logs/verifier/reward.txt
    else echo 0.25 > /logs/verifier/reward.txt; fi
''')


async def test_a_whole_execution_in_a_container(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "lifecycle", harness_files={"given.txt": "from the image\n"}, test_sh=SCORE,
                         toml="[agent]\ntimeout_sec = 4\n")
    task = load_harbor_task(folder)
    run = await run_task(scripted_proxy, podman, task, tmp_path / "run", shell_preset(AGENT), owner="own1")
    # The deadline ended the harness inside; its work was scored where it left it.
    assert run.status == "timed_out" and run.reward == 1.0 and run.valid, (run.status, run.ref)
    assert len(run.recorder.calls) == 1 and run.recorder.calls[0]["status"] == "ok"
    work = tmp_path / "run" / "executions" / "e1" / "workspace"
    assert (work / "where").read_text().strip() == "/app"  # the image's WORKDIR
    assert "given.txt" in (work / "listing").read_text().split()  # the image's files, not hidden by a mount
    assert (work / "answer.txt").read_text() == "42\n"
    assert "deadline of 4s" in (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
    assert containers(podman, **{LABEL_OWNER: "own1"}) == []  # removed afterwards


async def test_the_deadline_is_kept_inside_when_the_client_goes(podman, tmp_path):
    from gyre.coordinator.sandbox import images

    box = await podman.create(SandboxSpec(execution="x", labels={LABEL_EXECUTION: "x"}, image=images.BASE_IMAGE,
                                          limits=Limits(pids=64)))
    try:
        r = await box.exec(["sh", "-c", "sleep 300"], timeout_s=1.0, grace_s=1.0)
        assert r.timed_out and r.code == 124
        job = asyncio.create_task(box.exec(["sh", "-c", "echo started; sleep 301"], timeout_s=600))
        probe = ["sh", "-c", "cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '"]
        for _ in range(200):  # until the command runs inside
            if b"sleep 301" in (await box.exec(probe, timeout_s=10)).output:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the command never started")
        job.cancel()  # the host-side client goes away
        await asyncio.gather(job, return_exceptions=True)
        left = (await box.exec(probe, timeout_s=10)).output
        assert b"sleep 300" not in left and b"sleep 301" not in left
    finally:
        await box.stop()
    assert containers(podman, **{LABEL_EXECUTION: "x"}) == []


async def test_a_memory_hog_is_killed_and_scored_on_its_work(podman_ready, scripted_proxy, tmp_path, monkeypatch):
    from gyre.coordinator.sandbox.podman import PodmanBackend

    monkeypatch.chdir(tmp_path)  # the OOM kill must leave nothing in the coordinator's working directory
    hog = CALL_PROXY + "echo partial > answer.txt\npython3 -c 'x = bytearray(1 << 30); print(len(x))'\n"
    folder = harbor_task(tmp_path, "hog", toml='[environment]\nmemory = "64M"\n', test_sh=(
        '[ -f /app/answer.txt ] && echo 0.5 > /logs/verifier/reward.txt || echo 0 > /logs/verifier/reward.txt'))
    backend = PodmanBackend()  # started here, in this working directory
    await backend.open()
    try:
        run = await run_task(scripted_proxy, backend, load_harbor_task(folder), tmp_path / "run", shell_preset(hog))
    finally:
        await backend.close()
    assert run.status == "harness_error" and run.reward == 0.5 and run.valid, (run.status, run.ref)
    # killed, not refused
    assert "MemoryError" not in (tmp_path / "run" / "executions" / "e1" / "harness.log").read_text()
    assert not (tmp_path / "oom").exists()  # conmon's OOM marker stays in the podman service's own folder


PROBE = textwrap.dedent('''\
    import json, os, socket, sys, urllib.request
    out = {}
    req = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/models",
                                 headers={"Authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
    try:
        out["proxy"] = urllib.request.urlopen(req, timeout=20).status
    except Exception as e:
        out["proxy"] = repr(e)
    def connect(host, port):
        try:
            socket.create_connection((host, port), timeout=3).close()
            return "connected"
        except OSError as e:
            return type(e).__name__
    out["host_port"] = connect("127.0.0.1", int(sys.argv[1]))
    out["host_address"] = connect(sys.argv[2], int(sys.argv[1]))
    out["other_address"] = connect("1.1.1.1", 443)
    try:
        socket.getaddrinfo("example.com", 443)
        out["dns"] = "resolved"
    except OSError as e:
        out["dns"] = type(e).__name__
    json.dump(out, open("probe.json", "w"))
''')


def _host_address() -> str:
    """This machine's own address on its default route (not loopback)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


async def test_the_network_reaches_the_proxy_and_nothing_else(podman, scripted_proxy, tmp_path):
    other = await asyncio.start_server(lambda r, w: w.close(), "0.0.0.0", 0)  # another service on the host
    port = other.sockets[0].getsockname()[1]
    addr = _host_address()
    probe_host = socket.create_connection((addr, port), timeout=3)  # reachable from the host itself
    probe_host.close()
    try:
        folder = harbor_task(tmp_path, "net", harness_files={"probe.py": PROBE})
        run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run",
                             shell_preset(f"python3 probe.py {port} {addr}"))
    finally:
        other.close()
    assert run.status == "completed", run.ref
    seen = json.loads((tmp_path / "run" / "executions" / "e1" / "workspace" / "probe.json").read_text())
    assert seen["proxy"] == 200, seen
    assert seen["host_port"] == "ConnectionRefusedError", seen  # the container's own loopback
    assert seen["host_address"] != "connected" and seen["other_address"] != "connected", seen
    assert seen["dns"] == "gaierror", seen


async def test_the_tests_reach_the_container_only_after_the_agent(podman, scripted_proxy, tmp_path):
    looker = "ls /tests > saw 2>&1; cat /tests/test.sh >> saw 2>&1; true\n"
    folder = harbor_task(tmp_path, "peek", test_sh="echo 1 > /logs/verifier/reward.txt  # secret-marker")
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset(looker))
    saw = (tmp_path / "run" / "executions" / "e1" / "workspace" / "saw").read_text()
    assert "secret-marker" not in saw and "No such file" in saw
    assert run.status == "completed" and run.reward == 1.0  # and then they ran, in the same container


async def test_an_evaluator_that_fails_is_evaluator_error_never_zero(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "broken-tests", test_sh="exit 3\n")  # writes no reward
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset("true"))
    assert run.status == "evaluator_error" and run.reward is None and not run.valid, (run.status, run.reward)


async def test_a_non_binary_reward_json(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "json",
                         test_sh="echo '{\"reward\": 0.625, \"passed\": 5}' > /logs/verifier/reward.json\n")
    run = await run_task(scripted_proxy, podman, load_harbor_task(folder), tmp_path / "run", shell_preset("true"))
    assert run.status == "completed" and run.reward == 0.625, run.ref


async def test_an_image_that_fails_to_build_is_aborted_infra(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "nobuild", dockerfile="FROM localhost/gyre-base:bookworm\nRUN exit 7\n")
    task = load_harbor_task(folder)
    run = await run_task(scripted_proxy, podman, task, tmp_path / "a", shell_preset("true"))
    assert run.status == "aborted_infra" and run.reward is None and not run.valid
    assert "build" in run.ref and run.recorder.calls == []
    run = await run_task(scripted_proxy, podman, task, tmp_path / "b", shell_preset("true"), run_id="e2",
                         infra_failure="placeholder")
    assert run.status == "placeholder" and run.reward == 0.0 and run.valid  # the paper's rule, when asked


async def test_an_image_that_cannot_be_pulled_is_aborted_infra(podman, scripted_proxy, tmp_path):
    folder = harbor_task(tmp_path, "nopull", toml='[environment]\ndocker_image = "localhost/gyre-absent:1"\n')
    (folder / "environment" / "Dockerfile").unlink()
    task = load_harbor_task(folder)
    run = await run_task(scripted_proxy, podman, task, tmp_path / "a", shell_preset("true"))
    assert run.status == "aborted_infra" and run.reward is None and not run.valid
    assert "gyre-absent" in run.ref
    run = await run_task(scripted_proxy, podman, task, tmp_path / "b", shell_preset("true"), run_id="e2",
                         infra_failure="placeholder")
    assert run.status == "placeholder" and run.reward == 0.0 and run.valid


# docker-py's unix-socket connection leaves its socket to the garbage collector when the
# connect is refused, which is what this test provokes: that warning is the library's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
async def test_a_sandbox_host_that_dies_is_aborted_infra(podman_ready, scripted_proxy, tmp_path):
    from gyre.coordinator.launcher import open_sandboxes
    from gyre.coordinator.sandbox.podman import PodmanBackend

    task = load_harbor_task(harbor_task(tmp_path, "dies"))
    dying = PodmanBackend()  # its own service, to kill
    await dying.open()
    try:
        job = asyncio.create_task(run_task(scripted_proxy, dying, task, tmp_path / "run",
                                           shell_preset(CALL_PROXY + "sleep 600"), owner="dying"))
        for _ in range(600):  # until the harness has made its call
            if "e1" in scripted_proxy.executions and scripted_proxy.executions["e1"].calls:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the harness never called")
        dying._proc.kill()  # the engine's service goes away mid-harness
        run = await asyncio.wait_for(job, 120)
    finally:
        await dying.close()
    assert run.status == "aborted_infra" and run.reward is None and not run.valid, (run.status, run.ref)
    assert len(run.recorder.calls) == 1  # recorded, and never trained: the execution is invalid
    del job, dying
    gc.collect()  # docker-py's refused sockets go now, under this test's filter
    # Its container outlived the service. Its maker (this process) still runs, so another start
    # leaves it alone; the maker's own shutdown reap removes it.
    sandboxes = await open_sandboxes(sandbox="podman", run_dir=tmp_path / "next")
    try:
        assert len(containers(sandboxes.backend, **{LABEL_OWNER: "dying"})) == 1
        assert await reaper.reap(sandboxes.backend, reaper.at_shutdown("dying"), "at shutdown") == 1
        assert containers(sandboxes.backend, **{LABEL_OWNER: "dying"}) == []
    finally:
        await sandboxes.close()


async def test_more_execs_than_the_default_executor_run_at_once(podman, tmp_path):
    """Each exec waits until all of them have started: it passes only if they all stream at once
    (the loop's default executor has min(32, cpus + 4) threads; a long exec must not hold one)."""
    from gyre.coordinator.sandbox import images

    n = (os.cpu_count() or 1) + 6
    box = await podman.create(SandboxSpec(execution="many", labels={LABEL_EXECUTION: "many"},
                                          image=images.BASE_IMAGE, limits=Limits(pids=256)))
    wait_all = f'touch /tmp/s-$0; while [ "$(ls /tmp/s-* | wc -l)" -lt {n} ]; do sleep 0.05; done; echo all'
    try:
        results = await asyncio.wait_for(asyncio.gather(*(
            box.exec(["sh", "-c", wait_all, str(i)], timeout_s=120) for i in range(n))), 150)
    finally:
        await box.stop()
    assert [r.code for r in results] == [0] * n and all(r.output.strip() == b"all" for r in results)
