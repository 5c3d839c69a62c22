"""Test-only: pure-torch stand-ins for the CUDA/Triton kernels that Megatron-Core 0.19.2's Mamba and gated delta net
(GDN) mixers call, so both mixers build and train on a CPU host. Never imported by product code.

Contract:
    * :func:`install_mamba_kernels` puts stand-in modules for ``mamba_ssm`` (``ops.triton.ssd_combined``:
      ``mamba_chunk_scan_combined``, ``mamba_split_conv1d_scan_combined``; ``ops.triton.layernorm_gated``: the gated
      ``RMSNorm`` and ``rmsnorm_fn``) and ``causal_conv1d`` (``causal_conv1d_fn``; ``causal_conv1d_varlen``:
      ``causal_conv1d_varlen_states``) into ``sys.modules``. :func:`install_gdn_kernels` does the same for ``fla``
      (``modules.convolution.causal_conv1d``, ``modules.l2norm.l2norm``,
      ``ops.gated_delta_rule.chunk_gated_delta_rule``).
    * Megatron-Core finds the packages with module-level ``try``/``except ImportError`` imports (``HAVE_MAMBA_SSM``,
      ``HAVE_FLA``, the functions bound by name, ``ExtendedRMSNorm`` subclassing the norm it found, the
      packed-sequence check reading ``__version__``). So each installer also reloads those Megatron-Core modules when
      they were imported before it ran (in place: classes already built from them read the reloaded names), and the
      mixers call the stand-ins for real. Call it in the process that builds the model, before building it: a forked
      test rank, or a worker. Never in the pytest process itself (a GPU test there looks for the real packages).
    * Same signatures and return conventions as the packages (``mamba_ssm`` 2.3, ``causal_conv1d`` 1.6, ``fla`` as
      Megatron-Core calls it), including the fused training function (``mamba_split_conv1d_scan_combined``: causal
      convolution, SSD scan, gate or gated RMSNorm, output projection). Math in fp32, results in the input's dtype,
      final states in fp32 (or ``state_dtype``). Gradients come from autograd through plain torch ops (no custom
      backward), and every op is deterministic on CPU, so two runs of the same inputs give the same bits.
    * The SSD scan and the delta rule are computed as the kernels compute them, chunk by chunk: quadratic within a
      chunk (the delta rule's chunk solved as one unit-lower-triangular system), the state carried between chunks,
      reset at packed-sequence boundaries (``seq_idx``, ``cu_seqlens``). ``test_ssm_kernels.py`` checks each against
      a per-timestep reference written separately.
    * Refused (``NotImplementedError``): fla's context-parallel paths (``cp_context``), which need its kernels.
"""

import importlib
import importlib.machinery
import sys
import types

import torch
import torch.nn.functional as F

MAMBA_SSM_VERSION = "2.3.2.post1"  # Megatron-Core's packed-sequence check reads these
CAUSAL_CONV1D_VERSION = "1.6.1"
FLA_VERSION = "0.4.1"
_NO_LIMIT = (0.0, float("inf"))


# ---- causal depthwise convolution (causal_conv1d and fla) ---------------------------------------------------------


def _depthwise_causal_conv(
    x_BTD: torch.Tensor,
    weight_DW: torch.Tensor,
    bias_D: torch.Tensor | None,
    segment_BT: torch.Tensor | None = None,
    prefix_BKD: torch.Tensor | None = None,
) -> torch.Tensor:
    """fp32 ``sum_j weight[:, W-1-j] * x[t-j]`` (+ bias): taps before the sequence read ``prefix_BKD`` (the last
    ``K = W - 1`` inputs before it) or zero; a tap in another segment than ``t`` (a packed sequence) reads zero."""
    width = weight_DW.shape[1]
    x_BTD = x_BTD.float()
    length = x_BTD.shape[1]
    if prefix_BKD is None:
        prefix_BKD = x_BTD.new_zeros(x_BTD.shape[0], width - 1, x_BTD.shape[2])
    padded_BTD = torch.cat([prefix_BKD.float(), x_BTD], dim=1)
    y_BTD = torch.zeros_like(x_BTD)
    for lag in range(width):
        tap_BTD = padded_BTD[:, width - 1 - lag : width - 1 - lag + length]
        if segment_BT is not None and lag > 0:
            same_BT = torch.zeros_like(segment_BT, dtype=torch.bool)
            same_BT[:, lag:] = segment_BT[:, lag:] == segment_BT[:, :-lag]
            tap_BTD = tap_BTD * same_BT[..., None]
        y_BTD = y_BTD + tap_BTD * weight_DW[:, width - 1 - lag].float()
    return y_BTD if bias_D is None else y_BTD + bias_D.float()


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in (None, "silu", "swish"):
        raise NotImplementedError(f"activation={activation!r}: the kernels take None, 'silu' or 'swish'")
    return y if activation is None else F.silu(y)


