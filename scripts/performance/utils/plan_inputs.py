"""The planner CLI's inputs, checked before anything is priced: flags against the model and layout, and a JSON file
read with one line per problem (the file, what is missing or wrong, and what to give instead).

Every check returns problems as strings; the CLI prints each as ``error: ...`` and exits 2.
"""

import json
import math
from dataclasses import dataclass
from pathlib import Path

# The layout defaults of a --model prediction (a flag left unset means these).
MODEL_DEFAULTS = {"gpus": 16, "ep": 16, "global_batch": 1024}


def model_layout(args) -> tuple[int, int, int]:
    """``(gpus, ep, global_batch)`` of a --model prediction: the flags, defaults where unset."""
    gpus, ep, batch = (getattr(args, k) if getattr(args, k) is not None else v for k, v in MODEL_DEFAULTS.items())
    return gpus, ep, batch


def flag_problems(args, num_experts: int | None) -> list[str]:
    """Problems of the flags: each row is (broken, field, value, fix), checked in order, all reported."""
    rows = [
        (
            args.link_gbps is not None and not _positive_number(args.link_gbps),
            "--link_gbps",
            args.link_gbps,
            "give the link's rate in Gbit/s: a finite number above 0",
        ),
        (
            any(n <= 0 for n in args.microbatches or []),
            "--microbatches",
            args.microbatches,
            "give microbatch counts of 1 or more",
        ),
    ]
    recipe = getattr(args, "recipe", None) or getattr(args, "all_recipes", False)
    rows += _recipe_rows(args) if recipe else _source_rows(args) if args.from_json or args.table else []
    rows += _model_rows(args, num_experts) if args.model else []
    rows += _pipeline_rows(args) + _dispatcher_rows(args)
    return [f"{field}={value!r}: {fix}" for broken, field, value, fix in rows if broken]


def _recipe_rows(args) -> list[tuple]:
    """The rows of a --recipe or --all_recipes run: the recipe gives its own layout (--gpus and --profile may
    override its name's)."""
    source = "--recipe" if args.recipe else "--all_recipes"
    rows = [
        (getattr(args, flag) is not None, f"--{flag}", getattr(args, flag), f"applies to --model ({source} takes "
         "it from the recipe): drop it")
        for flag in ("ep", "global_batch", "link_gbps", "recompute_modules", "microbatches", "pp", "vpp")
    ]  # fmt: skip
    rows.append((args.gpus is not None and args.gpus < 1, "--gpus", args.gpus, "give 1 or more GPUs"))
    return rows


def _dispatcher_rows(args) -> list[tuple]:
    """--dispatcher and --num_sms: a --model prediction's backend."""
    dispatcher, sms = getattr(args, "dispatcher", None), getattr(args, "num_sms", None)
    return [
        (dispatcher is not None and not args.model, "--dispatcher", dispatcher, "applies to --model only: drop it"),
        (sms is not None and dispatcher is None, "--num_sms", sms, "applies with --dispatcher: add it"),
        (sms is not None and sms < 1, "--num_sms", sms, "give a whole number of SMs, 1 or more"),
        (sms is not None and dispatcher == "alltoall", "--num_sms", sms, "NCCL's all-to-all takes its channels, not "
         "--num_sms: drop it"),
    ]  # fmt: skip


def _pipeline_rows(args) -> list[tuple]:
    """--pp and --vpp: a --model prediction's pipeline, whose stages share the GPUs."""
    pp, vpp = getattr(args, "pp", None), getattr(args, "vpp", None)
    gpus, ep, _ = model_layout(args)
    return [
        (pp is not None and args.table, "--pp", pp, "applies to --model and --from_json: drop it"),
        (pp is not None and pp < 1, "--pp", pp, "give 1 or more pipeline stages"),
        (vpp is not None and (pp is None or pp < 2), "--vpp", vpp, "applies with --pp 2 or more: add --pp"),
        (vpp is not None and vpp < 2, "--vpp", vpp, "give 2 or more virtual stages (1F1B is priced without it)"),
        (
            args.model and pp is not None and pp > 1 and gpus > 0 and ep > 0 and gpus % (pp * ep) != 0,
            "--pp",
            pp,
            f"with --ep={ep} must divide --gpus={gpus} into stages of whole EP groups",
        ),
    ]


def _source_rows(args) -> list[tuple]:
    """The rows of a --from_json or --table run: the flags that apply to --model only."""
    rows = []
    source = "--from_json" if args.from_json else "--table"
    for flag in ("gpus", "ep", "global_batch"):
        rows.append(
            (
                getattr(args, flag) is not None,
                f"--{flag}",
                getattr(args, flag),
                f"applies to --model only ({source} takes the layout from "
                + ("the measured run" if args.from_json else "its own rows")
                + "): drop it",
            )
        )
    if args.table:
        rows.append((args.link_gbps is not None, "--link_gbps", args.link_gbps, "applies to --from_json: drop it"))
    rows.append(
        (
            args.recompute_modules is not None,
            "--recompute_modules",
            args.recompute_modules,
            f"applies to --model ({source}: "
            + ("the measured records include it" if args.from_json else "the table is without recompute")
            + "): drop it",
        )
    )
    return rows


