"""A full-iteration CUDA graph of this project's EP-overlap plan with HybridEP, against eager: bitwise equal.

Run it under torchrun, one rank per GPU (NCCL), 2 or more GPUs; ``scripts/gpu_check.sh`` runs it where ``deep_ep``
has HybridEP:

    torchrun --nproc_per_node <GPUs> tests/functional_tests/full_iteration_graph_check.py [--steps 5 ...]

Where it cannot run it prints one line, ``full-iteration graph check skipped: <why>``, and exits 0: no CUDA, fewer
than 2 GPUs, not under torchrun, no HybridEP, or no Transformer Engine whose fused grouped MLP keeps HybridEP's
per-expert counts on the device (``fused_experts_problem`` says why only that runs a static-shape step).

What it checks, step by step:

1. One small Megatron-Core ``GPTModel``: Transformer Engine spec, every layer MoE with Transformer Engine's fused
   grouped MLP (``use_transformer_engine_op_fuser``, weighted squared ReLU), bf16, RoPE, an aux-loss router; EP =
   world size; the flex dispatcher with ``moe_flex_dispatcher_backend='hybridep'`` and
   ``moe_expert_rank_capacity_factor`` set (HybridEP's static shape: its dispatch fills a fixed budget of rows and
   needs nothing from the host); ``overlap_moe_expert_parallel_comm`` on and this project's pre-wrap hook
   (``use_ep_overlap_schedule``) installed; ``cuda_graph_impl='full_iteration'`` in every arm's config (as Bridge's
   recipes set it: Megatron-Core picks its graph-safe paths by it, and our rule ``cuda_graph_host_sync`` checks it
   when the hook is installed).
2. Each arm builds that model from the same initial weights (one build's, copied into each) and trains it
   ``--steps`` steps on the same data (per step and rank, different each step), Adam stepping in place between steps
   and the gradients zeroed in place before each, as Bridge's loop does around its graph:

   * ``eager``: this project's ``get_forward_backward_func()`` (Megatron-Core's ``forward_backward_no_pipelining``,
     whose combined 1F1B driver runs our plan) called once per step;
   * ``repeat`` (unless ``--no-repeat``): ``eager`` again, the control: it shows whether eager is bitwise
     reproducible on this machine at all, so a difference of the graphed arm can be told from kernel nondeterminism;
   * ``graphed``: the same function wrapped in Megatron-Core's ``FullCudaGraphWrapper(...,
     cuda_graph_warmup_steps=W)``, as Bridge 0.6.2's ``train()`` wraps it. The data iterator yields dicts of tensors,
     which is what the wrapper expects: it reads every microbatch of the step first and copies it into its static
     input buffers, then hands Megatron-Core an iterator over those buffers. Steps 1..W run eagerly, step W+1
     captures the step (and, since capture runs nothing, replays it at once), the later steps only replay.
3. Every step's losses (per microbatch: the masked loss sum and its token count), every parameter's gradient and the
   final weights of ``graphed`` (and ``repeat``) must equal ``eager``'s bit for bit, on every rank (compared as raw
   bits: stricter than ``torch.equal``, which calls NaN unequal to itself and -0.0 equal to 0.0); the eager numbers
   must be finite.
4. The graph really ran: no graph in steps 1..W, one from step W+1 on, the same object after; ``forward_step`` (so
   our plan builder, and every Python line of the step) called ``--microbatches`` times in steps 1..W+1 and never in
   the later steps; the graph's ``replay`` called once in each of those later steps; the wrapper at iteration N. The
   capture step's numbers can only come from its replay: capture executes nothing.
5. No host synchronisation inside the captured step: the wrapper captures with ``capture_error_mode='thread_local'``,
   under which CUDA refuses any synchronising call from the capturing thread (``.item()``, ``.tolist()``, ``.cpu()``
   of a device tensor, ``torch.cuda.synchronize()``, ``Event``/``Stream.synchronize()``, a blocking copy): the call
   raises ("operation not permitted when stream is capturing") and the capture is void. A capture that completes is
   the proof; a failed one is reported as FAIL with its traceback, which points at the call. (The EP ranks'
   agreement on the microbatch count is a host all-gather of a CPU integer over gloo: no device sync, and a replay
   does not run it.)

Why bitwise equality is expected: a replay launches the same kernels with the same arguments, in the same order on
each stream, on the same values (the static buffers hold the same data, the parameters are updated in place). Only
run-to-run nondeterministic kernels could differ; the ``repeat`` arm measures that. The check sets
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (Transformer Engine's attention backward deterministic) and
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless set; ``--deterministic`` adds ``torch.use_deterministic_algorithms`` and
Megatron-Core's ``deterministic_mode`` (other code paths than a recipe's: use it when ``repeat`` differs).

Output: one line per arm on rank 0, then ``PASS`` or ``FAIL: ...``. Exit status 0 on PASS or skip, 1 on FAIL (a rank
that raises prints its traceback and ends the run), 2 on bad arguments.
"""

