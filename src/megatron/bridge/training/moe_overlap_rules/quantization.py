"""Low-precision training (fp8, fp4) with the overlap.

Every recipe runs in this project's schedule (``ep_overlap/mcore/quantization.py`` gives each node its layer's
context). The replay of full recompute quantizes again, which gives the first forward's result only where the scale
comes from the tensor itself (current scaling: tensorwise, blockwise, mxfp8, nvfp4).
"""

from megatron.bridge.training.moe_overlap_rules.facts import Rule, fp8_recipe, full_recompute

QUANTIZATION_RULES: tuple[Rule, ...] = (
    Rule(
        "fp8_delayed_full_recompute",
        ("model.fp8", "model.fp8_recipe", "model.recompute_granularity"),
        lambda f: full_recompute(f) and bool(f["model.fp8"]),
        lambda f: fp8_recipe(f) != "delayed",
        "delayed-scaling fp8 takes each forward's scales from an amax history the step keeps updating, and the "
        "replay of full recompute runs after later forwards updated it, so the replayed GEMMs would quantize with "
        "other scales than the first forward (Megatron-Core's dev line refuses it too).",
        "set fp8_recipe='tensorwise', 'blockwise' or 'mxfp8' (current scaling), or recompute_granularity='selective'.",
    ),
)
