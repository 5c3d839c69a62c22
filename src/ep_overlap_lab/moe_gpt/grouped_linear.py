"""A grouped linear layer (one weight per group, e.g. per local expert) whose weight gradient can be delayed.

Contract:
    * ``GroupedLinear(x_MK, group_sizes)`` multiplies row block g of ``x_MK`` by ``weight_GKN[g]``. Rows are
      ordered by group; ``group_sizes`` (host ints) may contain zeros.
    * With ``delay_wgrad = False`` backward computes dgrad and wgrad as ordinary autograd does.
    * With ``delay_wgrad = True`` backward computes dgrad only and pushes what wgrad needs on a FIFO owned by the
      module (a :class:`~ep_overlap_lab.wgrad_store.WeightGradStore`: this module implements the
      engine contract's ``DelayableLinear``). ``backward_dw()`` pops one entry, computes the wgrad,
      accumulates it into ``weight.main_grad`` when the weight has one, else into ``weight.grad``, then runs the
      grad-ready hooks. Results are bitwise equal to
      the undelayed path: the same kernels run on the same operands, and accumulation adds in the same order.
    * Grad-ready hooks (``register_grad_ready_hook``) run once per backward, after the weight's gradient for
      that backward is complete, in both modes (what data-parallel gradient reduction needs).
    * ``pending_wgrads`` counts FIFO entries; the schedule checks it is zero at the end of every step.

Backends: ``torch._grouped_mm`` where this torch has it and the operand rows are 16-byte aligned (what its
kernels require), else a per-group loop of matmuls. :func:`make_expert_linear` picks Transformer Engine's
``GroupedLinear`` instead (see :class:`TEGroupedLinear`) when the model asks for grouped GEMMs
(``moe_grouped_gemm``), Transformer Engine imports and CUDA is available; it logs which backend it chose.

Shape suffixes: M rows (tokens), K input features, N output features, G groups.
"""

import functools
import logging
from collections.abc import Callable, Sequence

import torch

from ep_overlap_lab.wgrad_store import WeightGradStore

logger = logging.getLogger(__name__)

GradReadyHook = Callable[[torch.nn.Parameter], None]