import argparse
import os
import sys
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial

import torch

SKIP_PREFIX = "full-iteration graph check skipped: "
VOCAB = 1024
LEARNING_RATE = 1e-3
# Megatron-Core rounds HybridEP's budget of permuted rows up to this with the op fuser
# (moe_utils.get_align_size_for_quantization: the fused grouped GEMM's alignment).
OP_FUSER_ALIGNMENT = 256
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; refuses (status 2) step counts that would leave no replay to compare.

    Args:
        argv: The arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed arguments.
    """
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5, help="training steps per arm (N)")
    parser.add_argument(
        "--warmup-steps", type=int, default=2, help="eager calls before capture (W; Bridge's GPT-OSS recipes set 2)"
    )
    parser.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=2, help="decoder layers, every one MoE")
    parser.add_argument("--hidden-size", type=int, default=256, help="a multiple of 64 (64 per attention head)")
    parser.add_argument("--experts-per-rank", type=int, default=2)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument(
        "--capacity-factor",
        type=float,
        default=None,
        help="moe_expert_rank_capacity_factor; default: the smallest that can drop no token (see capacity_factor)",
    )
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        help="collective timeout (NCCL, the hook's gloo); HybridEP compiles its kernels on first use",
    )
    parser.add_argument("--no-repeat", action="store_true", help="skip the eager control arm")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(warn_only) and Megatron-Core's deterministic_mode in every arm",
    )
    args = parser.parse_args(argv)
    if args.warmup_steps < 1:
        # The first call builds what capture may not: HybridEP's buffer, Transformer Engine's fused ops, the streams.
        parser.error("--warmup-steps must be at least 1 (the first call allocates and exchanges what capture cannot)")
    if args.steps < args.warmup_steps + 2:
        parser.error("--steps must be at least --warmup-steps + 2: the capture step, then at least one plain replay")
    for name in ("microbatches", "seq_length", "micro_batch_size", "layers", "experts_per_rank", "topk"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.hidden_size < 64 or args.hidden_size % 64:
        parser.error("--hidden-size must be a positive multiple of 64")
    if args.capacity_factor is not None and args.capacity_factor <= 0:
        parser.error("--capacity-factor must be positive")
    return args


def _te_graph_safe_grouped_gemm() -> bool | None:
    """Whether Transformer Engine's ``GroupedLinear`` op takes the split sizes on the device here (its graph-safe
    grouped-tensor path, for bf16 without quantization), as Transformer Engine itself decides it; None where this
    version has no predicate to ask (later than those read: the capture decides)."""
    from transformer_engine.pytorch.ops.basic import grouped_linear

    public = getattr(grouped_linear, "is_op_fuser_grouped_tensor_path_supported", None)  # after TE 2.18
    if public is not None:
        return bool(public(None, torch.bfloat16))
    private = getattr(grouped_linear.GroupedLinear, "_is_graph_safe_path_supported", None)  # TE 2.16 to 2.18
    if private is None:
        return None
    import inspect

    import transformer_engine_torch as tex

    kwargs = dict(with_quantized_compute=False, input_quantizers=[None], dtype=torch.bfloat16)
    if "single_grouped_weight" in inspect.signature(private).parameters:
        kwargs["single_grouped_weight"] = False
    # These versions leave cuBLASLt's own requirement of its grouped GEMM to the GEMM; later ones check it first.
    cublaslt = tex.get_cublasLt_version()
    needed = 130400 if torch.cuda.get_device_capability() < (10, 0) else 130300
    return bool(private(**kwargs)) and cublaslt >= needed


def fused_experts_problem() -> str | None:
    """Why Transformer Engine cannot run the experts of a static-shape HybridEP step inside a CUDA graph, or None.

    HybridEP with a capacity factor hands the experts a buffer of a fixed number of rows and the per-expert counts on
    the device. Megatron-Core's config accepts the capacity factor with hybridep only with
    ``use_transformer_engine_op_fuser``, whose grouped MLP (``TEGroupedMLP``) passes those counts on unread; its
    fused activation is SwiGLU only with the CuTe DSL kernels (``NVTE_CUTEDSL_FUSED_GROUPED_MLP=1``), else the
    weighted squared ReLU this check uses (``ScaledSReLU``, TE 2.17). Transformer Engine's ``GroupedLinear`` op keeps
    the counts on the device only on its graph-safe path (TE 2.16 on); elsewhere it reads them on the host
    (``.tolist()``), a sync that capture refuses. The local ``SequentialMLP`` cannot stand in: with several local
    experts it reads the counts on the host too, with one it computes over the rows HybridEP left unfilled.
    """
    try:
        import transformer_engine.pytorch  # noqa: F401
        from transformer_engine.pytorch.ops import GroupedLinear, ScaledSReLU  # noqa: F401
    except ImportError as exc:
        return f"Transformer Engine's op fuser GroupedLinear and ScaledSReLU (TE 2.17 on) are not importable ({exc})"
    from megatron.core.utils import get_te_version

    if _te_graph_safe_grouped_gemm() is False:
        major, minor = torch.cuda.get_device_capability()
        return (
            f"Transformer Engine {get_te_version()} has no graph-safe grouped GEMM on this GPU (compute capability "
            f"{major}.{minor}, or its cuBLASLt): its GroupedLinear op would read the per-expert counts on the host"
        )
    return None


def skip_reason() -> str | None:
    """Why this host cannot run the check (one line), or None. Nothing here needs a process group."""
    if not torch.cuda.is_available():
        return "no CUDA device (it captures a CUDA graph of an NCCL run on 2 or more GPUs)"
    gpus = torch.cuda.device_count()
    if gpus < 2:
        return f"needs 2 or more GPUs (one NCCL rank each, EP = ranks); this host has {gpus}"
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world < 2:
        return (
            "run it under torchrun with one rank per GPU, 2 or more "
            f"(torchrun --nproc_per_node {gpus} tests/functional_tests/full_iteration_graph_check.py)"
        )
    if world > gpus:
        return f"needs one GPU per rank: {world} ranks, {gpus} GPUs"
    # As Megatron-Core decides it: its HybridEP manager refuses to start when this function is None.
    from megatron.core.transformer.moe import fused_a2a

    if fused_a2a.hybrid_ep_dispatch is None:
        return "deep_ep without HybridEP (Megatron-Core's fused_a2a.hybrid_ep_dispatch is None)"
    problem = fused_experts_problem()
    if problem is not None:
        return f"the experts of a static-shape HybridEP step need Transformer Engine's graph-safe op fuser: {problem}"
    return None


def capacity_factor(args: argparse.Namespace, world: int) -> float:
    """``--capacity-factor``, or the smallest factor whose budget no routing can exceed: a rank receives at most
    ``world x tokens`` source tokens, each on at most ``min(topk, experts per rank)`` of its experts, and the budget
    is ``tokens x topk x factor``. So no token is ever dropped over the budget, whatever the router does."""
    if args.capacity_factor is not None:
        return args.capacity_factor
    return world * min(args.topk, args.experts_per_rank) / args.topk


def permuted_budget(args: argparse.Namespace, factor: float) -> int:
    """HybridEP's rows per rank, as Megatron-Core's ``_HybridEPManager.setup_metadata`` computes them."""
    budget = int(args.seq_length * args.micro_batch_size * args.topk * factor)
    return budget + (-budget % OP_FUSER_ALIGNMENT)


def build_config(args: argparse.Namespace, world: int):
    """The ``TransformerConfig`` every arm uses (it builds without a GPU).

    Args:
        args: The command line.
        world: The number of ranks, which is the EP size.

    Returns:
        A Megatron-Core ``TransformerConfig``.
    """
    from megatron.core.activations import squared_relu
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=args.layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.hidden_size // 64,
        ffn_hidden_size=2 * args.hidden_size,
        num_moe_experts=args.experts_per_rank * world,
        moe_ffn_hidden_size=args.hidden_size,
        moe_router_topk=args.topk,
        moe_router_dtype="fp32",  # HybridEP takes fp32 probabilities (Megatron-Core casts others, with a warning)
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type="flex",
        moe_flex_dispatcher_backend="hybridep",
        moe_expert_rank_capacity_factor=capacity_factor(args, world),
        # Megatron-Core's requirement with the capacity factor and hybridep. Its fused grouped MLP asks for a grouped
        # GEMM and a fused activation: the weighted squared ReLU (SwiGLU would need the CuTe DSL kernels).
        use_transformer_engine_op_fuser=True,
        moe_grouped_gemm=True,
        gated_linear_unit=False,
        activation_func=squared_relu,
        use_fused_weighted_squared_relu=True,
        expert_model_parallel_size=world,
        bf16=True,
        params_dtype=torch.bfloat16,
        add_bias_linear=False,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        overlap_moe_expert_parallel_comm=True,  # Megatron-Core accepts it at build in bf16
        cuda_graph_impl="full_iteration",
        cuda_graph_warmup_steps=args.warmup_steps,
        deterministic_mode=args.deterministic,
    )


def masked_token_loss(loss_mask_BS: torch.Tensor, per_token_BS: torch.Tensor):
    """Megatron-Bridge's ``masked_next_token_loss`` shape: (masked loss sum, token count, what to log)."""
    mask = loss_mask_BS.reshape(-1).float()
    loss = torch.sum(per_token_BS.reshape(-1).float() * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.detach().view(1), num_tokens.float().view(1)])}


