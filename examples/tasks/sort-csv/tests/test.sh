#!/bin/bash
# Verifier for sort-csv. Reward (see test_sorted.py):
#   1.0 exact (parsed as CSV), 0.5 right header and rows in the wrong order,
#   0.25 right header only, 0 otherwise.
# A missing or garbage /app/sorted.csv, a crash or a timeout gives 0; this
# script always writes a reward and exits 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
out=$(timeout 30 python3 /tests/test_sorted.py 2>/logs/verifier/test-output.txt | tail -n 1)
if [[ "$out" =~ ^(0(\.[0-9]+)?|1(\.0+)?)$ ]]; then
    echo "$out" > /logs/verifier/reward.txt
fi
exit 0
