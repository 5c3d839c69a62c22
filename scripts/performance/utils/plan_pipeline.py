"""The planner CLI's pipeline prices (``--pp``, ``--vpp``): the plain 1F1B pipeline and the interleaved one, each
plain and overlapped, with the microbatches and activations each stage holds."""

from ep_overlap_lab.planner import in_flight, simulate_pipeline
from ep_overlap_lab.planner.cost_model import (
    BYTES_PER_ELEMENT,
    Layout,
    activation_shape,
    costs_from_model,
)
from ep_overlap_lab.planner.memory import pipeline_peaks
from megatron.bridge.training.ep_overlap.options import EPOverlapOptions

GIB = 2**30
PLAIN, OVERLAP = EPOverlapOptions(overlap=False), EPOverlapOptions(overlap=True)


def stage_layout(layout: Layout, pipeline_size: int) -> Layout:
    """One pipeline stage's data- and expert-parallel ranks: the GPUs divided by the stages."""
    return Layout(layout.gpus // pipeline_size, layout.ep, layout.global_batch, layout.micro_batch)


def _priced(costs, link, n: int, pipeline_size: int, virtual: int, p2p_bytes: float) -> tuple[list[str], tuple]:
    """The lines of one pipeline: its step plain and overlapped, the speedup and h, and the in-flight counts."""
    name = f"PP {pipeline_size} (1F1B)" if virtual == 1 else f"PP {pipeline_size} x VPP {virtual}"
    plain, over = (
        simulate_pipeline(
            costs, link, n, options, pipeline_size=pipeline_size, virtual_size=virtual, p2p_bytes=p2p_bytes
        )  # fmt: skip
        for options in (PLAIN, OVERLAP)
    )
    comm = plain.exposed_total_s
    hideable = min(comm, plain.step_s - comm)
    h = 0.0 if hideable <= 0 else (plain.step_s - over.step_s) / hideable
    flight = [
        [in_flight(pipeline_size, virtual, n, r, o.overlap) for r in range(pipeline_size)] for o in (PLAIN, OVERLAP)
    ]
    return [
        f"{name}: plain {plain.step_s:.3f} s, overlapped {over.step_s:.3f} s, speedup "
        f"{plain.step_s / over.step_s:.3f}x, h {h:.2f} (first stage waits for peers {plain.bubble_s[0]:.3f} -> "
        f"{over.bubble_s[0]:.3f} s)",
        f"  microbatches in flight per stage: plain {flight[0]}, overlapped {flight[1]}",
    ], (plain, over)


def _layouts(virtual_size: int | None) -> list[int]:
    return [1] + ([virtual_size] if virtual_size and virtual_size > 1 else [])


def measured_pipeline_lines(costs, link, n: int, pipeline_size: int, virtual_size, p2p_bytes: float) -> list[str]:
    """A measured PP = 1 step's costs priced on ``pipeline_size`` stages (the P2P on the same link)."""
    lines = [f"pipeline: {pipeline_size} stages, {n} microbatches per step, the measured costs split over them"]
    for virtual in _layouts(virtual_size):
        lines += _priced(costs, link, n, pipeline_size, virtual, p2p_bytes)[0]
    return lines


def pipeline_lines(shape, layout: Layout, profile, pipeline_size: int, virtual_size: int | None) -> list[str]:
    """Per pipeline (the plain 1F1B one, and with ``virtual_size`` the interleaved one): the step plain and
    overlapped, the speedup, and per stage the microbatches in flight and the activations held (GiB)."""
    stage = stage_layout(layout, pipeline_size)
    costs, link = costs_from_model(shape, stage, profile)
    held = activation_shape(shape, stage)
    n = stage.num_microbatches
    p2p_bytes = stage.micro_batch * shape.seq_length * shape.hidden * BYTES_PER_ELEMENT  # one activation
    lines = [f"pipeline: {pipeline_size} stages of {stage.gpus} GPUs, {n} microbatches per step"]
    for virtual in _layouts(virtual_size):
        lines += _priced(costs, link, n, pipeline_size, virtual, p2p_bytes)[0]
        peaks = [[b / GIB for b in pipeline_peaks(held, o, n, pipeline_size, virtual)] for o in (PLAIN, OVERLAP)]
        lines.append(
            "  activations per stage, GiB (balanced routing; an estimate): plain "
            + " ".join(f"{g:.1f}" for g in peaks[0])
            + ", overlapped "
            + " ".join(f"{g:.1f}" for g in peaks[1])
        )
    return lines
