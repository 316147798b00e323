"""Test evaluator: `ok` scores; `flaky` fails twice per workspace, then scores; `broken` always fails."""

import json
import os
import sys
from pathlib import Path

mode = sys.argv[1]
if mode == "broken":
    sys.exit("evaluator crashed")
if mode == "flaky":
    counter = Path(os.environ["GYRE_WORKSPACE"]) / ".attempts"
    n = int(counter.read_text()) + 1 if counter.exists() else 1
    counter.write_text(str(n))
    if n < 3:
        sys.exit(f"flaky failure {n}")
answer = Path("answer.txt").read_text() if Path("answer.txt").exists() else ""
print(json.dumps({"score": min(1.0, len(answer) / 8), "ref": f"{len(answer)} chars"}))
