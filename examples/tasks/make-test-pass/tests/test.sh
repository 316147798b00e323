#!/bin/bash
# Verifier for make-test-pass.
# Reward = fraction of the tests in this folder's test_textutil.py (the same
# tests the agent was given in /app, so editing /app's copy does not help)
# that pass against /app/textutil.py.
# A missing or broken /app/textutil.py, a crash or a timeout gives 0; this
# script always writes a reward and exits 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
out=$(timeout 30 python3 /tests/run_tests.py 2>/logs/verifier/test-output.txt | tail -n 1)
if [[ "$out" =~ ^(0(\.[0-9]+)?|1(\.0+)?)$ ]]; then
    echo "$out" > /logs/verifier/reward.txt
fi
exit 0
