"""The patch series ``make patch`` writes (``tools/upstream.py``), as data: each patch's message, what it holds, and
the paths its subject names (the only ones it may change). In order: upstream bug fixes that stand on their own
(each with its test; they apply, and their tests pass, without the feature), the feature, then the hunks of upstream
files only the feature needs."""

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """One patch of the series."""

    subject: str
    body: str
    touches: tuple[str, ...]  # fnmatch patterns of upstream paths: what the subject names
    hunks: tuple[str, ...] = ()  # stored diffs (tools/upstream_hunks/), applied in order
    files: tuple[str, ...] = ()  # new files shipped whole from tools/upstream_files/, at the same path upstream
    payload: bool = False  # the payload and its tests (upstream.payload_files)
    fix: bool = False  # an upstream bug fix: needs nothing of the feature


GPT_STEP = "src/megatron/bridge/training/gpt_step.py"
MTP_TEST = "tests/unit_tests/training/test_gpt_step_mtp_loss_mask.py"
PACKED_TEST = "tests/unit_tests/training/test_gpt_step_packed_schedule_plan.py"

MTP_LOSS_MASK = Part(
    subject="gpt_step: pass the loss mask to the plain forward of MTP models",
    body="""\
_forward_step_common hands build_schedule_plan the loss mask but leaves it
out of the plain path's model(**forward_args). Megatron-Core's multi-token
prediction (MTP) loss reads the loss mask inside the model and, given
none, counts every token, masked ones too. An MTP model with masked
tokens therefore trains a different MTP loss, and different gradients,
with overlap_moe_expert_parallel_comm on and off.

The plain path now passes loss_mask when mtp_num_layers is set. Without
MTP layers the model is called exactly as before.

Test: tests/unit_tests/training/test_gpt_step_mtp_loss_mask.py (CPU; it
fails without the fix).""",
    touches=(GPT_STEP, MTP_TEST),
    hunks=("gpt_step_mtp_loss_mask.diff",),
    files=(MTP_TEST,),
    fix=True,
)

PACKED_SEQ_PARAMS = Part(
    subject="gpt_step: build the schedule plan with the packed-sequence parameters",
    body="""\
With overlap_moe_expert_parallel_comm on, _forward_step_common builds the
schedule plan from tokens, position ids, attention mask, labels and loss
mask, and drops the packed_seq_params the plain forward gets. A packed
(THD) microbatch then runs as one long sequence: every document attends
to the ones before it in its row, silently.

build_schedule_plan (Megatron-Core's GPTModel takes the keyword) now gets
the same packed_seq_params as the forward; None for padded microbatches.

Test: tests/unit_tests/training/test_gpt_step_packed_schedule_plan.py
(CPU; it fails without the fix).""",
    touches=(GPT_STEP, PACKED_TEST),
    hunks=("gpt_step_packed_seq_params.diff",),
    files=(PACKED_TEST,),
    fix=True,
)

FEATURE = Part(
    subject="training: EP overlap schedule for MoE models, with its config rules",
    body="""\
Hides MoE expert-parallel dispatch/combine all-to-all behind compute by
pairing one microbatch's forward with another's backward, through
Megatron-Core's own hooks: Megatron-Core's combined-1F1B driver calls
build_schedule_plan, and a pre-wrap hook (training/ep_overlap/mcore/hook.py,
cfg.model.register_pre_wrap_hook(use_ep_overlap_schedule)) gives each
GPTModel a plan that runs this schedule. Losses, gradients and weights are
bitwise equal to the overlap off.

What it adds or changes, in reading order:
- training/moe_overlap_rules/: every EP-overlap rule as data (condition,
  message, fix); training/comm_overlap.py (upstream's file plus hunks)
  checks them all in setup() and raises one CommOverlapConfigError (an
  AssertionError) with one line per problem, writing nothing on error;
  training/comm_overlap_values.py: its own values' types and ranges.
- training/flex_dispatcher_backend.py: upstream's file; a clear error
  where CUDA is absent or a backend unknown, instead of a CUDA crash.
- training/ep_overlap/: the schedule (program/), its runtime (runtime/)
  and the Megatron-Core adapter (mcore/); utils/: explicit config values,
  logging, process groups, versions.
- training/ep_overlap_config.py: the plugin's entry point, an alias of
  CommOverlapConfig here, so a recipe written for the plugin runs as is.
- tests/unit_tests/training/ep_overlap/: CPU tests (gloo ranks, tiny
  models); those marked lab compare against this project's reference
  engine and skip where it is not installed.

No package __init__.py is touched. The plain 1F1B pipeline (PP > 1
without virtual stages) is refused by name until the last patch of this
series.""",
    touches=(
        "src/megatron/bridge/training/comm_overlap.py",
        "src/megatron/bridge/training/comm_overlap_*.py",
        "src/megatron/bridge/training/flex_dispatcher_backend.py",
        "src/megatron/bridge/training/ep_overlap/*",
        "src/megatron/bridge/training/ep_overlap_config.py",
        "src/megatron/bridge/training/moe_overlap_rules/*",
        "src/megatron/bridge/utils/*",
        "tests/unit_tests/training/ep_overlap/*",
    ),
    payload=True,
)

QWEN3_VL = Part(
    subject="qwen3_vl_step: build the schedule plan from the forward's arguments",
    body="""\
Needs the previous patch: Qwen3VLModel has no build_schedule_plan of its
own, the EP overlap hook gives it one.

The overlapped path called build_schedule_plan with tokens, position ids,
attention mask, labels and loss mask, so a microbatch's pixel values and
grids never reached the model: its images would train as text. It now
takes forward_args, what the plain forward takes (position ids None: the
model computes its multimodal ones). Without this patch the hook refuses
microbatches with images, naming it.""",
    touches=("src/megatron/bridge/models/qwen_vl/qwen3_vl_step.py",),
    hunks=("qwen3_vl_step.diff",),
)

PLAIN_PIPELINE = Part(
    subject="train, setup: EP overlap in the plain 1F1B pipeline",
    body="""\
Needs the EP overlap patch. Only for PP > 1 without virtual stages; every
other layout runs without this patch, and without it that one is refused
before the first step, naming the fix (set virtual stages, or apply it).

Why train.py changes: Megatron-Core pairs a forward with a backward only
in its interleaved schedule, and its TransformerConfig refuses
overlap_moe_expert_parallel_comm (and delay_wgrad_compute) with PP > 1
and no virtual stages. train() takes get_forward_backward_func from
Megatron-Core and offers no setting to replace it, so it now takes it from
training/ep_overlap/mcore: Megatron-Core's function for every layout (the
call told the step's microbatch count), and for the plain 1F1B pipeline
with the overlap on, Megatron-Core's interleaved schedule over one chunk
per rank. eval.py needs no change (forward only).

Why setup.py changes: CommOverlapConfig.setup keeps both flags off the
provider in that layout, so Megatron-Core's checks pass; they are set in
_build_distributed_model just before the build, so Transformer Engine's
linears are built delaying their weight gradients. With nothing deferred
the call does nothing.""",
    touches=("src/megatron/bridge/training/setup.py", "src/megatron/bridge/training/train.py"),
    hunks=("setup.diff", "train.diff"),
)

SERIES = (MTP_LOSS_MASK, PACKED_SEQ_PARAMS, FEATURE, QWEN3_VL, PLAIN_PIPELINE)
