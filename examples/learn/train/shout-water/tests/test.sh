#!/bin/bash
# shout: 1.0 the word in capitals and nothing else, 0.5 inside a longer reply, 0.25 in any case, else 0.
mkdir -p /logs/verifier
python3 - "$1" > /logs/verifier/reward.txt <<'PY'
import pathlib, re
want = "WATER"
try:
    got = pathlib.Path("/app/answer.txt").read_text(errors="replace")
except OSError:
    got = ""
words = re.findall(r"[A-Za-z]+", got)
if words == [want]:
    print(1.0)
elif want in words:
    print(0.5)
elif want.lower() in (w.lower() for w in words):
    print(0.25)
else:
    print(0.0)
PY
exit 0
