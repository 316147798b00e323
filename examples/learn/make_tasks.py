"""make_tasks.py: writes the `shout` task family (Harbor task folders) into train/ and heldout/.

Each task asks the agent to reply with one given word in capital letters, and nothing else,
as its final answer (the demo harness writes it to /app/answer.txt). The verifier gives 1.0 for
exactly the word in capitals, 0.5 for the word in capitals inside a longer reply, 0.25 for the
word in any case, 0 otherwise: easy enough that SmolLM2-135M, inside the demo harness's
coding-agent prompt and tools, sometimes succeeds (held-out pass@1 at reward >= 0.5: 0.125 before
training), with spread inside a group to learn from. (Asking it to capitalise a word itself,
"Write the word 'apple' in capital letters", was too hard: 8 steps moved nothing.) The held-out
words are never trained on. Run: python examples/learn/make_tasks.py (the folders are committed).
"""

from __future__ import annotations

import shutil
from pathlib import Path

HERE = Path(__file__).parent
TRAIN = ["apple", "river", "cloud", "stone", "green", "table", "music", "horse", "light", "bread", "chair", "water",
         "house", "plant", "smile", "dream", "ocean", "train", "paper", "glass", "sugar", "tiger", "money", "night"]
HELDOUT = ["lemon", "candle", "forest", "window", "garden", "pencil", "silver", "rocket", "bottle", "planet",
           "island", "winter"]

TOML = """version = "1.0"

[metadata]
family = "shout"
difficulty = "easy"

[verifier]
timeout_sec = 30.0

[agent]
timeout_sec = 120.0

[environment]
build_timeout_sec = 120.0
cpus = 1
memory_mb = 256
storage_mb = 64
"""
DOCKERFILE = "FROM localhost/gyre-base:bookworm\nWORKDIR /app\n"
INSTRUCTION = "Reply with only the word {upper}, in capital letters, and nothing else.\n"
TEST = r"""#!/bin/bash
# shout: 1.0 the word in capitals and nothing else, 0.5 inside a longer reply, 0.25 in any case, else 0.
mkdir -p /logs/verifier
python3 - "$1" > /logs/verifier/reward.txt <<'PY'
import pathlib, re
want = "{WORD}"
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
"""
SOLVE = "#!/bin/bash\necho {WORD} > /app/answer.txt\n"


def write(folder: Path, words: list[str]) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    for word in words:
        task = folder / f"shout-{word}"
        for sub in ("environment", "tests", "solution"):
            (task / sub).mkdir(parents=True)
        (task / "task.toml").write_text(TOML)
        (task / "instruction.md").write_text(INSTRUCTION.format(upper=word.upper()))
        (task / "environment" / "Dockerfile").write_text(DOCKERFILE)
        (task / "tests" / "test.sh").write_text(TEST.replace("{WORD}", word.upper()))
        (task / "solution" / "solve.sh").write_text(SOLVE.replace("{WORD}", word.upper()))
        for script in (task / "tests" / "test.sh", task / "solution" / "solve.sh"):
            script.chmod(0o755)


if __name__ == "__main__":
    write(HERE / "train", TRAIN)
    write(HERE / "heldout", HELDOUT)
    print(f"{len(TRAIN)} train and {len(HELDOUT)} held-out tasks under {HERE}")