class ForwardStep:
    """Megatron-Bridge's ``forward_step`` for a dict batch (what ``FullCudaGraphWrapper``'s static buffers hold); its
    calls are counted: a replayed step runs no Python, so it is never called there."""

    def __init__(self):
        self.calls = 0

    def __call__(self, data_iterator, model, return_schedule_plan: bool = False):
        self.calls += 1
        batch = next(data_iterator)
        tokens, labels, loss_mask = batch["tokens"], batch["labels"], batch["loss_mask"]
        loss_func = partial(masked_token_loss, loss_mask)
        # No attention mask: the causal mask is the spec's (attn_mask_type causal); nothing built on the host.
        inputs = dict(labels=labels, loss_mask=loss_mask)
        if return_schedule_plan:
            return model.build_schedule_plan(tokens, batch["position_ids"], None, **inputs), loss_func
        return model(tokens, batch["position_ids"], None, **inputs), loss_func


def microbatches(args: argparse.Namespace, step: int, rank: int, device: torch.device) -> list[dict]:
    """Step ``step``'s microbatches on this rank: the same in every arm, other tokens on every step and rank."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + 100 * step + rank)
    shape = (args.micro_batch_size, args.seq_length + 1)
    out = []
    for _ in range(args.microbatches):
        ids = torch.randint(0, VOCAB, shape, generator=gen)
        labels = ids[:, 1:]
        batch = {
            "tokens": ids[:, :-1],
            "labels": labels,
            "loss_mask": (labels % 11 != 0).float(),  # some tokens do not count
            "position_ids": torch.arange(args.seq_length).expand(args.micro_batch_size, -1),
        }
        out.append({k: v.contiguous().to(device) for k, v in batch.items()})
    return out


@dataclass
class ArmResult:
    """What one arm left on this rank: per step, the losses ``[microbatches, 2]`` and the gradients; the final
    weights; ``forward_step`` calls per step; the comm ops our plan's lane ran in a paired step (forward of one
    microbatch beside the backward of another) in the last step that ran Python; with the graph: whether it existed
    after each step, its replays after the capture step, and the wrapper's iteration count."""

    losses: list[torch.Tensor] = field(default_factory=list)
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    calls: list[int] = field(default_factory=list)
    paired_comm: int = 0
    graph_after: list[bool] = field(default_factory=list)
    replays_after_capture: int = 0
    graph_changed: bool = False
    wrapper_iterations: int | None = None
    over_budget: bool = False


