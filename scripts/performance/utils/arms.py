"""One arm of a run, on one rank: build the model, train ``max_steps`` steps, measure and record.

Every arm uses the same seed and the same data (tokens depend only on seed, rank, step and microbatch), so
the baseline and overlap arms differ only in the overlap knobs.
"""

import dataclasses
import hashlib
import os
import resource
import time
from dataclasses import dataclass, replace
from datetime import timedelta

import torch
import torch.distributed as dist

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel, build_pipeline_chunks
from ep_overlap_lab.multiprocess import init_ep_groups, report_progress
from ep_overlap_lab.step_stats import records_as_dict, step_intervals
from megatron.bridge.training.ep_overlap import EPOverlapOptions


@dataclass
class ArmSpec:
    """What one arm runs: a finalized model config, the schedule's options and the training settings."""

    name: str
    model: MoEGPTConfig
    options: EPOverlapOptions
    train: object  # TrainConfig
    device: str
    progress: bool = True  # rank 0 prints each finished step (under torchrun; a local run's parent prints them)
    model_impl: str = "reference"
    profile_dir: str | None = None  # one more step per arm, profiled, its trace written here (not in the statistics)
    pipeline_schedule: str | None = None  # a Megatron-Core pipeline's (utils/mcore_pipeline.py); None at PP 1


def microbatches(spec: ArmSpec, rank: int, step: int, device: torch.device):
    """Deterministic synthetic next-token data for (seed, rank, step)."""
    train, cfg = spec.train, spec.model
    gen = torch.Generator().manual_seed(((train.seed * 65_537 + rank) * 65_537 + step) % (2**63))
    shape = (train.micro_batch_size, cfg.seq_length + 1)
    out = []
    for _ in range(train.num_microbatches):
        seq = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        out.append((seq[:, :-1].to(device), seq[:, 1:].to(device)))
    return out


def _digest(chunks: list) -> str:
    sha = hashlib.sha256()
    named = [item for chunk in chunks for item in getattr(chunk, "global_named_parameters", chunk.named_parameters)()]
    for name, param in sorted(named, key=lambda item: item[0]):
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def timed_step(arm, run):
    """``run()`` as one measured step of ``arm``, then its optimizer's step: every rank starts together; the step's
    time, the host's wait for a core and the device's peak memory go on ``arm``. Returns what ``run`` returned."""
    device = arm.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()  # start every step together
    waited_before = host_waited_for_core_s()
    start = time.perf_counter()
    result = run()
    arm.optimizer.step()
    arm.optimizer.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    arm.step_times.append(time.perf_counter() - start)
    waited_after = host_waited_for_core_s()
    if waited_before is not None and waited_after is not None:
        arm.host_waited.append(waited_after - waited_before)
    arm.peak_mb = max(arm.peak_mb, _peak_memory_mb(device))
    return result


