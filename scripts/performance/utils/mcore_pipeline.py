"""One harness arm of a Megatron-Core pipeline (``--model_impl mcore`` with ``--pipeline_model_parallel_size`` >= 2).

The rank's ``GPTModel`` chunks for ``--pipeline_schedule``: one (1F1B), one per virtual stage (interleaved), or
DualPipeV's stages r and 2P-1-r (``dualpipev_chunks``), as plans; each step is one call of the forward-backward
function the EP-overlap adapter picks (``ep_overlap.mcore.get_forward_backward_func``: Megatron-Core's schedules,
ours where it has no EP overlap, ``forward_backward_dualpipev`` for the V). Measured per step: the step time, the
losses (on the loss's rank), and the activations held for backward at once (saved tensors, counted as the engine
counts them); the comm figures of the engine's recorder are not kept here (n/a in the table).
"""

from datetime import timedelta

import torch
import torch.distributed as dist

from ep_overlap_lab.engine.saved import SavedActivations


def init_parallel_state(config, schedule: str) -> None:
    """Megatron-Core's parallel state for the recipe's pipeline, once per process (the arms share it); DualPipeV's
    embedding group is the V's (``dualpipev_embedding_ranks``: rank 0 holds both ends)."""
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore.dualpipev import dualpipev_embedding_ranks

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            pipeline_model_parallel_size=config.pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size=config.virtual_pipeline_model_parallel_size,
            expert_model_parallel_size=config.expert_model_parallel_size,
            get_embedding_ranks=dualpipev_embedding_ranks if schedule == "dualpipev" else None,
        )


def build_chunks(config, schedule: str, device: torch.device) -> list[torch.nn.Module]:
    """This rank's chunks of ``config``'s model for ``schedule`` (see the module docstring)."""
    from megatron.core import parallel_state

    from megatron.bridge.training.ep_overlap.mcore.dualpipev import dualpipev_chunks
    from utils.arms import build_mcore_model

    if schedule == "dualpipev":
        return dualpipev_chunks(lambda **chunk: build_mcore_model(config, device, **chunk), config)
    stages = range(config.virtual_pipeline_model_parallel_size) if schedule == "interleaved" else [None]
    return [
        build_mcore_model(
            config,
            device,
            vp_stage=v,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=v is None, vp_stage=v),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=v is None, vp_stage=v),
        )
        for v in stages
    ]


def token_loss(per_token_BS: torch.Tensor):
    """Megatron-Bridge's loss-function shape: (token-summed loss, token count, what to log)."""
    loss = per_token_BS.float().sum()
    count = torch.tensor(per_token_BS.numel(), dtype=torch.int)
    return loss, count, {"lm loss": torch.cat([loss.detach().view(1), count.view(1).float()])}


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """Megatron-Bridge's forward-step shape over the harness's (tokens, labels) microbatches."""
    tokens, labels = next(data_iterator)
    seq = tokens.shape[1]
    position_ids = torch.arange(seq, device=tokens.device)[None].expand_as(tokens)
    attention_mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=tokens.device), diagonal=1)[None, None]
    if return_schedule_plan:
        return model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels), token_loss
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, labels=labels), token_loss


