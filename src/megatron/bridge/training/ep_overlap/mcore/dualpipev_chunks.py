"""DualPipeV's model chunks: the two Megatron-Core chunks a pipeline rank holds in the V, their layer numbering,
and the V layout's embedding group.

Contract:
    * :func:`dualpipev_chunks` builds rank r's chunks for stages r and 2P-1-r, stage s as the interleaved layout's
      chunk s (virtual stage s // P of pipeline rank s % P), so layer numbers, parameter names and checkpoint names
      (``sharded_state_dict``) are the global ones. A ``HybridModel``'s pattern (2P ``|`` segments) and
      Megatron-Core's ``pipeline_model_parallel_layout`` (2P stages, MTP beside the loss on stage 2P-1) are read as
      the V's stages; what the V cannot build is refused before building, one line each with its fix.
    * The embedding (stage 0) and its copy (stage 2P-1: MTP's embedding, a tied output layer) are both on rank 0:
      the embedding group is rank 0 alone (:func:`dualpipev_embedding_ranks`), the copy takes the embedding's values
      when built, and :func:`copies_summed_before_scaling` sums the two copies' gradients where Megatron-Core's
      ``finalize_model_grads`` all-reduces them over the group in 1F1B.
"""

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import LayerType
from megatron.core.utils import get_attr_wrapped_model, get_model_config

from megatron.bridge.training.ep_overlap.program.dualpipev import stage_of


class _RankAs:
    """A pipeline group that reports another rank: Megatron-Core numbers a chunk's layers from its group's rank."""

    def __init__(self, group, rank: int):
        self._group, self._rank = group, rank

    def rank(self) -> int:
        return self._rank

    def __getattr__(self, name):
        return getattr(self._group, name)


def dualpipev_embedding_ranks(pp_ranks: list[int], *unused) -> list[int]:
    """Megatron-Core's ``get_embedding_ranks`` (``initialize_model_parallel``) for the V layout: the embedding (stage
    0) and the stage holding its copy (stage 2P-1: MTP's embedding, a tied output layer) are both on pipeline rank 0,
    so the embedding group is that rank alone and no embedding collective crosses ranks."""
    return list(pp_ranks[:1])


def dualpipev_chunks(
    build_chunk: Callable[..., torch.nn.Module],
    config,
    hybrid_layer_pattern: str | None = None,
    *,
    share_embeddings_and_output_weights: bool = False,
) -> list[torch.nn.Module]:
    """This rank's two chunks, for DualPipeV's stages r and 2P-1-r.

    Stage s is built as the interleaved layout's chunk s (virtual stage s // P of pipeline rank s % P), so layer
    numbers and parameter names are the global ones: ``build_chunk(vp_stage=, pre_process=, post_process=,
    pg_collection=)`` builds it (a ``GPTModel`` or ``HybridModel`` of ``config``, with
    ``virtual_pipeline_model_parallel_size=2``), with ``pre_process`` on stage 0 and ``post_process`` on stage 2P-1.
    Needs Megatron-Core's parallel state with two virtual stages, and with MTP or
    ``share_embeddings_and_output_weights`` (what ``build_chunk`` builds: a model argument, not a config field) the V
    layout's embedding group
    (``get_embedding_ranks=dualpipev_embedding_ranks``; refused before building without it): stage 2P-1's copy of
    the embedding then takes stage 0's values here, on rank 0, where Megatron-Core's build all-reduces it across
    ranks.

    A ``HybridModel``: give its ``hybrid_layer_pattern`` (2P segments split by ``|``, stage s the s-th, as the
    interleaved layout reads it); ``build_chunk`` then also takes ``hybrid_layer_pattern=``, the pattern from which
    ``HybridModel`` on this rank selects stage s's layers at their global numbers (:func:`hybrid_stage_pattern`),
    with the real pipeline group (``HybridModel`` reads its rank with ``torch.distributed.get_rank``); the built
    chunk keeps the pattern given.
    """
    P = parallel_state.get_pipeline_model_parallel_world_size()
    rank = parallel_state.get_pipeline_model_parallel_rank()
    mtp = bool(config.mtp_num_layers) or _pattern_has_mtp(hybrid_layer_pattern)
    tied = share_embeddings_and_output_weights
    if problems := _layout_problems(P, rank, mtp, tied, hybrid_layer_pattern, config):
        raise ValueError("\n".join(problems))
    chunks = []
    for v in (0, 1):
        stage = stage_of(rank, v, P)
        groups = ProcessGroupCollection.use_mpu_process_groups()
        pattern = {}
        if hybrid_layer_pattern is None:
            groups.pp = _RankAs(groups.pp, stage % P)
        else:
            pattern["hybrid_layer_pattern"] = hybrid_stage_pattern(hybrid_layer_pattern, stage, P, rank)
        with _at_pipeline_rank(stage % P):  # the layer spec, MTP placement and a layout's offsets read it
            chunk = build_chunk(
                vp_stage=stage // P, pre_process=stage == 0, post_process=stage == 2 * P - 1, pg_collection=groups,
                **pattern,
            )  # fmt: skip
        get_attr_wrapped_model(chunk, "pre_process", return_model_obj=True).dualpipev_stage = stage
        if hybrid_layer_pattern is None and getattr(config, "pipeline_model_parallel_layout", None) is not None:
            _names_at_pipeline_rank(chunk, stage % P)
        if hybrid_layer_pattern is not None:
            get_attr_wrapped_model(
                chunk, "hybrid_layer_pattern", return_model_obj=True
            ).hybrid_layer_pattern = hybrid_layer_pattern
        chunks.append(chunk)
    if rank == 0:
        copies = _embedding_copies(chunks)
        if copies is not None:
            with torch.no_grad():
                copies[1].copy_(copies[0])
    return chunks


