"""Runs the verifier's own copy of the tests (/tests/test_textutil.py)
against /app/textutil.py and prints the fraction of tests passing."""
import importlib.util
import sys
import unittest

sys.path.insert(0, "/app")  # so `from textutil import slugify` finds the agent's module


def main():
    try:
        spec = importlib.util.spec_from_file_location(
            "verifier_test_textutil", "/tests/test_textutil.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # fails if /app/textutil.py is missing or broken
    except BaseException as e:
        print(f"cannot load tests: {e!r}", file=sys.stderr)
        return 0
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=2).run(suite)
    if result.testsRun == 0:
        return 0
    failed = len(result.failures) + len(result.errors) + len(result.unexpectedSuccesses)
    return (result.testsRun - failed) / result.testsRun


print(f"{main():.4g}")
