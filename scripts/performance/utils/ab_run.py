"""The A/B harness's run: recipe, validation, arms, launching, summary. Imported by ``ep_overlap_ab.py`` once the
command line is parsed, so ``--help`` and flag errors never import torch.

Every check runs in the parent before any rank starts: a problem is one line (field, value, fix) and exit
status 2. A run ends when it finishes, fails, is stopped (SIGINT/SIGTERM), or no rank reports a finished step
for the stall timeout; whatever steps finished are kept in the JSON.
"""

import os
import sys

import torch

from ep_overlap_lab.multiprocess import (
    RankFailure,
    launched_by_torchrun,
)
from utils.ab_summary import print_schedules, summarize
from utils.harness_config import ConfigError, checked_run
from utils.launch import Progress, describe, pick_device, run_config, run_local, run_torchrun, specs_for
from utils.netns import LinkUnavailable
from utils.report import draw_timeline, format_table, partial_summary, save_json
from utils.stopping import IGNORED, signal_handlers, stopped_by, stopping_until


def run(args) -> int:
    """The harness after argument parsing: check everything, run, report. Returns the exit status."""
    progress, recipe, partial_to = Progress(), None, None
    # An interrupt once every rank finished every step is dropped: the ranks only have their results to return.
    with signal_handlers(stopping_until(progress.all_done)):
        try:
            torchrun = launched_by_torchrun()
            world = int(os.environ["WORLD_SIZE"]) if torchrun else args.nproc_per_node
            gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
            recipe, arms = checked_run(args, world, torchrun, gpus)
            device = pick_device(args)
            if args.print_schedule:
                schedule = args.pipeline_schedule if args.model_impl == "mcore" else None
                print_schedules(recipe.model, recipe.train.num_microbatches, arms[-1]["options"], schedule)
            if args.dryrun:
                print(describe(recipe, arms, args, device, world))
                return 0
            partial_to = run_config(recipe, args, device, world)
            specs = specs_for(arms, recipe, device, args.model_impl, args.profile, args.pipeline_schedule)
            results = run_torchrun(specs, device) if torchrun else run_local(specs, args, device, progress)
        except ConfigError as exc:
            for problem in exc.problems:
                print(f"error: {problem}", file=sys.stderr)
            return 2
        except LinkUnavailable as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 3
        except RankFailure as exc:
            return _rank_failure(exc, args, progress, partial_to)
        except (KeyboardInterrupt, SystemExit) as exc:
            return _stopped(exc, args, progress, partial_to, recipe.train.max_steps if recipe else 0)
        if results is None:  # torchrun ranks other than 0
            return 0
        with signal_handlers(IGNORED):  # every step ran: a signal now would only lose the report
            return _report(summarize(results, recipe, args, device, world), args)


def _rank_failure(exc: RankFailure, args, progress: Progress, partial_to: dict | None) -> int:
    for outcome in (exc.outcomes[rank] for rank in exc.first):  # a rank that died first is the cause
        if outcome.error:
            lines = outcome.error.strip().splitlines()
            print(f"error: rank {outcome.rank}: {lines[-1]}", file=sys.stderr)
            if args.verbose:
                print(outcome.error, file=sys.stderr)
    _keep_partial(args, progress, partial_to, f"failed while running {progress.running}")
    return 1


def _stopped(exc: BaseException, args, progress: Progress, partial_to: dict | None, steps: int) -> int:
    code, name = stopped_by(exc)
    where = f" while running {progress.running}" if progress.running else ""
    saved = _keep_partial(args, progress, partial_to, f"stopped by {name}")
    print(
        f"stopped by {name}{where}; every rank stopped; finished steps: {progress.describe(steps)}"
        + (f"; partial results written to {saved}" if saved else ""),
        file=sys.stderr,
    )
    return code


def _report(summary: dict, args) -> int:
    """The table, then the JSON, the traces and the timeline; returns 1 when a result could not be written."""
    print(format_table(summary))
    status = 0
    if args.json_path:
        written, problem = save_json(summary, args.json_path)
        if problem:
            print(f"error: {problem}; the results are kept in {written}", file=sys.stderr)
            status = 1
        else:
            print(f"results written to {written}")
    traces = {name: arm.get("profile_trace") for name, arm in summary["arms"].items()}
    if any(traces.values()):
        print("traces of one more step per arm, profiled after the measured ones (not in the statistics): "
              + ", ".join(f"{name} {path}" for name, path in traces.items() if path))  # fmt: skip
    if args.timeline:
        try:
            draw_timeline(summary, args.timeline)
            print(f"timeline of one steady step per arm drawn to {args.timeline}")
        except OSError as exc:
            print(f"error: --timeline={args.timeline!r}: cannot be written now ({exc.strerror or exc})",
                  file=sys.stderr)  # fmt: skip
            status = 1
    return status


def _keep_partial(args, progress: Progress, config: dict | None, status: str) -> str | None:
    """Writes what finished to --json (when given and a run had started); returns the path written."""
    if not args.json_path or config is None:
        return None
    written, problem = save_json(partial_summary(status, progress.finished, config), args.json_path)
    if problem:
        print(f"error: {problem}; the partial results are kept in {written}", file=sys.stderr)
    return written
