#!/bin/bash
# Reference solution: sort the data rows by (numeric age, name).
set -euo pipefail
python3 - <<'PY'
import csv

with open("/app/people.csv", newline="") as f:
    header, *rows = csv.reader(f)
rows.sort(key=lambda r: (int(r[1]), r[0]))
with open("/app/sorted.csv", "w", newline="") as f:
    w = csv.writer(f, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
PY
