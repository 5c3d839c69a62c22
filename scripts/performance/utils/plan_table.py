"""The planner's cluster-scale table: published MoE shapes on H100 clusters of 8 to 1,024 GPUs."""

from ep_overlap_lab.planner import predict
from ep_overlap_lab.planner.cost_model import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    PROFILES,
    QWEN3_30B_A3B,
    Layout,
    MoEShape,
    activation_shape,
    costs_from_model,
)
from ep_overlap_lab.planner.memory import predicted_peak
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

# (shape, global batch in sequences, [(GPUs, EP)]); TP = PP = 1, micro-batch 1, sequence length 4096.
SWEEPS = [
    (QWEN3_30B_A3B, 1024, [(8, 8), (16, 16), (32, 16), (64, 16), (128, 16), (256, 16), (512, 16), (1024, 16)]),
    (DEEPSEEK_V3, 15360, [(8, 8), (32, 32), (64, 64), (256, 256), (1024, 256)]),
    (MIXTRAL_8X7B, 1024, [(8, 8), (16, 8), (64, 8), (256, 8), (1024, 8)]),
]

HEADER = (
    "| model | GPUs | EP | microbatches N | T_comm / T_compute | speedup, overlap | speedup, overlap + delayed wgrad "
    "| h | activations held, GiB: plain / overlap / + delayed wgrad / edge pairing |\n"
    "|---|---|---|---|---|---|---|---|---|"
)
GIB = 2**30
PEAK_MICROBATCHES = 4
MEMORY_OPTIONS = (
    EPOverlapOptions(overlap=False),
    EPOverlapOptions(overlap=True),
    EPOverlapOptions(overlap=True, delay_wgrad=True),
    EPOverlapOptions(overlap=True, edge_pairing=True),
)


def activation_peaks_gib(shape: MoEShape, layout: Layout, recompute: frozenset[str] = frozenset()) -> list[float]:
    """The activations one rank holds (GiB) with each of :data:`MEMORY_OPTIONS` (planner/memory.py's estimate)."""
    held = activation_shape(shape, layout, recompute)
    # A PP = 1 step reaches its peak by its second microbatch; more only repeat it (and cost time here).
    n = min(layout.num_microbatches, PEAK_MICROBATCHES)
    return [predicted_peak(held, options, n) / GIB for options in MEMORY_OPTIONS]


def cluster_table(profile: str = "H100") -> str:
    rows = [HEADER]
    for shape, global_batch, layouts in SWEEPS:
        for gpus, ep in layouts:
            layout = Layout(gpus, ep, global_batch)
            costs, link = costs_from_model(shape, layout, PROFILES[profile])
            n = layout.num_microbatches
            plain, delayed = predict(costs, link, n), predict(costs, link, n, EPOverlapOptions(delay_wgrad=True))
            comm = plain.baseline.exposed_total_s
            peaks = activation_peaks_gib(shape, layout)
            rows.append(
                f"| {shape.name} | {gpus} | {ep} | {n} | {comm / (plain.baseline.step_s - comm):.2f} "
                f"| {plain.speedup:.3f}x | {delayed.speedup:.3f}x | {plain.h:.2f} | "
                + " / ".join(f"{peak:.1f}" for peak in peaks)
                + " |"
            )
    return "\n".join(rows)