@contextlib.contextmanager
def _at_pipeline_rank(pp_rank: int):
    """Megatron-Core's parallel state at pipeline rank ``pp_rank`` within the block (the chunk's interleaved rank)."""
    rank = parallel_state.get_pipeline_model_parallel_rank()
    parallel_state.set_pipeline_model_parallel_rank(pp_rank)
    try:
        yield
    finally:
        parallel_state.set_pipeline_model_parallel_rank(rank)


def _names_at_pipeline_rank(chunk, pp_rank: int) -> None:
    """The chunk's checkpoint names (``sharded_state_dict``) made at its interleaved rank: with a
    ``pipeline_model_parallel_layout``, Megatron-Core's block numbers its local layers by the layout's offset at the
    parallel state's pipeline rank (not its group's), which is another stage's on rank r's stage 2P-1-r."""
    named = chunk.sharded_state_dict

    def sharded_state_dict(*args, **kwargs):
        with _at_pipeline_rank(pp_rank):
            return named(*args, **kwargs)

    chunk.sharded_state_dict = sharded_state_dict


def hybrid_stage_pattern(pattern: str, stage: int, P: int, rank: int) -> str:
    """The pattern from which ``HybridModel`` on pipeline rank ``rank``, at virtual stage ``stage // P``, builds
    DualPipeV stage ``stage`` of ``pattern`` (2P ``|`` segments) with its global layer numbers.

    ``HybridModel`` builds segment ``vp_stage * P + rank`` of the ``|``-split main pattern and numbers its layers
    after all layers of the segments before it. The V puts stage s on rank min(s, 2P-1-s), so that segment is made
    stage s's: the layers before stage s fill the segments before it (merged, or padded with empty segments), the
    layers after stage s follow, and empty segments make the count a multiple of P. The MTP part is kept.
    """
    main, slash, mtp = pattern.partition("/")
    segments = main.split("|")
    picked = (stage // P) * P + rank
    before = segments[:stage]
    if picked < stage:  # picked >= 1 here: only stage 0 is picked as segment 0
        before = ["".join(before[: stage - picked + 1])] + before[stage - picked + 1 :]
    else:
        before += [""] * (picked - stage)
    after = segments[stage + 1 :]
    after += [""] * (-(len(before) + 1 + len(after)) % P)
    return "|".join([*before, segments[stage], *after]) + slash + mtp


def _pattern_has_mtp(pattern: str | None) -> bool:
    return pattern is not None and "/" in pattern


def _layout_problems(P: int, rank: int, mtp: bool, tied: bool, pattern: str | None, config) -> list[str]:
    """What the V layout's chunks cannot be built with, one line each with its fix."""
    problems = []
    if pattern is not None and len(segments := pattern.partition("/")[0].split("|")) != 2 * P:
        problems.append(
            f"DualPipeV builds hybrid_layer_pattern={pattern!r} as 2 x {P} = {2 * P} stages, stage s from its s-th "
            f"'|' segment (as the interleaved layout with 2 virtual stages reads it), and it has {len(segments)}; "
            f"fix: split its layers with '|' into {2 * P} segments"
        )
    problems += pipeline_layout_problems(config, P)
    if mtp and (problem := embedding_group_problem(rank, f"mtp_num_layers={config.mtp_num_layers}")):
        problems.append(problem)
    elif tied and (problem := embedding_group_problem(rank, "share_embeddings_and_output_weights=True")):
        problems.append(problem)
    return problems


def pipeline_layout_problems(config, P: int) -> list[str]:
    """Megatron-Core's ``pipeline_model_parallel_layout`` (a ``PipelineParallelLayerLayout``) is read as the V's 2P
    stages: stage s is the interleaved layout's chunk s (built so by :func:`dualpipev_chunks`), on rank
    min(s, 2P-1-s). What the V cannot run of it, one line each with its fix."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if layout is None:  # interleaved pipeline rank q holds the V's stages q and P+q
        ends = {"first": (0, P), "last": (P - 1, 2 * P - 1)}
        return [
            f"DualPipeV does not read num_layers_in_{end}_pipeline_stage={value}: Megatron-Core gives it to the "
            f"interleaved layout's pipeline rank {ends[end][0]}, whose chunks are the V's stages {ends[end][0]} and "
            f"{ends[end][1]}, not to one V rank; fix: unset it and give pipeline_model_parallel_layout {2 * P} stages"
            for end in ends
            if (value := getattr(config, f"num_layers_in_{end}_pipeline_stage", None)) is not None
        ]
    named = f"pipeline_model_parallel_layout={str(layout)!r}"
    if (n := layout.pipeline_model_parallel_size * layout.virtual_pipeline_model_parallel_size) != 2 * P:
        return [
            f"DualPipeV reads {named} as its 2 x {P} = {2 * P} stages (stage s on pipeline rank min(s, 2P-1-s), as "
            f"the interleaved layout with 2 virtual stages reads it), and it has {n}; fix: split it with '|' into "
            f"{2 * P} stages"
        ]
    stages = [layout.layout[s % P][s // P] for s in range(2 * P)]
    return [
        f"DualPipeV runs MTP beside the loss on stage {2 * P - 1} (pipeline rank 0, with the embedding), and {named} "
        f"puts it on stage {s}; fix: move its 'm' layers into the last stage, before the 'L'"
        for s, stage in enumerate(stages[:-1])
        if LayerType.mtp in stage
    ] + [
        f"DualPipeV does not run an empty stage (a chunk without parameters) yet, and {named} leaves stage {s} "
        "empty; fix: move a layer into it"
        for s, stage in enumerate(stages)
        if not stage
    ]


def embedding_group_problem(rank: int, why: str) -> str | None:
    """With a copy of the embedding on stage 2P-1, the embedding group must be the V layout's (rank 0 alone):
    Megatron-Core's default (first and last pipeline ranks) would all-reduce rank 0's copies with a rank that holds
    none, and the ranks would block."""
    in_group = parallel_state.is_rank_in_embedding_group()
    group = parallel_state.get_embedding_group(check_initialized=False) if in_group else None
    alone = group is not None and dist.get_process_group_ranks(group) == [dist.get_rank()]
    if in_group == (rank == 0) and (rank != 0 or alone):
        return None
    return (
        f"DualPipeV with {why} needs the V layout's embedding group (both ends of the model on pipeline rank 0, "
        "the group that rank alone); fix: initialize Megatron-Core's parallel state with get_embedding_ranks="
        "megatron.bridge.training.ep_overlap.mcore.dualpipev.dualpipev_embedding_ranks"
    )


def _embedding_copies(models: list) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Rank 0's two copies of the embedding (stage 0's and stage 2P-1's, for MTP or a tied output layer), or None."""
    config = get_model_config(models[0])
    first, last = (get_attr_wrapped_model(m, "pre_process", return_model_obj=True) for m in models)
    if not (config.mtp_num_layers or getattr(last, "share_embeddings_and_output_weights", False)):
        return None
    return first.shared_embedding_or_output_weight(), last.shared_embedding_or_output_weight()


def _sum_embedding_copies(models: list) -> None:
    """The embedding group's all-reduce that ``finalize_model_grads`` runs between the first and last pipeline
    ranks, for the two copies the V layout holds on rank 0: each copy's gradient becomes their sum."""
    copies = _embedding_copies(models)
    if copies is None:
        return
    attr = "main_grad" if hasattr(copies[0], "main_grad") else "grad"
    grads = [getattr(copy, attr) for copy in copies]
    if any(grad is None for grad in grads):  # a frozen embedding
        return
    total = grads[0] + grads[1]
    for grad in grads:
        grad.copy_(total)


@contextlib.contextmanager
def copies_summed_before_scaling(models: list):
    """The embedding group's sum of rank 0's two copies (:func:`_sum_embedding_copies`) where ``finalize_model_grads``
    all-reduces them in 1F1B: after the data-parallel reduction, before a per-token loss's scaling of every gradient
    by 1/num_tokens (at the first chunk's ``scale_gradients``); after the function where it does not scale."""
    chunk, summed = models[0], []
    own, scale = vars(chunk).get("scale_gradients"), getattr(chunk, "scale_gradients", None)

    def sum_then_scale(scaling):
        if not summed:
            summed.append(_sum_embedding_copies(models))
        return scale(scaling)

    chunk.scale_gradients = sum_then_scale
    try:
        yield
    finally:
        if own is None:
            del chunk.scale_gradients
        else:
            chunk.scale_gradients = own
    if not summed:
        _sum_embedding_copies(models)
