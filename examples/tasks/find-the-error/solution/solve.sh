#!/bin/bash
# Reference solution: count the ERROR messages and keep the most frequent one.
set -euo pipefail
grep -o ' ERROR .*' /app/app.log | sed 's/^ ERROR //' | sort | uniq -c | sort -rn | head -n 1 \
  | sed 's/^ *[0-9]* //' > /app/answer.txt