def _grouped_mm_ok(*operands: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    for t in operands:
        if t.dtype not in (torch.float32, torch.bfloat16) or (t.shape[-1] * t.element_size()) % 16:
            return False
    return True


def _offsets(group_sizes: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(group_sizes, dtype=torch.int64).cumsum(0).to(device=device, dtype=torch.int32)


def grouped_matmul(x_MK: torch.Tensor, w_GKN: torch.Tensor, group_sizes: Sequence[int]) -> torch.Tensor:
    """``out[rows of g] = x[rows of g] @ w[g]``."""
    if _grouped_mm_ok(x_MK, w_GKN):
        return torch._grouped_mm(x_MK, w_GKN, offs=_offsets(group_sizes, x_MK.device))
    blocks = torch.split(x_MK, list(group_sizes))
    out_MN = x_MK.new_empty(x_MK.shape[0], w_GKN.shape[-1])
    for rows, block_SK, w_KN, out_SN in zip(group_sizes, blocks, w_GKN, torch.split(out_MN, list(group_sizes))):
        if rows:
            torch.matmul(block_SK, w_KN, out=out_SN)
    return out_MN


def grouped_wgrad(x_MK: torch.Tensor, grad_MN: torch.Tensor, group_sizes: Sequence[int]) -> torch.Tensor:
    """``dw[g] = x[rows of g]^T @ grad[rows of g]``; zero for empty groups."""
    if _grouped_mm_ok(x_MK, grad_MN):
        return torch._grouped_mm(x_MK.t(), grad_MN, offs=_offsets(group_sizes, x_MK.device))
    dw_GKN = x_MK.new_zeros(len(group_sizes), x_MK.shape[1], grad_MN.shape[1])
    for g, (x_SK, grad_SN) in enumerate(
        zip(torch.split(x_MK, list(group_sizes)), torch.split(grad_MN, list(group_sizes)))
    ):
        if x_SK.shape[0]:
            torch.matmul(x_SK.t(), grad_SN, out=dw_GKN[g])
    return dw_GKN


def accumulate_grad(param: torch.nn.Parameter, grad: torch.Tensor) -> None:
    """Adds ``grad`` into ``param.main_grad`` when present, else into ``param.grad`` (as autograd would)."""
    main_grad = getattr(param, "main_grad", None)
    if main_grad is not None:
        main_grad.add_(grad)
    elif param.grad is None:
        param.grad = grad
    else:
        param.grad.add_(grad)


class _GroupedLinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GKN, group_sizes, owner):
        ctx.save_for_backward(x_MK, w_GKN)
        ctx.group_sizes = group_sizes
        ctx.owner = owner
        return grouped_matmul(x_MK, w_GKN, group_sizes)

    @staticmethod
    def backward(ctx, grad_MN):
        x_MK, w_GKN = ctx.saved_tensors
        grad_MN = grad_MN.contiguous()  # incoming grads may be stride-0 expansions; the kernels reject those
        sizes = ctx.group_sizes
        dx_MK = grouped_matmul(grad_MN, w_GKN.transpose(1, 2), sizes) if ctx.needs_input_grad[0] else None
        dw_GKN = None
        if ctx.needs_input_grad[1]:
            if ctx.owner.delay_wgrad:
                work = functools.partial(ctx.owner._accumulate_wgrad, x_MK, grad_MN, sizes)
                ctx.owner._pending.push(work, held=(x_MK, grad_MN))
            else:
                dw_GKN = grouped_wgrad(x_MK, grad_MN, sizes)
        return dx_MK, dw_GKN, None, None


class _GradReadyHooks:
    """Grad-ready hooks over ``group_weights``: run once per backward, after each weight's gradient is complete.

    Undelayed, autograd accumulates the wgrad and its post-accumulate hook fires them; delayed, ``backward_dw``
    fires them (autograd runs the post-accumulate hook then too, with no wgrad, so it must not fire).
    """

    def _init_grad_ready_hooks(self) -> None:
        self._grad_ready_hooks: list[GradReadyHook] = []
        for param in self.group_weights:
            param.register_post_accumulate_grad_hook(self._on_autograd_accumulated)

    def register_grad_ready_hook(self, hook: GradReadyHook) -> None:
        """Runs ``hook(weight)`` once per backward, after the weight's gradient is complete."""
        self._grad_ready_hooks.append(hook)

    def _on_autograd_accumulated(self, param: torch.nn.Parameter) -> None:
        if not self.delay_wgrad:
            for hook in self._grad_ready_hooks:
                hook(param)

    def _fire_grad_ready(self) -> None:
        for param in self.group_weights:
            for hook in self._grad_ready_hooks:
                hook(param)


class GroupedLinear(_GradReadyHooks, torch.nn.Module):
    """``G`` independent linears applied to row blocks, with optional delayed weight gradient.

    Args:
        num_groups: G, e.g. the number of local experts (1 gives a plain linear with delayable wgrad).
        in_features: K.
        out_features: N.
        name: Used in error messages (e.g. "layer1.experts.fc1").
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, name: str = "grouped_linear"):
        super().__init__()
        self.name = name
        self.weight = torch.nn.Parameter(torch.empty(num_groups, in_features, out_features))
        self.delay_wgrad = False
        self._pending = WeightGradStore(name)
        self._init_grad_ready_hooks()

    def forward(self, x_MK: torch.Tensor, group_sizes: Sequence[int]) -> torch.Tensor:
        return _GroupedLinearFn.apply(x_MK, self.weight, tuple(group_sizes), self)

    @property
    def pending_wgrads(self) -> int:
        """Delayed wgrads queued and not yet computed."""
        return len(self._pending)

    def reset_pending(self) -> None:
        """Drops queued wgrads (after a failed step, so they cannot leak into the next one)."""
        self._pending.clear()

    @property
    def group_weights(self) -> list[torch.nn.Parameter]:
        """The parameters holding the weights (one stacked [G, K, N] tensor here)."""
        return [self.weight]

    @torch.no_grad()
    def load_group_weight(self, group: int, w_KN: torch.Tensor) -> None:
        """Sets group ``group``'s weight from a [K, N] tensor (the layout-independent way to initialize)."""
        self.weight[group].copy_(w_KN)

    @torch.no_grad()
    def _accumulate_wgrad(self, x_MK: torch.Tensor, grad_MN: torch.Tensor, sizes: tuple[int, ...]) -> None:
        accumulate_grad(self.weight, grouped_wgrad(x_MK, grad_MN, sizes))

    def backward_dw(self) -> None:
        """Computes one delayed weight gradient (FIFO order), accumulates it, then runs the grad-ready hooks."""
        self._pending.run_next()
        self._fire_grad_ready()


class TEGroupedLinear(_GradReadyHooks, torch.nn.Module):
    """Transformer Engine's ``GroupedLinear`` behind the :class:`GroupedLinear` interface (CUDA only).

    Transformer Engine fixes ``delay_wgrad_compute`` when the module is built, so ``delay_wgrad`` can be set
    only to that value; build the model with the config's ``delay_wgrad_compute`` you will train with.
    Its per-group weights are ``weight{g}`` of shape [N, K].
    """

    def __init__(self, num_groups: int, in_features: int, out_features: int, *, name: str, delay_wgrad: bool, dtype):
        super().__init__()
        import transformer_engine.pytorch as te

        self.name = name
        self._delay = delay_wgrad
        self._pending_count = 0
        self.inner = te.GroupedLinear(
            num_groups,
            in_features,
            out_features,
            bias=False,
            params_dtype=dtype,
            device="cuda",
            delay_wgrad_compute=delay_wgrad,
        )
        self._init_grad_ready_hooks()

    @property
    def delay_wgrad(self) -> bool:
        return self._delay

    @delay_wgrad.setter
    def delay_wgrad(self, value: bool) -> None:
        if bool(value) != self._delay:
            raise ValueError(
                f"{self.name}: Transformer Engine fixes delay_wgrad_compute={self._delay} when the module is built; "
                f"build the model with delay_wgrad_compute={bool(value)} instead"
            )

    @property
    def group_weights(self) -> list[torch.nn.Parameter]:
        return [getattr(self.inner, f"weight{g}") for g in range(self.inner.num_gemms)]

    @torch.no_grad()
    def load_group_weight(self, group: int, w_KN: torch.Tensor) -> None:
        getattr(self.inner, f"weight{group}").copy_(w_KN.t())

    @property
    def pending_wgrads(self) -> int:
        return self._pending_count

    def reset_pending(self) -> None:
        # Only the count is reset: Transformer Engine's own queue is not reachable from here, so after a failed
        # step with delayed wgrad the model should be rebuilt.
        self._pending_count = 0

    def forward(self, x_MK: torch.Tensor, group_sizes: Sequence[int]) -> torch.Tensor:
        out = self.inner(x_MK, m_splits=list(group_sizes))
        if self._delay and out.requires_grad:
            out.register_hook(self._count_pending)
        return out

    def _count_pending(self, grad: torch.Tensor) -> torch.Tensor:
        self._pending_count += 1
        return grad

    def backward_dw(self) -> None:
        if not self._pending_count:
            raise RuntimeError(f"{self.name}: backward_dw() called with no delayed wgrad queued")
        self.inner.backward_dw()
        self._pending_count -= 1
        self._fire_grad_ready()


def make_expert_linear(
    num_groups: int,
    in_features: int,
    out_features: int,
    *,
    name: str,
    use_transformer_engine: bool,
    delay_wgrad: bool,
    dtype: torch.dtype,
) -> "GroupedLinear | TEGroupedLinear":
    """Transformer Engine's grouped linear when asked for and usable here (CUDA + TE), else the pure-torch one."""
    if use_transformer_engine:
        try:
            import transformer_engine.pytorch  # noqa: F401
        except ImportError:
            logger.info("%s: Transformer Engine is not importable; using the pure-torch grouped GEMM", name)
        else:
            if torch.cuda.is_available():
                logger.info("%s: using Transformer Engine GroupedLinear (delay_wgrad_compute=%s)", name, delay_wgrad)
                return TEGroupedLinear(
                    num_groups, in_features, out_features, name=name, delay_wgrad=delay_wgrad, dtype=dtype
                )
            logger.info("%s: no CUDA device; using the pure-torch grouped GEMM", name)
    return GroupedLinear(num_groups, in_features, out_features, name=name)
