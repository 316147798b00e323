"""scripted.py: the task source the coordinator's end-to-end tests run on: `_harness.py`
(answers as its prompt's mode says) scored by `_evaluator.py` (its verdict argument)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent
HARNESS = (sys.executable, str(HERE / "_harness.py"))
EVAL = [sys.executable, str(HERE / "_evaluator.py")]


def write_tasks(path: Path, n: int) -> Path:
    """`n` tasks t0..t{n-1}, each a normal run the evaluator scores ok, as JSONL at `path`."""
    path.write_text("\n".join(json.dumps({"id": f"t{i}", "prompt": f"mode:normal task {i}",
                                          "evaluator": {"type": "command", "argv": EVAL + ["ok"]}})
                              for i in range(n)))
    return path
