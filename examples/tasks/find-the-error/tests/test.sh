#!/bin/bash
# Verifier for find-the-error: 1 for the exact message; a near miss gets partial credit
# (half the similarity of the answer to the message); no answer.txt gives 0. Always
# writes a reward and exits 0.
mkdir -p /logs/verifier
python3 - <<'PY'
import difflib
from pathlib import Path

truth = "database connection refused (db01:5432)"
try:
    answer = Path("/app/answer.txt").read_text(errors="replace").strip()
except OSError:
    answer = None
if answer is None:
    reward = 0.0
elif answer == truth:
    reward = 1.0
else:
    reward = round(0.5 * difflib.SequenceMatcher(None, answer[:2000], truth).ratio(), 4)
Path("/logs/verifier/reward.txt").write_text(f"{reward}\n")
PY
exit 0