class Progress:
    """Where this rank is, for the failure line."""

    now = "setup"


def build_model(config, args: argparse.Namespace):
    """A ``GPTModel`` of ``config`` with Megatron-Core's Transformer Engine spec, on this rank's GPU, in bf16."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=True)
    model = GPTModel(
        config,
        transformer_layer_spec=spec,
        vocab_size=VOCAB,
        max_sequence_length=args.seq_length,
        position_embedding_type="rope",
    )
    return model.cuda().bfloat16()  # what Megatron's Float16Module does to the module


def _over_budget(model) -> bool:
    """Whether HybridEP dropped tokens over its budget in any MoE layer (its flag is sticky)."""
    flags = [
        manager.over_budget
        for module in model.modules()
        for manager in [getattr(getattr(module, "token_dispatcher", None), "_comm_manager", None)]
        if getattr(manager, "over_budget", None) is not None
    ]
    return bool(torch.stack(flags).any()) if flags else False


def run_arm(name: str, args, config, initial: dict, rank: int, graphed: bool) -> ArmResult:
    """One arm (see the module docstring): a fresh model with ``initial``'s weights, the hook, ``--steps`` steps.

    Args:
        name: The arm's name, for the failure line.
        args: The command line.
        config: The model config (:func:`build_config`).
        initial: Every parameter and floating buffer the model starts from, by name.
        rank: This rank (which data it trains on).
        graphed: Wrap the forward-backward function in Megatron-Core's ``FullCudaGraphWrapper``.

    Returns:
        What the arm left on this rank.
    """
    from megatron.bridge.training.ep_overlap.mcore import get_forward_backward_func, use_ep_overlap_schedule

    Progress.now = f"{name}: build"
    model = build_model(config, args)
    with torch.no_grad():
        for key, tensor in _state(model).items():
            tensor.copy_(initial[key])
    use_ep_overlap_schedule([model], timeout=timedelta(seconds=args.timeout_s))
    forward_backward = get_forward_backward_func()
    if graphed:
        from megatron.core.full_cuda_graph import FullCudaGraphWrapper

        # Its counters and graph are class attributes: this must be the process's first graphed run.
        if FullCudaGraphWrapper.curr_iteration["training"] or FullCudaGraphWrapper.cuda_graph["training"] is not None:
            raise RuntimeError("FullCudaGraphWrapper already holds a training graph in this process")
        forward_backward = FullCudaGraphWrapper(forward_backward, cuda_graph_warmup_steps=args.warmup_steps)
    params = list(model.named_parameters())
    optimizer = torch.optim.Adam([p for _, p in params], lr=LEARNING_RATE)
    forward_step = ForwardStep()
    device = next(model.parameters()).device
    result, graph, replays = ArmResult(), None, [0]
    for step in range(args.steps):
        Progress.now = f"{name}: step {step + 1}" + (" (capture)" if graphed and step == args.warmup_steps else "")
        for _, p in params:  # in place, as Bridge zeroes its grad buffers: a captured step accumulates into them
            if p.grad is not None:
                p.grad.zero_()
        calls = forward_step.calls
        store = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(microbatches(args, step, rank, device)),
            model=[model],
            num_microbatches=args.microbatches,
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            forward_only=False,
        )
        # A graph's outputs live in its pool and the next replay overwrites them: copy them now.
        result.losses.append(torch.stack([logged["lm loss"] for logged in store]).clone())
        result.grads.append({n: p.grad.detach().clone() for n, p in params if p.grad is not None})
        result.calls.append(forward_step.calls - calls)
        if result.calls[-1]:  # our plan ran (a replay runs no Python, so its recorder keeps the capture step's)
            result.paired_comm = sum(r.phase == "paired" for r in model.build_schedule_plan.recorder.comm)
        if graphed:
            now = FullCudaGraphWrapper.cuda_graph["training"]
            result.graph_after.append(now is not None)
            if graph is None and now is not None:  # the capture step: count the replays from here on
                graph = now
                original = graph.replay

                def counted_replay(original=original):
                    replays[0] += 1
                    return original()

                graph.replay = counted_replay
            result.graph_changed |= graph is not None and now is not graph
        optimizer.step()
    Progress.now = f"{name}: after the steps"
    torch.cuda.synchronize()
    result.weights = {n: p.detach().clone() for n, p in params}
    result.over_budget = _over_budget(model)
    if graphed:
        result.replays_after_capture = replays[0]
        result.wrapper_iterations = FullCudaGraphWrapper.curr_iteration["training"]
    return result


def _state(model) -> dict[str, torch.Tensor]:
    """Every parameter and floating buffer, by name: what makes two builds the same model."""
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if b.is_floating_point()})
    return tensors


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as raw bits (an integer view of the same width) where it is floating point."""
    return t.view(_INT_OF_WIDTH[t.element_size()]) if t.is_floating_point() else t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _difference(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    return f"max |diff| {(a.double() - b.double()).abs().max().item():.3g}"


def compare(mine: ArmResult, eager: ArmResult) -> dict:
    """Where ``mine`` differs from ``eager`` bit for bit.

    Args:
        mine: The arm compared.
        eager: The reference arm.

    Returns:
        ``loss_steps`` (the 1-based steps whose losses differ), ``grads`` (how many step gradients differ or are in
        one arm only), ``weights`` (how many final weights differ) and ``first`` (the first difference in words).
    """
    out = {"loss_steps": [], "grads": 0, "weights": 0, "first": None}

    def note(text: str) -> None:
        out["first"] = out["first"] or text

    for step, (a, b) in enumerate(zip(mine.losses, eager.losses), start=1):
        if not same_bits(a, b):
            out["loss_steps"].append(step)
            note(f"step {step} losses {a[:, 0].tolist()} vs {b[:, 0].tolist()}")
    for step, (grads, reference) in enumerate(zip(mine.grads, eager.grads), start=1):
        if grads.keys() != reference.keys():
            out["grads"] += len(grads.keys() ^ reference.keys())
            note(f"step {step}: gradients of {sorted(grads.keys() ^ reference.keys())[:3]} in one arm only")
        for name in grads.keys() & reference.keys():
            if not same_bits(grads[name], reference[name]):
                out["grads"] += 1
                note(f"step {step} gradient of {name}: {_difference(grads[name], reference[name])}")
    for name, weight in eager.weights.items():
        if not same_bits(mine.weights[name], weight):
            out["weights"] += 1
            note(f"final weight {name}: {_difference(mine.weights[name], weight)}")
    return out


def _nonfinite(result: ArmResult) -> str | None:
    for step, losses in enumerate(result.losses, start=1):
        if not torch.isfinite(losses).all():
            return f"step {step} losses {losses[:, 0].tolist()}"
    for step, grads in enumerate(result.grads, start=1):
        for name, grad in grads.items():
            if not torch.isfinite(grad).all():
                return f"step {step} gradient of {name}"
    return None


def replay_problems(graphed: ArmResult, args: argparse.Namespace) -> list[str]:
    """What says the graphed arm did not run as warm-up, capture, replays (empty: it did)."""
    n, w, m = args.steps, args.warmup_steps, args.microbatches
    problems = []
    if graphed.graph_after != [False] * w + [True] * (n - w):
        problems.append(f"graph present after each step {graphed.graph_after}, expected none in the first {w}")
    if graphed.calls != [m] * (w + 1) + [0] * (n - w - 1):
        problems.append(f"forward_step calls per step {graphed.calls}, expected {m} in the first {w + 1}, then 0")
    if graphed.replays_after_capture != n - w - 1:
        problems.append(f"{graphed.replays_after_capture} replays after the capture step, expected {n - w - 1}")
    if graphed.graph_changed:
        problems.append("the wrapper's graph was replaced after the capture step")
    if graphed.wrapper_iterations != n:
        problems.append(f"the wrapper counted {graphed.wrapper_iterations} iterations, expected {n}")
    return problems


def _differs(diff: dict) -> bool:
    return bool(diff["loss_steps"] or diff["grads"] or diff["weights"])


def _diff_words(summaries: list[dict], key: str) -> str:
    """The worst rank's difference in words."""
    worst = max(summaries, key=lambda s: len(s[key]["loss_steps"]) + s[key]["grads"] + s[key]["weights"])
    d = worst[key]
    parts = [f"losses of steps {d['loss_steps']}"] if d["loss_steps"] else []
    parts += [f"{d[k]} {words}" for k, words in (("grads", "gradients"), ("weights", "final weights")) if d[k]]
    return f"rank {worst['rank']} differs from eager: {', '.join(parts)}; first: {d['first']}"


def _span(first: int, last: int) -> str:
    return f"step {first}" if first == last else f"steps {first}-{last}"


def report(summaries: list[dict], args: argparse.Namespace, world: int, factor: float) -> tuple[list[str], bool]:
    """Rank 0's lines from every rank's summary.

    Args:
        summaries: Each rank's summary (what ``_check`` gathers), rank 0 first.
        args: The command line.
        world: The number of ranks.
        factor: HybridEP's capacity factor.

    Returns:
        The lines (the setup, one per arm, the verdict) and whether the check passed.
    """
    n, w, m = args.steps, args.warmup_steps, args.microbatches
    first = summaries[0]
    failures = [
        f"rank {s['rank']}: eager produced non-finite numbers ({s['nonfinite']})" for s in summaries if s["nonfinite"]
    ]
    dropped = [s["rank"] for s in summaries if s["over_budget"]]
    lines = [
        f"full-iteration graph check: {world} ranks (EP {world}), GPTModel (Transformer Engine spec, op fuser), "
        f"{args.layers} MoE layers x {args.experts_per_rank * world} experts, top-{args.topk}, HybridEP capacity "
        f"factor {factor:g} ({permuted_budget(args, factor)} rows per rank), bf16, {m} microbatches x {n} steps",
        f"eager:   {n} steps; rank 0 loss per step {first['eager_losses']}; {first['grad_count']} gradients per step; "
        f"our plan's lane ran {first['paired_comm']} comm ops in paired steps; tokens over HybridEP's budget: "
        f"{'on ranks ' + str(dropped) if dropped else 'none'}",
    ]
    if m > 1:  # with one microbatch nothing pairs
        failures += [
            f"rank {s['rank']}: our plan ran no paired step (is the hook installed, the overlap on?)"
            for s in summaries
            if not s["paired_comm"]
        ]
    repeat_differs = any(s["repeat"] is not None and _differs(s["repeat"]) for s in summaries)
    if first["repeat"] is not None:
        same = "bitwise equal to eager on every rank and step"
        lines.append(
            "repeat:  eager again, same weights and data: "
            + (_diff_words(summaries, "repeat") if repeat_differs else same)
        )
    graph_differs = any(_differs(s["graphed"]) for s in summaries)
    outcome = (
        _diff_words(summaries, "graphed")
        if graph_differs
        else "losses, gradients, final weights bitwise equal to eager"
    )
    lines.append(
        f"graphed: FullCudaGraphWrapper warm-up {w}: {_span(1, w)} eager, step {w + 1} captured (no host sync in it: "
        f"CUDA refuses one during capture) and replayed, {_span(w + 2, n)} replayed only (forward_step calls per step "
        f"{first['calls']}, {first['replays']} replays counted, wrapper at iteration {first['iterations']}); {outcome}"
    )
    failures += [f"rank {s['rank']}: {problem}" for s in summaries for problem in s["replay_problems"]]
    if graph_differs and repeat_differs:
        failures.append(
            "the graphed arm differs from eager, but so does eager from itself (the repeat arm): kernel "
            "nondeterminism hides whether the graph is at fault; rerun with --deterministic"
        )
    elif graph_differs:
        failures.append("the graphed arm's numbers differ from eager's, which is bitwise reproducible")
    lines.append("PASS" if not failures else "FAIL: " + "; ".join(failures))
    return lines, not failures


def _check(args: argparse.Namespace) -> int:
    """Every arm on this rank, the ranks' summaries gathered; rank 0 prints. Returns the exit status."""
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(
        "nccl", timeout=timedelta(seconds=args.timeout_s), device_id=torch.device("cuda", local_rank)
    )
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(expert_model_parallel_size=world)
    torch.manual_seed(args.seed)
    # Graph-safe generator states, as Bridge seeds them for CUDA graphs: the wrapper registers them with the graph.
    model_parallel_cuda_manual_seed(args.seed, use_cudagraphable_rng=True)
    config = build_config(args, world)
    factor = config.moe_expert_rank_capacity_factor

    # Every arm starts from these weights (one build's), each in a model of its own.
    reference = build_model(config, args)
    initial = {k: v.detach().clone() for k, v in _state(reference).items()}
    del reference
    eager = run_arm("eager", args, config, initial, rank, graphed=False)
    repeat = None if args.no_repeat else run_arm("repeat", args, config, initial, rank, graphed=False)
    graphed = run_arm("graphed", args, config, initial, rank, graphed=True)

    Progress.now = "comparing"
    per_step = [(losses[:, 0].sum() / losses[:, 1].sum().clamp(min=1)).item() for losses in eager.losses]
    summary = {
        "rank": rank,
        "eager_losses": [round(x, 4) for x in per_step],
        "grad_count": len(eager.grads[-1]),
        "paired_comm": eager.paired_comm,
        "over_budget": eager.over_budget or graphed.over_budget,
        "nonfinite": _nonfinite(eager),
        "repeat": None if repeat is None else compare(repeat, eager),
        "graphed": compare(graphed, eager),
        "replay_problems": replay_problems(graphed, args),
        "calls": graphed.calls,
        "replays": graphed.replays_after_capture,
        "iterations": graphed.wrapper_iterations,
    }
    summaries: list = [None] * world
    dist.all_gather_object(summaries, summary)
    lines, passed = report(summaries, args, world, factor)
    if rank == 0:
        print("\n".join(lines), flush=True)
    dist.barrier()
    return 0 if passed else 1


def main(argv: list[str] | None = None) -> int:
    """Parses, skips or runs the check.

    Args:
        argv: The arguments (None: ``sys.argv[1:]``).

    Returns:
        0 after a skip (its one line printed). A run does not return: it ends the process with its status (0 PASS,
        1 FAIL), without finalizers (see the end of the function).
    """
    args = parse_args(argv)
    # Before Transformer Engine is imported (skip_reason does) and cuBLAS starts: Transformer Engine's deterministic
    # attention backward, one fixed cuBLAS workspace size, in every arm.
    os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        # Before the checks below query the GPU (and import Transformer Engine): each rank's context on its own GPU.
        torch.cuda.set_device(local_rank)
    reason = skip_reason()
    if reason is not None:
        if int(os.environ.get("RANK", "0")) == 0:
            print(SKIP_PREFIX + reason, flush=True)
        return 0
    rank = os.environ.get("RANK", "?")
    try:
        status = _check(args)
    except BaseException as exc:  # any failure, an interrupt included, ends the run as FAIL
        hint = ""
        if "captur" in str(exc).lower():
            hint = (
                " (the captured step made a call CUDA forbids during stream capture: a host synchronisation such as "
                ".item(), .tolist(), .cpu() of a device tensor, synchronize(), a blocking copy; the traceback shows "
                "where)"
            )
        print(f"FAIL: rank {rank}, {Progress.now}: {type(exc).__name__}: {exc}{hint}", flush=True)
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without finalizers: torchrun ends the other ranks when one exits non-zero, and a finalizer of HybridEP's
    # IPC buffers or NCCL's communicators could wait on a peer that has gone, holding the verdict hostage.
    os._exit(status)


if __name__ == "__main__":
    sys.exit(main())
