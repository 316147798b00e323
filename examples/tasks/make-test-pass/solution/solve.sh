#!/bin/bash
# Reference solution: strip accents, lowercase, and join the runs of ASCII
# letters and digits with single hyphens.
set -euo pipefail
cat > /app/textutil.py <<'PY'
"""Text helpers."""
import re
import unicodedata


def slugify(s):
    """Turn s into a URL slug, e.g. "Hello, World!" -> "hello-world"."""
    s = unicodedata.normalize("NFKD", s).encode("ascii", "ignore").decode("ascii")
    return "-".join(re.findall(r"[a-z0-9]+", s.lower()))
PY