def causal_conv1d_fn(
    x,
    weight,
    bias=None,
    seq_idx=None,
    initial_states=None,
    return_final_states=False,
    final_states_out=None,
    activation=None,
):
    """``causal_conv1d.causal_conv1d_fn``: x ``(batch, dim, seqlen)``, weight ``(dim, width)``, bias ``(dim,)``,
    seq_idx ``(batch, seqlen)`` (taps never cross a change of it), initial_states ``(batch, dim, width - 1)``.

    Returns:
        out ``(batch, dim, seqlen)`` in x's dtype; with ``return_final_states``, also the last ``width - 1`` inputs
        ``(batch, dim, width - 1)`` (written into ``final_states_out`` when given).
    """
    if seq_idx is not None and (initial_states is not None or return_final_states):
        raise ValueError("causal_conv1d_fn: seq_idx takes neither initial_states nor return_final_states")
    x_BTD = x.transpose(1, 2)
    prefix = None if initial_states is None else initial_states.transpose(1, 2)
    y_BTD = _activate(_depthwise_causal_conv(x_BTD, weight, bias, seq_idx, prefix), activation)
    out = y_BTD.to(x.dtype).transpose(1, 2)
    if not return_final_states:
        return out
    keep = weight.shape[1] - 1
    history_BTD = torch.cat([x.new_zeros(x.shape[0], keep, x.shape[1]) if prefix is None else prefix, x_BTD], dim=1)
    final = history_BTD[:, -keep:].transpose(1, 2) if keep else x.new_zeros(x.shape[0], x.shape[1], 0)
    if final_states_out is not None:
        with torch.no_grad():
            final_states_out.copy_(final)
        final = final_states_out
    return out, final


def causal_conv1d_varlen_states(x, cu_seqlens, state_len):
    """``causal_conv1d.causal_conv1d_varlen.causal_conv1d_varlen_states`` (forward only): x ``(total_tokens, dim)``;
    for each sequence of ``cu_seqlens`` its last ``state_len`` inputs, right-aligned, zeros before a short one.

    Returns:
        ``(num_sequences, dim, state_len)``.
    """
    bounds = [int(b) for b in cu_seqlens.tolist()]
    states_NSD = x.new_zeros(len(bounds) - 1, state_len, x.shape[1])
    for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        first = max(start, end - state_len)
        if end > first:
            states_NSD[n, state_len - (end - first) :] = x[first:end]
    return states_NSD.transpose(1, 2)


