"""A SWE-bench-style row in a container: the image from its dockerfile, the agent's fix, the
row's test_cmd scored by FAIL_TO_PASS / PASS_TO_PASS, all-or-nothing or the fraction."""

from __future__ import annotations

import json
import textwrap

from gyre.coordinator.taskformats import load_swe_tasks
from tests.sandbox.conftest import run_task, shell_preset

CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a + b\n"
TESTS = textwrap.dedent('''\
    import unittest
    from calc import add, mul, sub

    class T(unittest.TestCase):
        def test_add(self):
            self.assertEqual(add(2, 3), 5)

        def test_sub(self):
            self.assertEqual(sub(5, 3), 2)

        def test_mul(self):
            self.assertEqual(mul(2, 3), 6)
''')
FIX_ADD = "sed -i '2s/a - b/a + b/' calc.py\n"  # half the fix: add, not mul


def _row(tmp_path) -> dict:
    env = tmp_path / "env"
    env.mkdir()
    (env / "calc.py").write_text(CALC)
    (env / "test_calc.py").write_text(TESTS)
    (env / "Dockerfile").write_text("FROM localhost/gyre-base:bookworm\nWORKDIR /repo\nCOPY . /repo\n")
    return {"instance_id": "calc__calc-1", "problem_statement": "add and mul are wrong; fix them.",
            "dockerfile": "env/Dockerfile", "test_cmd": "python3 -m unittest -v test_calc",
            "FAIL_TO_PASS": ["test_add (test_calc.T.test_add)", "test_mul (test_calc.T.test_mul)"],
            "PASS_TO_PASS": ["test_sub (test_calc.T.test_sub)"]}


async def test_a_swe_row_scored_all_or_fraction(podman, scripted_proxy, tmp_path):
    (tmp_path / "rows.jsonl").write_text(json.dumps(_row(tmp_path)) + "\n")
    (task,) = load_swe_tasks(tmp_path / "rows.jsonl")
    assert task.id == "calc__calc-1"
    run = await run_task(scripted_proxy, podman, task, tmp_path / "a", shell_preset(FIX_ADD))
    assert run.status == "completed" and run.reward == 0.0, run.ref  # one FAIL_TO_PASS still fails
    assert run.ref == "FAIL_TO_PASS 1/2, PASS_TO_PASS 1/1"
    run = await run_task(scripted_proxy, podman, task, tmp_path / "b", shell_preset(FIX_ADD), swe_score="fraction",
                         run_id="e2")
    assert run.status == "completed" and run.reward == 0.5, run.ref
    fix_all = FIX_ADD + "sed -i '10s/a + b/a * b/' calc.py\n"
    run = await run_task(scripted_proxy, podman, task, tmp_path / "c", shell_preset(fix_all), run_id="e3")
    assert run.reward == 1.0 and run.ref == "FAIL_TO_PASS 2/2, PASS_TO_PASS 1/1"
    # The agent's changes, copied out for the run directory.
    assert "a * b" in (tmp_path / "c" / "executions" / "e3" / "workspace" / "calc.py").read_text()
