#!/bin/bash
# Verifier for fix-off-by-one.
# Reward = fraction of the moving_sum cases in test_stats.py that pass.
# A missing or broken /app/stats.py, a crash or a timeout gives 0; this script
# always writes a reward and exits 0.
mkdir -p /logs/verifier
echo 0 > /logs/verifier/reward.txt
out=$(timeout 30 python3 /tests/test_stats.py 2>/logs/verifier/test-output.txt | tail -n 1)
if [[ "$out" =~ ^(0(\.[0-9]+)?|1(\.0+)?)$ ]]; then
    echo "$out" > /logs/verifier/reward.txt
fi
exit 0
