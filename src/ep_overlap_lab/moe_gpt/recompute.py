"""Selective recompute in the reference MoE GPT, chosen as Megatron-Core chooses it.

Contract:
    * ``recompute_granularity="selective"`` with ``recompute_modules`` (Megatron-Core's field) picks what each
      layer recomputes in backward instead of keeping: ``layernorm`` (the attention and MLP norms), ``core_attn``
      (scaled dot-product attention), ``moe_act`` (the experts' activation), ``mlp`` (a dense layer's MLP), ``moe``
      (a MoE layer's experts: sort, grouped GEMMs, activation, unsort). Any other module is refused by
      ``config.model_feature_problems``. Full recompute (``recompute_granularity="full"``) is not this module's:
      the model cuts its layers into segments (``settings.Settings.segments``) and the schedule replays them.
    * A recomputed part keeps only its inputs, saved as its own (so ``engine/saved.py`` counts them); its backward
      runs its forward again, then its backward. Inside the overlapped schedule that happens in the node's backward,
      in the window the program gives that node, beside the other microbatch's all-to-all.
    * ``layernorm`` and ``moe_act`` also drop their output, which the next linear saves as its input (the router's
      for the MLP norm of an MoE layer; fc2's for the experts' activation): :class:`OutputRecompute` frees it once
      that linear ran and rebuilds it just before the linear's backward, as Megatron-Core's
      ``CheckpointWithoutOutput`` does (``wgrad_store.DiscardedStorage`` keeps the activation count exact). A dense
      layer's MLP norm only drops its statistics (its output crosses to the experts node).
    * Numerics: the same ops on the same inputs, so losses and gradients are bitwise equal to keeping everything
      (CPU; on GPU, as far as the kernels are deterministic).
"""

import torch
import torch.utils.checkpoint

from ep_overlap_lab.wgrad_store import DiscardedStorage

RECOMPUTABLE = ("layernorm", "core_attn", "moe_act", "mlp", "moe")


def recompute_modules(config) -> frozenset[str]:
    """What ``config`` asks the reference model to recompute (nothing unless the granularity is selective)."""
    if config.recompute_granularity != "selective":
        return frozenset()
    return frozenset(config.recompute_modules or ())


def run(recompute: bool, fn, *inputs: torch.Tensor) -> torch.Tensor:
    """``fn(*inputs)``; with ``recompute``, keeping only ``inputs`` for backward, which runs ``fn`` again.

    Reentrant checkpointing saves the inputs with ``save_for_backward``, where saved-tensor hooks (the activation
    count) see them, and runs the first forward without building a graph.
    """
    if not (recompute and torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return fn(*inputs)
    return torch.utils.checkpoint.checkpoint(fn, *inputs, use_reentrant=True, preserve_rng_state=False)


class _NoGraph(torch.autograd.Function):
    """``fn(*inputs)`` run without a graph; its backward runs through the graph :class:`OutputRecompute` rebuilt."""

    @staticmethod
    def forward(ctx, fn, recompute: "OutputRecompute", *inputs):
        ctx.recompute = recompute
        ctx.save_for_backward(*inputs)  # what the part keeps: its inputs (counted as saved)
        return fn(*inputs)

    @staticmethod
    def backward(ctx, grad):
        recompute = ctx.recompute
        outputs, inputs = recompute.rebuilt, recompute.rebuilt_inputs
        recompute.rebuilt = recompute.rebuilt_inputs = None
        torch.autograd.backward(outputs, grad)
        return (None, None, *(i.grad if i.requires_grad else None for i in inputs))


class OutputRecompute:
    """One use of a part whose output is not kept (Megatron-Core's ``CheckpointWithoutOutput``): ``run(fn, *inputs)``
    computes it without a graph; after the ops that read the output ran, ``discard(*hooks)`` frees its storage and
    rebuilds it (and the part's graph) when the gradient of the first of ``hooks`` (the outputs of the ops that saved
    it) is ready, i.e. just before the first of those ops' backward. Disabled (or without grad): ``run`` is ``fn``
    and ``discard`` does nothing.
    """

    def __init__(self, enabled: bool):
        self.enabled = enabled and torch.is_grad_enabled()
        self.rebuilt = self.rebuilt_inputs = None  # the part's graph, rebuilt just before the linear's backward

    def run(self, fn, *inputs: torch.Tensor) -> torch.Tensor:
        if self.enabled and not any(t.requires_grad for t in inputs):
            self.enabled = False
        if not self.enabled:
            return fn(*inputs)
        self.fn, self._inputs = fn, inputs
        self.output = _NoGraph.apply(fn, self, *inputs)
        return self.output

    def discard(self, *hooks: torch.Tensor) -> None:
        if not self.enabled:
            return
        output, storage = self.output, self.output.untyped_storage()
        self.output, nbytes = None, storage.nbytes()
        token = DiscardedStorage.discard(output)
        storage.resize_(0)
        pending = [True]  # the first hook's gradient rebuilds; the others find it done

        def rebuild(grad: torch.Tensor) -> torch.Tensor:
            if not pending:
                return grad
            pending.clear()
            self.rebuilt_inputs = [t.detach().requires_grad_(t.requires_grad) for t in self._inputs]
            with torch.enable_grad():
                self.rebuilt = self.fn(*self.rebuilt_inputs)
            storage.resize_(nbytes)
            storage.copy_(self.rebuilt.untyped_storage())  # the bytes, not the tensor: its version stays (it is saved)
            DiscardedStorage.restore(token)
            return grad

        for hook in hooks:
            hook.register_hook(rebuild)
