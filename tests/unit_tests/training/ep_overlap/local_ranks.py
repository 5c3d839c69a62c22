"""The launcher the multi-rank tests use: ``run_local_ranks`` forks local ranks, each with its own process group,
and stops a stalled or failed run with what every rank last did; ``init_ep_groups`` makes a rank's EP groups.

In this repository it is the lab's launcher (``ep_overlap_lab.multiprocess``); ``make patch`` ships that module's
source in this file's place, since upstream has no lab (``tools/upstream.py``, ``TEST_SUPPORT``).
"""

from ep_overlap_lab.multiprocess import (
    RankFailure,
    init_ep_groups,
    report_progress,
    run_local_ranks,
    single_process_groups,
)

__all__ = ["RankFailure", "init_ep_groups", "report_progress", "run_local_ranks", "single_process_groups"]