def _model_rows(args, num_experts: int | None) -> list[tuple]:
    """The rows of a --model prediction: its layout against the model."""
    gpus, ep, batch = model_layout(args)
    return [
        (
            args.link_gbps is not None,
            "--link_gbps",
            args.link_gbps,
            "applies to --from_json; with --model the link is --profile's: drop it",
        ),
        (gpus <= 0, "--gpus", gpus, "give 1 or more GPUs"),
        (ep <= 0, "--ep", ep, "give an expert-parallel size of 2 or more"),
        (
            ep == 1,
            "--ep",
            ep,
            "expert-parallel size 1 moves no tokens between ranks, so there is nothing to overlap: give 2 or more",
        ),
        (
            gpus > 0 and ep > 0 and gpus % ep != 0,
            "--ep",
            ep,
            f"must divide --gpus={gpus} (EP groups tile the data-parallel ranks): pick one of "
            f"{[d for d in range(1, gpus + 1) if gpus % d == 0]}",
        ),
        (
            ep > 0 and num_experts is not None and num_experts % ep != 0,
            "--ep",
            ep,
            f"must divide the model's {num_experts} experts (each rank holds the same number): pick one of "
            f"{[d for d in range(1, num_experts + 1) if num_experts % d == 0 and (gpus <= 0 or gpus % d == 0)]}",
        ),
        (
            gpus > 0 and (batch <= 0 or batch % gpus != 0),
            "--global_batch",
            batch,
            f"give a positive multiple of --gpus={gpus} (every data-parallel rank gets whole sequences)",
        ),
    ]


def _positive_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def _whole(value, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True)
class MeasuredRun:
    """What the planner takes from the harness's JSON: rank 0's steady baseline steps and the run's shape."""

    records: list[dict]
    step_times_s: list[float]
    link_gbps: float | None
    num_layers: int
    num_microbatches: int
    first_step: int
    last_step: int
    activation_bytes: float = 0.0  # one microbatch's activation between pipeline stages


class PlanInputError(ValueError):
    """A file the planner cannot use; ``str()`` is the one line to print."""


def read_measured(path: str) -> MeasuredRun:
    """Reads the harness's ``--json`` output of a finished ``--ab`` run (or a single run with a baseline arm).

    Raises:
        PlanInputError: the file is missing, not JSON, a partial result, pipelined, or lacks a field the planner
            reads; the message names the file and what is missing.
    """
    where = f"--from_json={path}"
    need = _reader(_load_summary(path, where), where)
    pipeline = need("config", "model").get("pipeline_model_parallel_size") or 1
    if pipeline > 1:
        raise PlanInputError(
            f"{where}: a pipelined run (pipeline_model_parallel_size={pipeline}); the planner simulates PP = 1: "
            "use an A/B run without pipeline flags"
        )
    if need("config", "model").get("expert_model_parallel_size") == 1:
        raise PlanInputError(
            f"{where}: a run with expert_model_parallel_size=1 moves no tokens between ranks, so there is nothing "
            "to overlap: use an A/B run with EP 2 or more"
        )
    warmup, max_steps = need("config", "train", "warmup_steps"), need("config", "train", "max_steps")
    num_microbatches, num_layers = need("config", "train", "num_microbatches"), need("config", "model", "num_layers")
    link_gbps = need("config").get("link_gbps")
    _check_fields(where, warmup, max_steps, num_microbatches, num_layers, link_gbps)
    records, times = need("arms", "baseline", "records", "0"), need("arms", "baseline", "step_times_s")
    _check_records(where, records, times, warmup, num_layers)
    return MeasuredRun(
        records=records[warmup:],
        step_times_s=times[warmup:],
        link_gbps=link_gbps,
        num_layers=num_layers,
        num_microbatches=num_microbatches,
        first_step=warmup + 1,
        last_step=max_steps,
        activation_bytes=_activation_bytes(need("config", "model"), need("config", "train")),
    )


def _activation_bytes(model: dict, train: dict) -> float:
    """Bytes of one microbatch's hidden states (what a pipeline stage sends the next); 0 where the file lacks a
    field."""
    sizes = [model.get("hidden_size"), model.get("seq_length"), train.get("micro_batch_size")]
    if not all(_whole(size, 1) for size in sizes):
        return 0.0
    return sizes[0] * sizes[1] * sizes[2] * (2 if model.get("bf16") else 4)


