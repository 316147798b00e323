"""Test evaluator: `ok` scores; `flaky` fails twice per workspace, then scores; `broken` always fails.

The score is the answer's CRC-32 spread over [0, 1]: different answers (the tiny model's
sampled 8 tokens) score apart, so a group has advantages to train on (a group whose scores
are all alike trains nothing, and its step applies no update: coordinator/diagnosis.py)."""

import json
import os
import sys
import zlib
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
print(json.dumps({"score": zlib.crc32(answer.encode()) % 1001 / 1000, "ref": f"{len(answer)} chars"}))
