"""Checks /app/stats.py's moving_sum; prints the fraction of cases passing."""
import sys

sys.path.insert(0, "/app")

CASES = [
    (([1, 2, 3, 4], 2), [3, 5, 7]),
    (([1, 2, 3, 4, 5], 5), [15]),
    (([5, 6, 7], 1), [5, 6, 7]),
    (([4, -1, 2, 0], 3), [5, 1]),
    (([10], 1), [10]),
    (([1, 2], 3), []),
    (([], 1), []),
    (([0.5, 0.5, 1.0], 2), [1.0, 1.5]),
]


def main():
    try:
        from stats import moving_sum
    except BaseException as e:  # missing file, syntax error, ...
        print(f"import failed: {e!r}", file=sys.stderr)
        print(0)
        return
    passed = 0
    for (xs, k), want in CASES:
        try:
            got = moving_sum(list(xs), k)
            ok = got == want
        except BaseException as e:
            got, ok = repr(e), False
        passed += ok
        print(f"{'PASS' if ok else 'FAIL'} moving_sum({xs}, {k}) = {got!r}, want {want!r}",
              file=sys.stderr)
    print(f"{passed / len(CASES):.4g}")


main()