def host_waited_for_core_s() -> float | None:
    """Seconds the calling thread has so far been ready to run but waited for a core (Linux's schedstat); None
    where it is not available. On a CPU with no spare core this is the overlap tax of CPU communication made
    visible: gloo's and the kernel's work preempting the host's compute instead of filling its idle waits."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            _, waiting_ns, _ = f.read().split()
    except (OSError, ValueError):
        return None
    return int(waiting_ns) / 1e9


def build_mcore_model(config, device: torch.device | str, vp_stage: int | None = None, **chunk) -> torch.nn.Module:
    """The Megatron-Core model of the recipe's config: a ``HybridModel`` of ``config.hybrid_layer_pattern`` (Megatron-
    Core's Transformer Engine spec, the only one it ships), else a ``GPTModel`` from local specs, with
    ``config.mtp_num_layers`` MTP layers like its last decoder layer; with ``vp_stage`` and ``chunk``
    (``pre_process``, ``post_process``, ``pg_collection``) one pipeline chunk of the GPTModel. Seed the RNGs first."""
    if config.hybrid_layer_pattern is not None:
        from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
        from megatron.core.models.hybrid.hybrid_model import HybridModel

        model = HybridModel(
            config,
            hybrid_stack_spec=hybrid_stack_spec,
            vocab_size=config.vocab_size,
            max_sequence_length=config.seq_length,
            hybrid_layer_pattern=config.hybrid_layer_pattern,
            position_embedding_type="learned_absolute",
        )
    else:
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec

        layers = get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
        mtp = None
        if config.mtp_num_layers:
            mtp = get_gpt_mtp_block_spec(
                config, layers.layer_specs[-1], use_transformer_engine=False, vp_stage=vp_stage
            )
        model = GPTModel(
            config,
            transformer_layer_spec=layers,
            mtp_block_spec=mtp,
            vocab_size=config.vocab_size,
            max_sequence_length=config.seq_length,
            position_embedding_type="learned_absolute",
            share_embeddings_and_output_weights=False,
            vp_stage=vp_stage,
            **chunk,
        )
    model = model.to(device)
    return model.bfloat16() if config.bf16 else model


def build_mcore_plan(spec: ArmSpec, timeout: timedelta):
    """:func:`build_mcore_model` on this rank's GPU, its plan, and its EP groups."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.bridge.training.ep_overlap.mcore import chunk_for, mcore_ep_groups

    config = spec.model
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=config.expert_model_parallel_size)
    torch.manual_seed(spec.train.seed)
    model_parallel_cuda_manual_seed(spec.train.seed)
    model = build_mcore_model(config, torch.device("cuda", torch.cuda.current_device()))
    return chunk_for(model, delay_wgrad=spec.options.delay_wgrad), mcore_ep_groups(timeout)


def step_line(report: dict, max_steps: int) -> str:
    """The console line of one finished step (a rank's progress report)."""
    exposed = report["exposed_comm_s"]
    return (
        f"  [{report['arm']}] step {report['step']}/{max_steps}: {report['step_time_s']:.3f} s, "
        f"loss {report['loss']:.4f}, exposed comm " + ("n/a" if exposed is None else f"{exposed:.3f} s")
    )


def arm_order(step: int, names: list[str]) -> list[str]:
    """The order the arms run in at ``step``: A B, then B A, and so on (ABBA), so a drift over time (thermal,
    other load) weighs on both arms alike instead of counting as a difference between them."""
    return names if step % 2 == 0 else names[::-1]


