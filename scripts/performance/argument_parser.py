"""Command-line flags of the performance harness (named as upstream's where upstream has them)."""

import argparse

# Pipeline layout flags (upstream's names); unset means no pipeline (PP 1) and no virtual stages.
PIPELINE_FLAGS = ("pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")

# Model-config fields that have a flag of the same name (integers).
MODEL_INT_FLAGS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "ffn_hidden_size",
    "moe_ffn_hidden_size",
    "num_moe_experts",
    "moe_router_topk",
    "seq_length",
    "expert_model_parallel_size",
)


def bool_arg(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def wgrad_window_arg(text: str) -> int | None:
    """1 or 2, or auto (None: the engine lets the planner choose)."""
    lowered = text.strip().lower()
    if lowered == "auto":
        return None
    if lowered in ("1", "2"):
        return int(lowered)
    raise argparse.ArgumentTypeError(f"expected 1, 2 or auto, got {text!r}")


def backend_arg(text: str) -> str | None:
    lowered = text.strip().lower()
    if lowered in ("none", "null", ""):
        return None
    if lowered not in ("deepep", "hybridep", "ncclep"):
        raise argparse.ArgumentTypeError(f"expected deepep, hybridep, ncclep or None, got {text!r}")
    return lowered


class _OneLineErrors(argparse.ArgumentParser):
    """Flag errors as one line and exit status 2, like every other bad input of the harness."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineErrors(
        prog="ep_overlap_ab.py",
        description="MoE EP-overlap performance harness: one arm, or a matched A/B of overlap off vs on.",
        epilog=(
            "Trailing key=value overrides (e.g. comm_overlap.overlap_moe_expert_parallel_comm=true) apply last; "
            "values are parsed by OmegaConf and type-checked against the field; an override of a field a flag sets "
            "must agree with the flag. Every flag and override is "
            "checked before any rank starts. A run has no wall-clock limit: it ends when it finishes, when a rank "
            "fails (a rank blocked in one collective fails after train.collective_timeout_s, default 120 s), or "
            "when no rank finishes a step for 10 x train.collective_timeout_s (default 20 min). SIGINT/SIGTERM "
            "stop every rank within seconds; finished steps are kept in --json."
        ),
    )
    _overlap_flags(parser.add_argument_group("overlap"))
    model = parser.add_argument_group("model")
    _model_flags(model)
    _recompute_flags(model)
    model.add_argument(
        "--mtp_num_layers",
        type=int,
        default=None,
        help="multi-token prediction layers of the Megatron-Core model (--model_impl mcore); at most 1 with overlap",
    )
    for name in PIPELINE_FLAGS:
        model.add_argument(f"--{name}", type=int, default=None)
    model.add_argument(
        "--pipeline_schedule",
        choices=["1f1b", "interleaved", "dualpipev"],
        default=None,
        help="with --pipeline_model_parallel_size >= 2: 1f1b, interleaved (with "
        "--virtual_pipeline_model_parallel_size) or dualpipev (--model_impl mcore over gloo: each rank holds "
        "stages r and 2P-1-r of 2P equal stages; at least 2P microbatches); default: 1f1b, or interleaved with "
        "virtual stages",
    )
    train = parser.add_argument_group("training")
    train.add_argument("-ms", "--max_steps", type=int, default=None)
    train.add_argument("--micro_batch_size", type=int, default=None)
    train.add_argument("--num_microbatches", type=int, default=None)
    train.add_argument("--seed", type=int, default=None)

    run = parser.add_argument_group("run")
    _run_flags(run)
    _output_flags(run)
    return parser


def _overlap_flags(overlap) -> None:
    overlap.add_argument(
        "--moe_a2a_overlap",
        type=bool_arg,
        default=None,
        help="true/false: EP all-to-all overlap (plain overlap only; delayed wgrad is --delay_wgrad_compute)",
    )
    overlap.add_argument("--delay_wgrad_compute", type=bool_arg, default=None, help="true/false: delayed expert wgrad")
    overlap.add_argument(
        "--attention_wgrad_window",
        type=wgrad_window_arg,
        default=argparse.SUPPRESS,  # 1 when not given (parse_cli_args); given, it must have delayed wgrad to act on
        help="with delayed wgrad: the window of the next layer step that runs a layer's attention wgrad (1: beside "
        "B.combine backward; 2: beside F.dispatch; auto: the engine runs its first step plain and the planner "
        "picks from that step's costs, printed with the results; PP 1 only); ep_overlap_plan.py says which suits "
        "a shape",
    )
    overlap.add_argument(
        "--edge_pairing",
        type=bool_arg,
        default=False,
        help="true/false: with overlap at PP 1, pair the warm-up's two forwards and the cool-down's two backwards "
        "instead of running one microbatch alone at each end (numerics unchanged; one more microbatch's "
        "activations alive; default false)",
    )
    overlap.add_argument(
        "--moe_ep_overlap_chunks",
        type=int,
        default=1,
        help="1 (default) or 2: with overlap at PP 1, split the first and the last microbatch in two along the batch "
        "so no all-to-all runs with nothing beside it (needs micro_batch_size >= 2; not bitwise: a split "
        "microbatch's loss and gradients are summed from two halves)",
    )
    overlap.add_argument(
        "--launch_off_host",
        type=bool_arg,
        default=None,
        help="true/false: on CPU, launch the overlapped step's all-to-alls through one helper thread (in program "
        "order) whenever one must wait, so a dispatch waiting for its split sizes (for the slower rank) does not "
        "stop the host (numerics unchanged; default: wherever it applies, i.e. the reference model on CPU)",
    )
    overlap.add_argument(
        "--moe_flex_dispatcher_backend", type=backend_arg, default=None, help="deepep, hybridep, ncclep or None"
    )
    overlap.add_argument("--cuda_graph_impl", choices=["none", "local", "transformer_engine"], default=None)


def _model_flags(model) -> None:
    for name in MODEL_INT_FLAGS:
        model.add_argument(f"--{name}", type=int, default=None)
    model.add_argument("--precision", choices=["fp32", "bf16"], default=None)
    model.add_argument(
        "--hybrid_layer_pattern",
        default=None,
        help="--model_impl mcore: a Megatron-Core HybridModel of this layer pattern (* attention, - MLP, E MoE, "
        "M Mamba, G GDN, + MLA, D DSA; '/' then one MTP depth, e.g. '*E*E/*E'); it sets num_layers. Needs CUDA and "
        "Transformer Engine",
    )


def _recompute_flags(model) -> None:
    model.add_argument(
        "--recompute_modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="selective recompute in both arms (Megatron-LM's list): layernorm core_attn moe_act mlp moe; the "
        "reference model recomputes them in each node's backward",
    )
    model.add_argument(
        "--recompute_granularity",
        choices=["full", "selective"],
        default=None,
        help="full: recompute whole layer segments in both arms (with --recompute_method and "
        "--recompute_num_layers, Megatron-LM's flags); the overlapped schedule replays each segment's forward "
        "before its last layer's backward. selective: see --recompute_modules",
    )
    model.add_argument(
        "--recompute_method",
        choices=["uniform", "block"],
        default=None,
        help="full recompute: 'uniform' segments of --recompute_num_layers layers, or 'block' (the first "
        "--recompute_num_layers layers of each chunk)",
    )
    model.add_argument(
        "-rl",
        "--recompute_num_layers",
        type=int,
        default=None,
        help="full recompute: layers per segment ('uniform'), or recomputed ('block'); given alone it means full "
        "recompute of the first N layers ('block'), as Megatron-Bridge's own harness reads -rl",
    )


def _run_flags(run) -> None:
    run.add_argument("-d", "--dryrun", action="store_true", help="print the resolved config and exit")
    run.add_argument(
        "--ab", action="store_true", help="run baseline (overlap off) and overlap arms, same seed and data"
    )
    run.add_argument(
        "--predict",
        action="store_true",
        help="with --ab: also print the planner's prediction, fed with the baseline arm's records, beside the "
        "measurement (per phase too)",
    )
    run.add_argument(
        "--print_schedule",
        action="store_true",
        help="print every pipeline rank's order of forward/backward steps and P2P transfers (the engine's schedule)",
    )
    run.add_argument("--nproc_per_node", type=int, default=2, help="local ranks to spawn when not under torchrun")
    run.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    run.add_argument(
        "--dist_backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="local ranks' process-group backend: auto is NCCL on CUDA (one GPU per rank), gloo on CPU; gloo on CUDA "
        "runs several ranks on one GPU",
    )
    run.add_argument(
        "--model_impl",
        choices=["reference", "mcore"],
        default="reference",
        help="reference: this project's plain-PyTorch MoE GPT; mcore: a Megatron-Core GPTModel (needs CUDA)",
    )


def _output_flags(run) -> None:
    run.add_argument(
        "--link_gbps", type=float, default=None, help="emulate a G Gbit/s link between local ranks (root)"
    )
    run.add_argument("--json", dest="json_path", default=None, help="write results as JSON here")
    run.add_argument(
        "-v", "--verbose", action="store_true", help="show third-party import warnings and full rank tracebacks"
    )
    run.add_argument("--timeline", default=None, help="draw one steady step of each arm to this .png/.pdf/.svg")
    run.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="after the measured steps, run one more step per arm under torch's profiler and write rank 0's Chrome "
        "trace to DIR/<arm>.json (excluded from every statistic; read it with overlap_from_trace.py)",
    )
    run.add_argument("overrides", nargs="*", help="Hydra-style section.field=value overrides")


def parse_cli_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.attention_wgrad_window_given = hasattr(args, "attention_wgrad_window")
    if not args.attention_wgrad_window_given:
        args.attention_wgrad_window = 1
    if args.recompute_modules:  # the list stops at the first key=value override, which argparse would take as a module
        modules = [m for m in args.recompute_modules if "=" not in m]
        args.overrides = [m for m in args.recompute_modules if "=" in m] + args.overrides
        args.recompute_modules = modules
    return args
