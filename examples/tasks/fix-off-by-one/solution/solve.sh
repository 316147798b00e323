#!/bin/bash
# Reference solution: the loop must visit len(xs) - k + 1 window starts.
set -euo pipefail
sed -i 's/range(len(xs) - k)/range(len(xs) - k + 1)/' /app/stats.py
