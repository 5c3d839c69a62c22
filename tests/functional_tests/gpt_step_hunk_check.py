"""Runs the series' ``gpt_step`` bug-fix tests with pytest in the scratch interpreter (test-only).

    python gpt_step_hunk_check.py TREE TEST_FILE...

Run by ``test_gpt_step_hunk.py`` through ``stock_bridge.run``, so ``megatron.bridge`` is the one in TREE (stock 0.6.2,
or 0.6.2 with some of the series' patches committed). Prints one JSON line: test id -> passed / failed / skipped.
"""

import json
import sys
from pathlib import Path

import pytest


class Outcomes:
    def __init__(self):
        self.found = {}

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or report.outcome != "passed":
            path, _, test = report.location  # the file relative to the rootdir: the tree's, or one outside it
            self.found[f"{Path(path).name}::{test}"] = report.outcome


def main(files: list[str]) -> None:
    outcomes = Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", "--noconftest", *files], plugins=[outcomes])
    print("RESULT " + json.dumps(outcomes.found))


if __name__ == "__main__":
    main(sys.argv[2:])
