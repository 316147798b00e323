"""Test harness: behaves as its task prompt says (mode:normal | mode:sleep | mode:crash)."""

import os
import sys
import time

mode = os.environ["GYRE_TASK"].split("mode:")[1].split()[0]
if mode == "crash":
    sys.exit(3)  # dies before any model call
from openai import OpenAI  # noqa: E402

with OpenAI(max_retries=1) as client:
    r = client.chat.completions.create(model="m", max_tokens=8,
                                       messages=[{"role": "user", "content": os.environ["GYRE_TASK"]}])
open("answer.txt", "w").write(r.choices[0].message.content or "")
if mode == "sleep":
    time.sleep(600)  # work is done and preserved; the deadline stops us
