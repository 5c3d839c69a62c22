"""One arm of a run, on one rank: build the model, train ``max_steps`` steps, measure and record.

Every arm uses the same seed and the same data (tokens depend only on seed, rank, step and microbatch), so
the baseline and overlap arms differ only in the overlap knobs.
"""

import hashlib
import resource
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron.bridge.models.moe_gpt import MoEGPTConfig, MoEGPTModel
from megatron.bridge.training.ep_overlap import EPOverlapEngine
from megatron.bridge.utils.multiprocess import report_progress
from megatron.bridge.utils.process_groups import init_ep_groups


@dataclass
class ArmSpec:
    """What one arm runs: a finalized model config, the overlap knobs and the training settings."""

    name: str
    model: MoEGPTConfig
    overlap: bool
    delay_wgrad: bool
    train: object  # TrainConfig
    device: str
    progress: bool = True
    model_impl: str = "reference"


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


def _digest(model: torch.nn.Module) -> str:
    sha = hashlib.sha256()
    for name, param in model.named_parameters():
        sha.update(name.encode())
        sha.update(param.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def build_mcore_plan(spec: ArmSpec, timeout: timedelta):
    """A Megatron-Core GPTModel (local specs) from the recipe's config, on this rank's GPU, and its EP groups."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron.bridge.training.ep_overlap.mcore import McoreGPTPlan, mcore_ep_groups

    config = spec.model
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(expert_model_parallel_size=config.expert_model_parallel_size)
    torch.manual_seed(spec.train.seed)
    model_parallel_cuda_manual_seed(spec.train.seed)
    model = GPTModel(
        config,
        transformer_layer_spec=get_gpt_decoder_block_spec(config, use_transformer_engine=False),
        vocab_size=config.vocab_size,
        max_sequence_length=config.seq_length,
        position_embedding_type="learned_absolute",
        share_embeddings_and_output_weights=False,
    ).cuda()
    if config.bf16:
        model = model.bfloat16()
    return McoreGPTPlan(model, delay_wgrad=spec.delay_wgrad), mcore_ep_groups(timeout)


def run_arm(rank: int, world: int, spec: ArmSpec) -> dict:
    """Trains one arm on this rank; returns step times, losses, comm stats, timeline and a parameter digest."""
    device = torch.device("cuda", torch.cuda.current_device()) if spec.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timeout = timedelta(seconds=spec.train.collective_timeout_s)
    if spec.model_impl == "mcore":
        model, groups = build_mcore_plan(spec, timeout)
    else:
        groups = init_ep_groups(spec.model.expert_model_parallel_size, timeout)
        model = MoEGPTModel(spec.model, groups, seed=spec.train.seed).to(device)
    engine = EPOverlapEngine(model, groups, overlap=spec.overlap, delay_wgrad=spec.delay_wgrad)
    optimizer = torch.optim.Adam(model.parameters(), lr=spec.train.lr)
    step_times, losses, loss_bits, comm, exposed, timeline = [], [], [], [], [], None
    for step in range(spec.train.max_steps):
        data = microbatches(spec, rank, step, device)
        dist.barrier()  # start every step together
        start = time.perf_counter()
        result = engine.step(data)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        step_times.append(time.perf_counter() - start)
        loss = torch.stack(result.losses).sum().reshape(1)
        loss_bits.append(loss.detach().cpu().clone())
        global_loss = loss.detach().clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item())
        comm.append(result.stats.comm_s)
        exposed.append(result.stats.exposed_comm_s)
        comm_iv, compute_iv = result.recorder.intervals()
        timeline = {"comm": comm_iv, "compute": compute_iv, "comm_ops": [r.op for r in result.recorder.comm]}
        report_progress(
            {"arm": spec.name, "step": step + 1, "step_time_s": step_times[-1], "loss": losses[-1],
             "comm_s": comm[-1], "exposed_comm_s": exposed[-1]}
        )  # fmt: skip
        if spec.progress and rank == 0:
            print(
                f"  [{spec.name}] step {step + 1}/{spec.train.max_steps}: {step_times[-1]:.3f} s, "
                f"loss {losses[-1]:.4f}, exposed comm {exposed[-1]:.3f} s",
                flush=True,
            )
    return {
        "rank": rank,
        "step_times_s": step_times,
        "losses": losses,
        "loss_bits": loss_bits,
        "comm_s": comm,
        "exposed_comm_s": exposed,
        "timeline": timeline,
        "peak_memory_mb": _peak_memory_mb(device),
        "param_digest": _digest(model),
    }
