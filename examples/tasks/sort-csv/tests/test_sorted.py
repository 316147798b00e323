"""Scores /app/sorted.csv against expected.csv; prints the reward.

Both files are parsed with the csv module, so line endings and quoting
do not matter.
  1.0   header and all rows, in the right order
  0.5   header right, same rows (as a multiset), wrong order
  0.25  header right, rows wrong
  0     file missing, unreadable or header wrong
"""
import csv
import sys
from collections import Counter


def read(path):
    with open(path, newline="", encoding="utf-8") as f:
        return [row for row in csv.reader(f)]


def score():
    want = read("/tests/expected.csv")
    try:
        got = read("/app/sorted.csv")
    except Exception as e:
        print(f"cannot read /app/sorted.csv: {e!r}", file=sys.stderr)
        return 0
    got = [row for row in got if row]  # ignore blank lines
    if not got or got[0] != want[0]:
        print(f"header is {got[:1]!r}, want {want[0]!r}", file=sys.stderr)
        return 0
    if got == want:
        return 1
    if Counter(map(tuple, got[1:])) == Counter(map(tuple, want[1:])):
        print("rows right but in the wrong order", file=sys.stderr)
        return 0.5
    print("header right, rows differ", file=sys.stderr)
    return 0.25


print(score())
