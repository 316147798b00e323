"""The real Claude Code binary inside a podman container: mounted read-only, reaching the
proxy through the container's own listener (no other network), working in the task image's
/app, and scored by the task's tests afterwards."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gyre.coordinator.serve import run_harness_once
from gyre.coordinator.taskformats import load_harbor_task
from tests.harness.test_claude_code import preset, tool_results
from tests.harness.test_example_harnesses import example, on_path
from tests.sandbox.conftest import harbor_task, podman_ready  # noqa: F401  (the fixture)
from tests.scripted import tool_call

pytestmark = [pytest.mark.sandbox, pytest.mark.timeout(300)]

SCORE = ('[ "$(cat /app/counter.txt)" = 2 ] && echo 1 > /logs/verifier/reward.txt '
         '|| echo 0 > /logs/verifier/reward.txt\n')


async def test_claude_code_works_a_task_inside_a_container(cc_proxy, claude_bin, podman_ready, tmp_path,
                                                           monkeypatch):
    """examples/harnesses/claude-code.toml as a user runs it: `claude` on PATH as npm leaves it."""
    server, engine = cc_proxy
    on_path(monkeypatch, tmp_path, claude_bin, "claude")
    preset = example("claude-code")
    assert preset.missing(contained=True) is None
    folder = harbor_task(tmp_path, "counter", harness_files={"counter.txt": "1\n"}, test_sh=SCORE)
    task = load_harbor_task(folder)

    def script(prompt: str) -> str:
        return [tool_call("Bash", command="pwd; cat counter.txt; echo 2 > counter.txt", description="bump"),
                "Done: counter.txt holds 2."][min(tool_results(prompt), 1)]

    engine.script = script
    summary = await run_harness_once(server, preset, "", run_dir=server.run_dir, execution="cc",
                                     task=task, sandbox="podman")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed" and summary["score"] == 1.0, (summary, log[-3000:])
    assert json.loads(log.strip().splitlines()[-1])["result"] == "Done: counter.txt holds 2."
    ex = server.executions["cc"]
    assert len(ex.calls) >= 2 and {c["status"] for c in ex.calls} == {"ok"}
    # The Bash tool ran in the image's /app, on the image's file; the work was copied out.
    second = server.tokenizer.decode(engine.prompts[-1])
    assert "/app" in second and "1" in second
    assert (server.run_dir / "executions" / "cc" / "workspace" / "counter.txt").read_text() == "2\n"


async def test_claude_code_solves_a_shipped_example_in_its_container(cc_proxy, claude_bin, podman_ready):
    """examples/tasks/sort-csv as shipped: its image, its instruction as Claude Code's prompt, a
    policy that answers with one Bash call (sort the rows by age, then name), its own verifier."""
    from tests.sandbox.conftest import REPO

    server, engine = cc_proxy
    task = load_harbor_task(REPO / "examples" / "tasks" / "sort-csv")
    sort = ("python3 -c \"import csv; h, *r = list(csv.reader(open('people.csv'))); "
            "r.sort(key=lambda x: (int(x[1]), x[0])); "
            "csv.writer(open('sorted.csv', 'w'), lineterminator=chr(10)).writerows([h, *r])\"")

    def script(prompt: str) -> str:
        return [tool_call("Bash", command=sort, description="sort the csv"),
                "Done: /app/sorted.csv is sorted by age, then name."][min(tool_results(prompt), 1)]

    engine.script = script
    summary = await run_harness_once(server, preset(claude_bin), "", run_dir=server.run_dir, execution="cc",
                                     task=task, sandbox="podman")
    log = Path(summary["harness_log"]).read_text()
    assert summary["status"] == "completed" and summary["score"] == 1.0, (summary, log[-3000:])
    first = server.tokenizer.decode(engine.prompts[0])
    assert "/app/people.csv" in first and "sorted by `age`" in first  # the task's instruction reached it
    assert (server.run_dir / "executions" / "cc" / "workspace" / "sorted.csv").is_file()