class McorePipelineArm:
    """One arm on this rank: its own chunks (same seed: identical weights in every arm), optimizer and schedule."""

    def __init__(self, spec, rank: int, device: torch.device):
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        from megatron.bridge.training.ep_overlap.mcore import (
            chunk_for,
            get_forward_backward_func,
            use_ep_overlap_schedule,
        )

        config, self.spec, self.rank, self.device = spec.model, spec, rank, device
        init_parallel_state(config, spec.pipeline_schedule)
        torch.manual_seed(spec.train.seed)
        if device.type == "cuda":  # Megatron-Core's CUDA RNG tracker (CPU: the tests' stand-ins have none)
            model_parallel_cuda_manual_seed(spec.train.seed)
        self.schedule = spec.pipeline_schedule
        built = build_chunks(config, self.schedule, device)
        self.chunks = [chunk_for(m, delay_wgrad=spec.options.delay_wgrad).model for m in built]
        chunk_config = self.chunks[0].config
        if dist.get_backend(parallel_state.get_pipeline_model_parallel_group()) == "gloo":
            chunk_config.batch_p2p_comm, chunk_config.overlap_p2p_comm = False, False  # gloo: unbatched P2P
        chunk_config.overlap_moe_expert_parallel_comm = spec.options.overlap
        chunk_config.delay_wgrad_compute = spec.options.delay_wgrad
        if spec.options.overlap:
            use_ep_overlap_schedule(self.chunks, timeout=timedelta(seconds=spec.train.collective_timeout_s))
        if self.schedule == "dualpipev":
            chunk_config.ep_overlap_pipeline_schedule = "dualpipev"
        P, V = config.pipeline_model_parallel_size, config.virtual_pipeline_model_parallel_size
        self.forward_backward = get_forward_backward_func(pp_size=P, vp_size=V if self.schedule != "1f1b" else None)
        self.parameters = [p for chunk in self.chunks for p in chunk.parameters()]
        self.optimizer = torch.optim.Adam(self.parameters, lr=spec.train.lr)
        # The stages of one pipeline see the same data; the replicas of a stage different data.
        self.data_rank = parallel_state.get_data_parallel_rank()
        self.step_times, self.losses, self.loss_bits, self.activation_peaks = [], [], [], []
        self.host_waited: list[float] = []
        self.peak_mb = 0.0

    def step(self, step: int) -> None:
        from utils.arms import microbatches, step_line, timed_step

        spec, device = self.spec, self.device
        data = microbatches(spec, self.data_rank, step, device)
        iterators = [iter(list(data)) for _ in self.chunks] if len(self.chunks) > 1 else iter(data)

        def run():
            with SavedActivations(self.parameters) as saved:
                store = self.forward_backward(
                    forward_step_func=forward_step, data_iterator=iterators, model=self.chunks,
                    num_microbatches=spec.train.num_microbatches, seq_length=spec.model.seq_length,
                    micro_batch_size=spec.train.micro_batch_size,
                )  # fmt: skip
            return store, saved.peak_bytes

        store, activation_peak = timed_step(self, run)
        self.activation_peaks.append(activation_peak)
        # Only the loss's rank has losses: the step's token-summed loss.
        loss = torch.stack([logged["lm loss"][0] for logged in store]).sum().reshape(1) if store else torch.zeros(1)
        self.loss_bits.append(loss.detach().cpu().clone())
        global_loss = loss.detach().clone().to(device)
        dist.all_reduce(global_loss)
        self.losses.append(global_loss.item())
        report = {"arm": spec.name, "step": step + 1, "step_time_s": self.step_times[-1], "loss": self.losses[-1],
                  "comm_s": None, "exposed_comm_s": None}  # fmt: skip
        from ep_overlap_lab.multiprocess import report_progress

        report_progress(report)
        if spec.progress and self.rank == 0:
            print(step_line(report, spec.train.max_steps), flush=True)

    def result(self) -> dict:
        from utils.arms import _digest

        steps = len(self.step_times)
        return {
            "rank": self.rank,
            "step_times_s": self.step_times,
            "losses": self.losses,
            "loss_bits": self.loss_bits,
            "comm_s": [None] * steps,
            "exposed_comm_s": [None] * steps,
            "host_waited_for_core_s": self.host_waited or None,
            "timeline": None,
            "records": [],
            "peak_memory_mb": self.peak_mb,
            "activation_peak_bytes": self.activation_peaks,
            "param_digest": _digest(self.chunks),
            "delay_wgrad": self.spec.options.delay_wgrad,
            "attention_wgrad_window": None,
            "placement": None,
            "launch_off_host": False,
            "options": {"overlap": self.spec.options.overlap, "delay_wgrad": self.spec.options.delay_wgrad},
            "pipeline_schedule": self.schedule,
            "profile_trace": None,
        }