def fla_causal_conv1d(
    x,
    weight=None,
    bias=None,
    residual=None,
    initial_state=None,
    output_final_state=False,
    activation=None,
    backend="triton",
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """fla's ``causal_conv1d``: x ``[B, T, D]`` (``B`` = 1 with ``cu_seqlens``, each sequence convolved on its own),
    weight ``[D, W]``, initial_state ``[N, D, W]`` (the last ``W`` inputs before each sequence). The activation comes
    before ``residual`` is added.

    Returns:
        ``(y [B, T, D] in x's dtype, final_state [N, D, W] or None)``.
    """
    if cp_context is not None:
        raise NotImplementedError("fla causal_conv1d stand-in: context parallelism (cp_context) needs fla's kernels")
    if weight is None:
        raise NotImplementedError("fla causal_conv1d stand-in: weight=None (Megatron-Core always passes one)")
    width = weight.shape[1]
    if cu_seqlens is not None:
        if x.shape[0] != 1:
            raise ValueError(f"fla causal_conv1d: cu_seqlens needs batch 1, got {tuple(x.shape)}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        pieces = [(0, n, start, end) for n, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))]
    else:
        pieces = [(b, b, 0, x.shape[1]) for b in range(x.shape[0])]
    outputs, finals = [], []
    for row, n, start, end in pieces:
        x_1TD = x[row : row + 1, start:end]
        prefix = None if initial_state is None else initial_state[n : n + 1, :, 1:].transpose(1, 2)
        y_1TD = _activate(_depthwise_causal_conv(x_1TD, weight, bias, None, prefix), activation)
        outputs.append(y_1TD)
        if output_final_state:
            before = x.new_zeros(1, width, x.shape[2]) if initial_state is None else initial_state[n : n + 1].mT
            finals.append(torch.cat([before, x_1TD], dim=1)[:, -width:].transpose(1, 2))
    if cu_seqlens is not None:
        y_BTD = torch.cat(outputs, dim=1)
    else:
        y_BTD = torch.cat(outputs, dim=0)
    if residual is not None:
        y_BTD = y_BTD + residual.float()
    return y_BTD.to(x.dtype), (torch.cat(finals, dim=0) if output_final_state else None)


# ---- gated RMSNorm (mamba_ssm.ops.triton.layernorm_gated) ---------------------------------------------------------


def rmsnorm_fn(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True):
    """RMSNorm over groups of ``group_size`` features (all of them by default), gated by ``silu(z)``: after the norm
    with ``norm_before_gate``, before it without. fp32 inside, x's dtype out."""
    x_f = x.float()
    if z is not None and not norm_before_gate:
        x_f = x_f * F.silu(z.float())
    size = x.shape[-1] if group_size is None else group_size
    grouped = x_f.reshape(*x_f.shape[:-1], x_f.shape[-1] // size, size)
    normed = grouped * torch.rsqrt(grouped.square().mean(dim=-1, keepdim=True) + eps)
    out = normed.reshape(x_f.shape) * weight.float()
    if bias is not None:
        out = out + bias.float()
    if z is not None and norm_before_gate:
        out = out * F.silu(z.float())
    return out.to(x.dtype)


class RMSNorm(torch.nn.Module):
    """``mamba_ssm.ops.triton.layernorm_gated.RMSNorm``: a weight of ones, no bias; ``forward(x, z=None)``."""

    def __init__(self, hidden_size, eps=1e-5, group_size=None, norm_before_gate=True, device=None, dtype=None):
        super().__init__()
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        torch.nn.init.ones_(self.weight)

    def forward(self, x, z=None):
        return rmsnorm_fn(x, self.weight, self.bias, z, self.eps, self.group_size, self.norm_before_gate)


# ---- Mamba-2 SSD (mamba_ssm.ops.triton.ssd_combined) --------------------------------------------------------------


def _step_sizes(dt_BLH, dt_bias, dt_softplus, dt_limit) -> torch.Tensor:
    """fp32 step sizes: bias added, softplus, clamped to ``dt_limit`` where it is not the default."""
    dt_BLH = dt_BLH.float()
    if dt_bias is not None:
        dt_BLH = dt_BLH + dt_bias.float()
    if dt_softplus:
        dt_BLH = F.softplus(dt_BLH)
    if tuple(dt_limit) != _NO_LIMIT:
        dt_BLH = dt_BLH.clamp(min=dt_limit[0], max=dt_limit[1])
    return dt_BLH


def _ssd_scan(x_BLHP, dt_BLH, A_H, B_BLGN, C_BLGN, chunk_size, segment_BL, state_BHPN, state_dtype, state_segment_B):
    """The SSD recurrence ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t``, chunk by chunk: within
    a chunk the quadratic form over its positions, between chunks the carried state. A state never reaches a
    position of another segment (the state coming in belongs to ``state_segment_B``).

    Returns:
        ``(y_BLHP fp32, states)``: ``states[t]`` is the state after position ``t`` where a chunk ends there (the
        last position always), as a dict.
    """
    batch, length, heads, _ = x_BLHP.shape
    per_group = heads // B_BLGN.shape[2]
    x_BLHP = x_BLHP.float()
    B_BLHN = B_BLGN.float().repeat_interleave(per_group, dim=2)
    C_BLHN = C_BLGN.float().repeat_interleave(per_group, dim=2)
    logdecay_BLH = dt_BLH * A_H.float()
    outputs, states = [], {}
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        seg_BC = segment_BL[:, start:stop]
        cum_BHC = logdecay_BLH[:, start:stop].cumsum(dim=1).transpose(1, 2)
        # decay from position r to position t of the chunk, zero for r after t or in another segment
        gap_BHCC = cum_BHC[..., :, None] - cum_BHC[..., None, :]
        reach_BCC = torch.ones(stop - start, stop - start, dtype=torch.bool, device=x_BLHP.device).tril() & (
            seg_BC[:, :, None] == seg_BC[:, None, :]
        )
        decay_BHCC = gap_BHCC.masked_fill(~reach_BCC[:, None], float("-inf")).exp()
        scores_BHCC = torch.einsum("bthn,brhn->bhtr", C_BLHN[:, start:stop], B_BLHN[:, start:stop])
        dt_BHC = dt_BLH[:, start:stop].transpose(1, 2)
        y_BCHP = torch.einsum("bhtr,bhr,brhp->bthp", scores_BHCC * decay_BHCC, dt_BHC, x_BLHP[:, start:stop])
        carried_BC = seg_BC == state_segment_B[:, None]
        from_state_BHC = cum_BHC.exp() * carried_BC[:, None]
        y_BCHP = y_BCHP + torch.einsum("bht,bthn,bhpn->bthp", from_state_BHC, C_BLHN[:, start:stop], state_BHPN)
        outputs.append(y_BCHP)
        # the state after the chunk's last position, for that position's segment
        last_B = seg_BC[:, -1]
        kept_BHC = (cum_BHC[..., -1:] - cum_BHC).exp() * (seg_BC == last_B[:, None])[:, None]
        state_BHPN = from_state_BHC[..., -1, None, None] * state_BHPN + torch.einsum(
            "bhr,brhp,brhn->bhpn", kept_BHC * dt_BHC, x_BLHP[:, start:stop], B_BLHN[:, start:stop]
        )
        if state_dtype is not None:  # the inter-chunk state as the kernel materializes it
            state_BHPN = state_BHPN.to(state_dtype).float()
        state_segment_B = last_B
        states[stop - 1] = state_BHPN
    return torch.cat(outputs, dim=1), states


def _segments(seq_idx, batch: int, length: int, device) -> torch.Tensor:
    if seq_idx is None:
        return torch.zeros(batch, length, dtype=torch.long, device=device)
    return seq_idx.to(torch.long)


def mamba_chunk_scan_combined(
    x,
    dt,
    A,
    B,
    C,
    chunk_size,
    D=None,
    z=None,
    dt_bias=None,
    initial_states=None,
    seq_idx=None,
    cu_seqlens=None,
    dt_softplus=False,
    dt_limit=_NO_LIMIT,
    return_final_states=False,
    return_varlen_states=False,
    state_dtype=None,
):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_chunk_scan_combined``: x ``(batch, seqlen, nheads, headdim)``, dt
    ``(batch, seqlen, nheads)``, A ``(nheads,)``, B and C ``(batch, seqlen, ngroups, dstate)``, D ``(nheads,)`` or
    ``(nheads, headdim)``, z like x (output gate ``silu(z)``), initial_states ``(batch, nheads, headdim, dstate)``,
    seq_idx ``(batch, seqlen)`` (the state resets where it changes), cu_seqlens for ``return_varlen_states``
    (batch 1: each sequence's state at its last position; the chunks then end there too).

    Returns:
        out (x's shape and dtype); then, as asked, final_states ``(batch, nheads, headdim, dstate)`` and
        varlen_states ``(num_sequences, nheads, headdim, dstate)``.
    """
    batch, length, heads, headdim = x.shape
    dt_f = _step_sizes(dt, dt_bias, dt_softplus, dt_limit)
    segment_BL = _segments(seq_idx, batch, length, x.device)
    state = x.new_zeros(batch, heads, headdim, B.shape[-1], dtype=torch.float32)
    if initial_states is not None:
        state = initial_states.float()
    owner_B = segment_BL[:, 0]  # an initial state belongs to the first position's sequence
    if return_varlen_states:
        if cu_seqlens is None or batch != 1:
            raise ValueError("mamba_chunk_scan_combined: return_varlen_states needs cu_seqlens and batch 1")
        ends = [int(e) for e in cu_seqlens.tolist()[1:]]
        y, states = [], {}
        begin = 0
        for end in ends:  # chunks stop at every sequence's end, so its state is at hand
            piece, piece_states = _ssd_scan(
                x[:, begin:end], dt_f[:, begin:end], A, B[:, begin:end], C[:, begin:end], chunk_size,
                segment_BL[:, begin:end], state, state_dtype, owner_B,
            )  # fmt: skip
            y.append(piece)
            state, owner_B = piece_states[end - begin - 1], segment_BL[:, end - 1]
            states[end - 1] = state
            begin = end
        y_BLHP = torch.cat(y, dim=1)
    else:
        y_BLHP, states = _ssd_scan(x, dt_f, A, B, C, chunk_size, segment_BL, state, state_dtype, owner_B)
    if D is not None:
        skip = D.float()[:, None] if D.dim() == 1 else D.float()
        y_BLHP = y_BLHP + x.float() * skip
    if z is not None:
        y_BLHP = y_BLHP * F.silu(z.float())
    out = y_BLHP.to(x.dtype)
    final = states[length - 1].to(state_dtype or torch.float32)
    extra = ([final] if return_final_states else []) + (
        [torch.cat([states[e - 1] for e in ends])] if return_varlen_states else []
    )
    return (out, *extra) if extra else out


def mamba_split_conv1d_scan_combined(
    zxbcdt,
    conv1d_weight,
    conv1d_bias,
    dt_bias,
    A,
    D,
    chunk_size,
    initial_states=None,
    seq_idx=None,
    dt_limit=_NO_LIMIT,
    return_final_states=False,
    activation="silu",
    rmsnorm_weight=None,
    rmsnorm_eps=1e-6,
    outproj_weight=None,
    outproj_bias=None,
    headdim=None,
    ngroups=1,
    norm_before_gate=True,
    state_dtype=None,
):
    """``mamba_ssm.ops.triton.ssd_combined.mamba_split_conv1d_scan_combined``, the mixer's training path: zxbcdt
    ``(batch, seqlen, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads)`` splits into ``[zx0, z, xBC, dt]``;
    xBC goes through the causal convolution (``activation``; taps never cross a ``seq_idx`` change), then the SSD
    scan with ``softplus(dt + dt_bias)``; the result is gated by ``silu(z)``, or with ``rmsnorm_weight`` goes through
    the gated RMSNorm over ``dim // ngroups`` groups; ``swiglu(zx0)`` is put before it when ``d_nonssm > 0``; then
    the output projection when ``outproj_weight`` is given.

    Returns:
        out ``(batch, seqlen, dim + d_nonssm)`` (or the projection's width), and final_states
        ``(batch, nheads, headdim, dstate)`` with ``return_final_states``.
    """
    if D.dim() == 1:
        if headdim is None:
            raise ValueError("mamba_split_conv1d_scan_combined: a 1-D D needs headdim")
        heads = D.shape[0]
    else:
        heads, headdim = D.shape
    batch, length, width = zxbcdt.shape
    dim = heads * headdim
    dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
    d_nonssm = (width - 2 * dim - 2 * ngroups * dstate - heads) // 2
    if d_nonssm < 0 or width != 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + heads:
        raise ValueError(f"mamba_split_conv1d_scan_combined: zxbcdt width {width} does not split for these sizes")
    zx0, z, xBC, dt = torch.split(zxbcdt, [2 * d_nonssm, dim, dim + 2 * ngroups * dstate, heads], dim=-1)
    conv = causal_conv1d_fn(
        xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx,
        activation="silu" if activation in ("silu", "swish") else None,
    ).transpose(1, 2)  # fmt: skip
    x, B, C = torch.split(conv, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
    x = x.reshape(batch, length, heads, headdim)
    B = B.reshape(batch, length, ngroups, dstate)
    C = C.reshape(batch, length, ngroups, dstate)
    gate = z.reshape(batch, length, heads, headdim) if rmsnorm_weight is None else None
    result = mamba_chunk_scan_combined(
        x, dt, A, B, C, chunk_size, D=D, z=gate, dt_bias=dt_bias, initial_states=initial_states, seq_idx=seq_idx,
        dt_softplus=True, dt_limit=dt_limit, return_final_states=return_final_states, state_dtype=state_dtype,
    )  # fmt: skip
    y, final = result if return_final_states else (result, None)
    out = y.reshape(batch, length, dim)
    if rmsnorm_weight is not None:
        out = rmsnorm_fn(out, rmsnorm_weight, None, z, rmsnorm_eps, dim // ngroups, norm_before_gate)
    if d_nonssm > 0:
        left, right = zx0.chunk(2, dim=-1)
        out = torch.cat([(F.silu(left.float()) * right.float()).to(out.dtype), out], dim=-1)
    if outproj_weight is not None:
        out = F.linear(out, outproj_weight, outproj_bias)
    return (out, final) if return_final_states else out


# ---- gated delta rule (fla) ---------------------------------------------------------------------------------------


def l2norm(x, eps=1e-6, output_dtype=None):
    """fla's ``l2norm``: ``x / sqrt(sum(x^2) + eps)`` over the last dimension, fp32 inside."""
    x_f = x.float()
    return (x_f * torch.rsqrt(x_f.square().sum(dim=-1, keepdim=True) + eps)).to(output_dtype or x.dtype)


def _delta_rule_chunks(q_HTK, k_HTK, v_HTV, g_HT, beta_HT, scale, state_HKV, chunk_size):
    """One sequence (any leading dims ``...H``), chunk by chunk. Within a chunk (state ``S`` coming in, gates
    cumulated to ``G``), the per-step updates ``u_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t)`` solve one
    unit-lower-triangular system ``(I + A) U = beta (V - exp(G) K S)`` with
    ``A[t, r] = beta_t exp(G_t - G_r) k_t.k_r`` for ``r < t``; then ``o_t = scale (exp(G_t) q_t S + sum_{r <= t}
    exp(G_t - G_r) (q_t.k_r) u_r)`` and ``S <- exp(G_last) S + sum_r exp(G_last - G_r) k_r u_r^T``."""
    length = q_HTK.shape[-2]
    outputs = []
    for start in range(0, length, chunk_size):
        stop = min(start + chunk_size, length)
        q, k, v = q_HTK[..., start:stop, :], k_HTK[..., start:stop, :], v_HTV[..., start:stop, :]
        beta = beta_HT[..., start:stop, None]
        cum_HC = g_HT[..., start:stop].cumsum(dim=-1)
        gap_HCC = cum_HC[..., :, None] - cum_HC[..., None, :]
        size = stop - start
        strictly = torch.ones(size, size, dtype=torch.bool, device=q.device).tril(-1)
        causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
        before_HCC = gap_HCC.masked_fill(~strictly, float("-inf")).exp()
        upto_HCC = gap_HCC.masked_fill(~causal, float("-inf")).exp()
        lower_HCC = beta * before_HCC * (k @ k.mT)
        rhs_HCV = beta * (v - cum_HC.exp()[..., None] * (k @ state_HKV))
        eye = torch.eye(size, dtype=lower_HCC.dtype, device=q.device)
        u_HCV = torch.linalg.solve_triangular(eye + lower_HCC, rhs_HCV, upper=False, unitriangular=True)
        o_HCV = cum_HC.exp()[..., None] * (q @ state_HKV) + (upto_HCC * (q @ k.mT)) @ u_HCV
        outputs.append(scale * o_HCV)
        tail_HC = (cum_HC[..., -1:] - cum_HC).exp()
        state_HKV = cum_HC[..., -1, None, None].exp() * state_HKV + (k * tail_HC[..., None]).mT @ u_HCV
    return torch.cat(outputs, dim=-2), state_HKV


def chunk_gated_delta_rule(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    use_qk_l2norm_in_kernel=False,
    use_beta_sigmoid_in_kernel=False,
    allow_neg_eigval=False,
    state_v_first=False,
    cu_seqlens=None,
    cu_seqlens_cpu=None,
    chunk_indices=None,
    cp_context=None,
    **kwargs,
):
    """fla's ``chunk_gated_delta_rule``: q and k ``[B, T, H, K]``, v ``[B, T, HV, V]`` (each group of ``HV / H``
    value heads reads one query/key head), g (log-space decay) and beta ``[B, T, HV]``. Per head, with state
    ``S [K, V]``: ``S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T``, ``o_t = scale S_t^T q_t``
    (``scale`` defaults to ``K ** -0.5``). ``cu_seqlens`` (batch 1): each sequence starts from its own state.
    ``initial_state`` and the final state are ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``). Also
    ``kwargs``: ``chunk_size`` (16, 32 or 64), ``use_gate_in_kernel`` with ``A_log`` and ``dt_bias`` (then ``g`` is
    raw and the decay is ``-exp(A_log) softplus(g + dt_bias)``).

    Returns:
        ``(o [B, T, HV, V] in v's dtype, final state in fp32 or None)``.
    """
    if cp_context is not None:
        raise NotImplementedError("chunk_gated_delta_rule stand-in: context parallelism (cp_context) needs fla")
    chunk_size = kwargs.pop("chunk_size", 64)
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"chunk_size must be 16, 32 or 64, got {chunk_size}")
    heads, value_heads = q.shape[2], v.shape[2]
    if k.shape[2] != heads or value_heads % heads:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: heads do not group")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g_f = g.float()
    if kwargs.get("use_gate_in_kernel", False):
        bias = kwargs.get("dt_bias")
        g_f = -kwargs["A_log"].float().exp() * F.softplus(g_f + (0 if bias is None else bias.float()))
    beta_f = beta.float()
    if use_beta_sigmoid_in_kernel:
        beta_f = beta_f.sigmoid() * (2 if allow_neg_eigval else 1)
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    # [B, T, H, *] -> [B, HV, T, *], query/key heads repeated for their value heads
    q_f, k_f = (t.float().repeat_interleave(value_heads // heads, dim=2).transpose(1, 2) for t in (q, k))
    v_f = v.float().transpose(1, 2)
    g_f, beta_f = g_f.transpose(1, 2), beta_f.transpose(1, 2)
    if cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(f"chunk_gated_delta_rule: cu_seqlens needs batch 1, got {tuple(q.shape)}")
        bounds = [int(b) for b in cu_seqlens.tolist()]
        spans = [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]
    else:
        spans = [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    outputs, finals = [], []
    for n, (row, start, end) in enumerate(spans):
        state = q_f.new_zeros(value_heads, k.shape[-1], v.shape[-1])
        if initial_state is not None:
            state = initial_state[n].float()
            state = state.mT if state_v_first else state
        o_HTV, state = _delta_rule_chunks(
            q_f[row, :, start:end], k_f[row, :, start:end], v_f[row, :, start:end], g_f[row, :, start:end],
            beta_f[row, :, start:end], scale, state, chunk_size,
        )  # fmt: skip
        outputs.append(o_HTV)
        finals.append(state.mT if state_v_first else state)
    if cu_seqlens is not None:
        o_BHTV = torch.cat(outputs, dim=1)[None]
    else:
        o_BHTV = torch.stack(outputs)
    final = torch.stack(finals) if output_final_state else None
    return o_BHTV.transpose(1, 2).to(v.dtype), final


# ---- installing them as the packages ------------------------------------------------------------------------------


def _module(name: str, **attributes) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    # a spec, as an imported module has: importlib.util.find_spec (transformers' package checks) reads it
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package="__path__" in attributes)
    module.__stand_in__ = True  # what the install tests look for
    return module


def _install(modules: dict[str, dict], megatron_modules: list[str]) -> None:
    """``modules`` (name -> attributes) into ``sys.modules``, packages linked to their children; then the Megatron-Core
    modules that looked for them (in import order), reloaded where they were imported already."""
    for name, attributes in modules.items():
        sys.modules[name] = _module(name, **attributes)
    for name in modules:
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, sys.modules[name])
    importlib.invalidate_caches()
    for name in megatron_modules:
        if name in sys.modules:
            importlib.reload(sys.modules[name])


def install_mamba_kernels() -> None:
    """``mamba_ssm`` and ``causal_conv1d`` as this module's stand-ins, for this process (see the module docstring)."""
    _install(
        {
            "mamba_ssm": {"__version__": MAMBA_SSM_VERSION, "__path__": []},
            "mamba_ssm.ops": {"__path__": []},
            "mamba_ssm.ops.triton": {"__path__": []},
            "mamba_ssm.ops.triton.layernorm_gated": {"RMSNorm": RMSNorm, "rmsnorm_fn": rmsnorm_fn},
            "mamba_ssm.ops.triton.ssd_combined": {
                "mamba_chunk_scan_combined": mamba_chunk_scan_combined,
                "mamba_split_conv1d_scan_combined": mamba_split_conv1d_scan_combined,
            },
            "causal_conv1d": {
                "__version__": CAUSAL_CONV1D_VERSION,
                "__path__": [],
                "causal_conv1d_fn": causal_conv1d_fn,
            },
            "causal_conv1d.causal_conv1d_varlen": {"causal_conv1d_varlen_states": causal_conv1d_varlen_states},
        },
        ["megatron.core.ssm.mamba_mixer"],
    )


def install_gdn_kernels(*, eager: bool = True) -> None:
    """``fla`` as this module's stand-ins, for this process (see the module docstring).

    Args:
        eager: Run Megatron-Core's ``jit_fuser`` helpers (``torch.compile``: GDN's gates, input preparation and
            gated norm; a gated attention output) eagerly in this process: compiling them on a CPU costs about
            30 s per process, and both paths of a comparison run the same code either way.
    """
    if eager:
        torch._dynamo.config.disable = True
    _install(
        {
            "fla": {"__version__": FLA_VERSION, "__path__": []},
            "fla.modules": {"__path__": []},
            "fla.modules.convolution": {"causal_conv1d": fla_causal_conv1d},
            "fla.modules.l2norm": {"l2norm": l2norm},
            "fla.ops": {"__path__": []},
            "fla.ops.gated_delta_rule": {"chunk_gated_delta_rule": chunk_gated_delta_rule},
        },
        [
            "megatron.core.ssm.gated_delta_net.common",
            "megatron.core.ssm.gated_delta_net.gdn",
            "megatron.core.ssm.gated_delta_net",
        ],
    )


def installed() -> dict[str, bool]:
    """What Megatron-Core's mixer modules found, imported now: their package flags and whether the names they bound
    are these stand-ins."""
    from megatron.core.ssm import mamba_mixer
    from megatron.core.ssm.gated_delta_net import common, gdn

    return {
        "HAVE_MAMBA_SSM": mamba_mixer.HAVE_MAMBA_SSM,
        "mamba_split_conv1d_scan_combined": mamba_mixer.mamba_split_conv1d_scan_combined
        is mamba_split_conv1d_scan_combined,
        "gated_norm": issubclass(mamba_mixer.ExtendedRMSNorm, RMSNorm),
        "HAVE_FLA": common.HAVE_FLA,
        "chunk_gated_delta_rule": gdn.chunk_gated_delta_rule is chunk_gated_delta_rule,
        "causal_conv1d": gdn.causal_conv1d is fla_causal_conv1d,
        "l2norm": common.l2norm is l2norm,
    }


__all__ = [
    "causal_conv1d_fn",
    "causal_conv1d_varlen_states",
    "chunk_gated_delta_rule",
    "fla_causal_conv1d",
    "install_gdn_kernels",
    "install_mamba_kernels",
    "installed",
    "l2norm",
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "rmsnorm_fn",
    "RMSNorm",
]