def _load_summary(path: str, where: str) -> dict:
    """The file's JSON object, when it is a finished run's output."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise PlanInputError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    try:
        summary = json.loads(text)
    except json.JSONDecodeError as exc:
        what = "empty" if not text.strip() else f"not JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})"
        raise PlanInputError(f"{where}: {what}; give the file the harness wrote with --json") from None
    if not isinstance(summary, dict):
        raise PlanInputError(f"{where}: holds a {type(summary).__name__}, not the harness's --json output")
    if "completed_steps" in summary:
        raise PlanInputError(
            f"{where}: the partial result of a run that {summary.get('status', 'did not finish')}; "
            "the planner needs a finished run's output: rerun the harness"
        )
    return summary


def _reader(summary: dict, where: str):
    """``need(*keys)``: the value at that path of ``summary``, or an error naming the first key that is missing."""

    def need(*keys: str):
        value = summary
        for depth, key in enumerate(keys):
            if not isinstance(value, dict) or key not in value:
                hint = " (an --ab run has it)" if keys[:2] == ("arms", "baseline") else ""
                missing = ".".join(keys[: depth + 1])
                raise PlanInputError(f"{where}: has no {missing}{hint}; rerun the harness with --ab")
            value = value[key]
        return value

    return need


def _check_fields(where: str, warmup, max_steps, num_microbatches, num_layers, link_gbps) -> None:
    fields = {
        "config.train.warmup_steps": (warmup, _whole(warmup, 0), "a whole number of 0 or more"),
        "config.train.max_steps": (max_steps, _whole(max_steps, 1), "a whole number of 1 or more"),
        "config.train.num_microbatches": (
            num_microbatches,
            _whole(num_microbatches, 1),
            "a whole number of 1 or more",
        ),
        "config.model.num_layers": (num_layers, _whole(num_layers, 1), "a whole number of 1 or more"),
        "config.link_gbps": (
            link_gbps,
            link_gbps is None or _positive_number(link_gbps),
            "a finite number above 0, or null (loopback)",
        ),
    }
    bad = [f"{name}={value!r} (give {what})" for name, (value, ok, what) in fields.items() if not ok]
    if bad:
        raise PlanInputError(f"{where}: malformed: {'; '.join(bad)}; rerun the harness, or correct the file")


def _check_records(where: str, records, times, warmup: int, num_layers: int) -> None:
    if not isinstance(records, list) or not isinstance(times, list) or len(records) <= warmup:
        raise PlanInputError(
            f"{where}: no steady baseline step (warmup_steps={warmup}, {len(records)} step record(s)); "
            "rerun with more --max_steps"
        )
    for i, step in enumerate(records[warmup:], start=warmup):
        missing = [key for key in ("comm", "compute") if not isinstance(step, dict) or key not in step]
        if missing:
            raise PlanInputError(f"{where}: arms.baseline.records.0[{i}] has no {', '.join(missing)}")
    problems = record_problems(records, times, warmup, num_layers)
    if problems:
        raise PlanInputError(f"{where}: {'; '.join(problems[:3])}; rerun the harness, or correct the file")


def record_problems(records: list, times: list, warmup: int, num_layers: int) -> list[str]:
    """What is wrong with the steady steps' numbers: every time finite and not negative, every duration and byte count
    not negative, every layer inside the model (``num_layers``, which the planner prices), some all-to-all time to
    hide, and no more layers than the planner prices in bounded time."""
    from ep_overlap_lab.planner.simulate import MAX_LAYERS

    if num_layers > MAX_LAYERS:
        return [f"config.model.num_layers={num_layers}: the planner prices up to {MAX_LAYERS} layers"]
    problems, comm_s, comm_records = [], 0.0, 0
    for i, (step, total) in enumerate(zip(records[warmup:], times[warmup:]), start=warmup):
        where = f"arms.baseline.records.0[{i}]"
        if not _positive_number(total):
            problems.append(f"arms.baseline.step_times_s[{i}]={total!r} (give a finite time above 0)")
        for kind, lowest in (("compute", -1), ("comm", 0)):
            for j, record in enumerate(step[kind]):
                problem = _record_problem(record, kind, lowest, num_layers)
                if problem:
                    problems.append(f"{where}.{kind}[{j}] {problem}")
                elif kind == "comm" and not str(record.get("op", "")).endswith("split_exchange"):
                    comm_s += record["end_s"] - record["start_s"]
                    comm_records += 1
    if not problems and comm_records and comm_s <= 0:
        problems.append("the baseline's all-to-alls took no time at all, so there is nothing to hide")
    return problems


def _record_problem(record, kind: str, lowest: int, num_layers: int) -> str | None:
    numbers = ("start_s", "end_s") + (("bytes_sent", "bytes_received") if kind == "comm" else ())
    if not isinstance(record, dict) or any(key not in record for key in (*numbers, "layer")):
        return f"lacks one of {', '.join((*numbers, 'layer'))}"
    bad = [f"{key}={record[key]!r}" for key in numbers if not _number_at_least(record[key], 0.0)]
    if bad:
        return f"has {', '.join(bad)} (give finite numbers, 0 or more)"
    if record["end_s"] < record["start_s"]:
        return f"ends ({record['end_s']!r} s) before it starts ({record['start_s']!r} s)"
    layer = record["layer"]
    if not (isinstance(layer, int) and lowest <= layer < num_layers):
        return (
            f"is of layer {layer!r}, outside config.model.num_layers={num_layers} (the records and the model must "
            "agree)"
        )
    return None


def _number_at_least(value, least: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= least
