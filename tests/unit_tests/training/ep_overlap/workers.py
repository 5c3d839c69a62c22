"""Per-rank training loops shared by the engine tests (run under run_local_ranks)."""

from dataclasses import dataclass, field
from datetime import timedelta

import torch

from ep_overlap_lab.engine import EPOverlapEngine
from ep_overlap_lab.moe_gpt import MoEGPTConfig, MoEGPTModel

from .halves import as_units, summed_per_microbatch
from .local_ranks import init_ep_groups

# overlap off; overlap on; overlap on with delayed wgrad; the same with edge pairing (and, where a case adds it,
# the attention wgrad in window 2)
ARMS = ("plain", "overlap", "delayed", "delayed_edges")


@dataclass(frozen=True)
class Case:
    world: int = 2
    ep: int = 2
    bf16: bool = False
    topk: int = 2
    microbatches: int = 4
    layer_freq: tuple = (1, 0, 1)
    experts: int = 4
    seq_length: int = 8
    micro_batch_size: int = 2
    steps: int = 3
    main_grad: bool = False
    arms: tuple = ARMS
    timeout_s: float = 30.0
    same_data_every_step: bool = False
    extra: dict = field(default_factory=dict)

    def config(self) -> MoEGPTConfig:
        return MoEGPTConfig(
            num_layers=len(self.layer_freq),
            hidden_size=32,
            num_attention_heads=2,
            ffn_hidden_size=48,
            num_moe_experts=self.experts,
            moe_ffn_hidden_size=16,
            moe_router_topk=self.topk,
            moe_router_pre_softmax=self.topk == 1,
            moe_layer_freq=list(self.layer_freq),
            expert_model_parallel_size=self.ep,
            seq_length=self.seq_length,
            vocab_size=64,
            add_bias_linear=False,
            gated_linear_unit=True,
            bf16=self.bf16,
            **self.extra,
        )


def batches(case: Case, rank: int, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 * (0 if case.same_data_every_step else step) + rank)
    shape = (case.micro_batch_size, case.seq_length)
    return [
        (torch.randint(0, 64, shape, generator=gen), torch.randint(0, 64, shape, generator=gen))
        for _ in range(case.microbatches)
    ]


def attach_main_grads(model: torch.nn.Module) -> None:
    """fp32 main_grad buffers fed the way Megatron's DDP feeds them: a hook moves each finished grad in."""

    def move(param):
        if param.grad is not None:
            param.main_grad.add_(param.grad)
            param.grad = None

    grouped = {id(m.weight): m for m in model.modules() if hasattr(m, "register_grad_ready_hook")}
    for param in model.parameters():
        param.main_grad = torch.zeros_like(param, dtype=torch.float32)
        if id(param) in grouped:
            grouped[id(param)].register_grad_ready_hook(move)
        else:
            param.register_post_accumulate_grad_hook(move)


def _grad(param):
    return param.main_grad if hasattr(param, "main_grad") else param.grad


def train_arms(rank: int, world: int, case: Case) -> dict:
    """Trains a fresh model per arm on identical data; returns per-arm losses, grads and final params.

    Arm names: ``plain``; ``overlap``; ``delayed`` (with delayed wgrad), suffixed ``_window2`` (attention wgrad in
    window 2), ``_auto`` (the engine places it), ``_edges`` (edge pairing), ``_chunks`` (chunked unpaired
    phases) or ``_onhost`` (every all-to-all launched on the host thread); ``plain_units`` is the plain
    path fed the halves chunking makes as microbatches of their own (its losses summed back per microbatch).
    """
    groups = init_ep_groups(case.ep, timedelta(seconds=case.timeout_s))
    out = {}
    for arm in case.arms:
        model = MoEGPTModel(case.config(), groups, seed=7)
        if case.main_grad:
            attach_main_grads(model)
        engine = EPOverlapEngine(
            model,
            groups,
            overlap=not arm.startswith("plain"),
            delay_wgrad=arm.startswith("delayed"),
            attention_wgrad_window={"delayed_window2": 2, "delayed_auto": None}.get(arm, 1),
            edge_pairing=arm.endswith("_edges"),
            moe_ep_overlap_chunks=2 if arm.endswith("chunks") else 1,
            launch_off_host=False if arm.endswith("_onhost") else None,
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses, grads, records = [], [], None
        for step in range(case.steps):
            data = batches(case, rank, step)
            if arm == "plain_units":
                split, plan = as_units(data)
                result = engine.step(split)
                losses.append(summed_per_microbatch(plan, result.losses))
            else:
                result = engine.step(data)
                losses.append(torch.stack(result.losses))
            grads.append({name: _grad(p).clone() for name, p in model.named_parameters()})
            records = result.recorder
            with torch.no_grad():
                for param in model.parameters():
                    if case.main_grad:
                        param.grad = param.main_grad.to(param.dtype)
                        param.main_grad.zero_()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        out[arm] = {
            "losses": losses,
            "grads": grads,
            "params": {name: p.detach().clone() for name, p in model.named_parameters()},
            "biases": {name: b.clone() for name, b in model.named_buffers() if name.endswith("expert_bias_E")},
            "comm": [vars(r) | {"launch": None, "done": None} for r in records.comm],
            "compute": [vars(r) | {"start": None, "end": None} for r in records.compute],
            "stats": vars(result.stats) | {"overlap_fraction": result.stats.overlap_fraction},
        }
    return out
