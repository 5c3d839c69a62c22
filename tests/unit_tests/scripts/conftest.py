"""The harness lives in scripts/performance as plain scripts; make its modules importable."""

import sys
from pathlib import Path

PERF = Path(__file__).resolve().parents[3] / "scripts" / "performance"
if str(PERF) not in sys.path:
    sys.path.insert(0, str(PERF))
