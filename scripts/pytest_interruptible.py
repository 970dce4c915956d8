"""pytest that stops cleanly on SIGINT even when it was started with SIGINT ignored (as a background
job of a non-interactive shell is): scripts/gpu_round.sh sends SIGINT before a stage's cap so that
a cut run still writes its JUnit report. Each failure's traceback is printed as it comes (xdist's
controller gets the reports as workers finish them), so a run killed before its summary still
shows why its tests failed. Arguments are pytest's."""
import signal
import sys

import pytest

LIMIT = 4000  # characters of one failure's report


class PrintFailures:
    @pytest.hookimpl
    def pytest_runtest_logreport(self, report):
        if report.failed:
            text = report.longreprtext
            cut = f"({len(text) - LIMIT} characters before these left out)\n" if len(text) > LIMIT else ""
            print(f"\n=== FAILED {report.nodeid} ({report.when})\n{cut}{text[-LIMIT:]}\n===", flush=True)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(pytest.main(plugins=[PrintFailures()]))