class _Arm:
    """One arm on this rank: its own model replica (same seed: identical weights), engine and optimizer."""

    def __init__(self, spec: ArmSpec, rank: int, device: torch.device):
        timeout = timedelta(seconds=spec.train.collective_timeout_s)
        pipeline = spec.model.pipeline_model_parallel_size or 1
        if spec.model_impl == "mcore":
            self.model, groups = build_mcore_plan(spec, timeout)
            self.chunks = [self.model]
        else:
            groups = init_ep_groups(spec.model.expert_model_parallel_size, timeout, pipeline_size=pipeline)
            if pipeline > 1:
                self.chunks = [
                    c.to(device) for c in build_pipeline_chunks(spec.model, groups, spec.train.seed, groups.pp_rank)
                ]
                self.model = self.chunks
            else:
                self.model = MoEGPTModel(spec.model, groups, seed=spec.train.seed).to(device)
                self.chunks = [self.model]
        self.spec, self.rank, self.device = spec, rank, device
        # The stages of one pipeline see the same data; the replicas of a stage different data.
        self.data_rank = rank % (dist.get_world_size() // pipeline)
        self.engine = EPOverlapEngine(self.model, groups, spec.options)
        self.optimizer = torch.optim.Adam([p for chunk in self.chunks for p in chunk.parameters()], lr=spec.train.lr)
        self.step_times, self.losses, self.loss_bits, self.comm, self.exposed = [], [], [], [], []
        self.host_waited: list[float] = []  # per step: the host thread runnable but not on a core (Linux)
        self.peak_mb, self.timeline, self.records = 0.0, None, []
        self.activation_peaks: list[int] = []  # per step: the most held for backward at once (bytes)

    def step(self, step: int) -> None:
        spec, device = self.spec, self.device
        data = microbatches(spec, self.data_rank, step, device)
        result = timed_step(self, lambda: self.engine.step(data))
        self.activation_peaks.append(result.activation_peak_bytes)
        # Only the last pipeline stage has losses.
        loss = torch.stack(result.losses).sum().reshape(1) if result.losses else torch.zeros(1, device=device)
        self.loss_bits.append(loss.detach().cpu().clone())
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        self.losses.append(global_loss.item())
        self.comm.append(result.stats.comm_s)
        self.exposed.append(result.stats.exposed_comm_s)
        comm_iv, compute_iv = step_intervals(result.recorder)
        self.timeline = {"comm": comm_iv, "compute": compute_iv, "comm_ops": [r.op for r in result.recorder.comm]}
        self.records.append(records_as_dict(result.recorder))
        report = {
            "arm": spec.name, "step": step + 1, "step_time_s": self.step_times[-1], "loss": self.losses[-1],
            "comm_s": self.comm[-1], "exposed_comm_s": self.exposed[-1],
        }  # fmt: skip
        report_progress(report)
        if spec.progress and self.rank == 0:
            print(step_line(report, spec.train.max_steps), flush=True)

    def profiled_step(self, step: int) -> None:
        """One more step, after the measured ones, under torch's profiler (host, and CUDA where it runs); rank 0
        writes its Chrome trace. Nothing of it enters the statistics; both arms take it, so they stay matched."""
        from torch.profiler import ProfilerActivity, profile, record_function

        spec, device = self.spec, self.device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        data = microbatches(spec, self.data_rank, step, device)
        dist.barrier()
        with profile(activities=activities) as profiler, record_function(f"ProfilerStep#{step + 1}"):
            self.engine.step(data)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
        if self.rank == 0:
            self.trace = os.path.join(spec.profile_dir, f"{spec.name}.json")
            profiler.export_chrome_trace(self.trace)

    def result(self) -> dict:
        launches_off_host = self.engine.launches_off_host(self.device)
        return {
            "rank": self.rank,
            "step_times_s": self.step_times,
            "losses": self.losses,
            "loss_bits": self.loss_bits,
            "comm_s": self.comm,
            "exposed_comm_s": self.exposed,
            "host_waited_for_core_s": self.host_waited or None,
            "timeline": self.timeline,
            "records": self.records,
            "peak_memory_mb": self.peak_mb,
            "activation_peak_bytes": self.activation_peaks,
            "param_digest": _digest(self.chunks),
            "delay_wgrad": self.spec.options.delay_wgrad,
            "attention_wgrad_window": self.engine.attention_wgrad_window,  # as run (auto: as chosen)
            "placement": self.engine.placement.describe() if self.engine.placement else None,
            "launch_off_host": launches_off_host,  # as run (auto: whether it applied)
            "options": dataclasses.asdict(replace(self.engine.options, launch_off_host=launches_off_host)),
            "profile_trace": getattr(self, "trace", None),  # rank 0's, with --profile
        }


def run_arms(rank: int, world: int, specs: list[ArmSpec]) -> dict[str, dict]:
    """Trains every arm on this rank, step by step in ABBA order; returns each arm's measurements.

    The arms share the ranks, the data of each step, and the seed: only the overlap knobs differ. On CPU the
    peak memory is the process's (both replicas together); on CUDA it is each arm's own steps' peak.
    """
    device = torch.device("cuda", torch.cuda.current_device()) if specs[0].device == "cuda" else torch.device("cpu")
    from utils.mcore_pipeline import McorePipelineArm

    arms = {spec.name: (McorePipelineArm if spec.pipeline_schedule else _Arm)(spec, rank, device) for spec in specs}
    steps = specs[0].train.max_steps
    for step in range(steps):
        for name in arm_order(step, list(arms)):
            arms[name].step(step)
    if specs[0].profile_dir:
        for name in arm_order(steps, list(arms)):
            arms[name].profiled_step(steps)
    return {name: arm.result() for name, arm in arms.items()}
