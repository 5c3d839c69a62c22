"""The test-only Mamba and GDN kernel stand-ins (``ssm_kernels.py``) against plain per-timestep references.

Each reference here is written from the kernel's definition, as simply as it can be: a loop over positions for the
causal convolution, a sequential per-timestep scan for Mamba-2's SSD, the per-step gated delta rule
``M_t = exp(g_t) M_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T`` (``M [V, K]``, the transposed layout of the
stand-in's state), ``o_t = scale M_t q_t``. The stand-ins compute chunk by chunk (quadratic within a chunk, the state
carried across), so the shapes below span several chunks and packed sequences that start mid-chunk. Forward outputs,
final states and the gradients of every input (autograd through the stand-in vs through the reference, for one
random output gradient) must agree to fp32 rounding. The install test checks that Megatron-Core's mixer modules pick
the stand-ins up when they were imported before the install (in a forked process, not this one).
"""

import pytest
import torch
import torch.nn.functional as F

from . import ssm_kernels as kernels
from .local_ranks import run_local_ranks

TOL = dict(rtol=1e-4, atol=1e-5)


def _close(got, want, what: str) -> None:
    assert got.shape == want.shape, f"{what}: {tuple(got.shape)} vs {tuple(want.shape)}"
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{what}: {m}")


def _grads_agree(inputs: dict, stand_in, reference, seed: int = 0) -> None:
    """Forward of both on ``inputs`` (leaves that require grad), one random output gradient, every input's gradient
    compared (``stand_in`` and ``reference`` return a tensor or a tuple of them)."""
    leaves = {name: t.detach().clone().requires_grad_(t.is_floating_point()) for name, t in inputs.items()}
    mine = stand_in(**leaves)
    theirs = reference(**leaves)
    mine, theirs = (m if isinstance(m, tuple) else (m,) for m in (mine, theirs))
    gen = torch.Generator().manual_seed(seed)
    cotangents = [torch.randn(t.shape, generator=gen) for t in theirs]
    for i, (m, t) in enumerate(zip(mine, theirs)):
        _close(m, t, f"output {i}")
    wrt = [t for t in leaves.values() if t.requires_grad]
    got = torch.autograd.grad(mine, wrt, cotangents, allow_unused=True)
    want = torch.autograd.grad(theirs, wrt, cotangents, allow_unused=True)
    names = [n for n, t in leaves.items() if t.requires_grad]
    for name, g_mine, g_ref in zip(names, got, want):
        assert (g_mine is None) == (g_ref is None), name
        if g_ref is not None:
            assert g_ref.abs().sum() > 0, f"the reference gives {name} no gradient"
            _close(g_mine, g_ref, f"d{name}")


# ---- references ---------------------------------------------------------------------------------------------------


def conv_reference(x_BDT, weight_DW, bias_D=None, seq_idx_BT=None, before_BDK=None, silu=True):
    """Position by position: ``out[t] = bias + sum_j weight[:, W-1-j] * x[t-j]``, where ``x`` before the start is
    ``before_BDK`` (or zero) and a position of another sequence counts zero."""
    batch, dim, length = x_BDT.shape
    width = weight_DW.shape[1]
    rows = []
    for b in range(batch):
        cols = []
        for t in range(length):
            acc = torch.zeros(dim) if bias_D is None else bias_D.clone()
            for j in range(width):
                s = t - j
                if s >= 0:
                    if seq_idx_BT is not None and seq_idx_BT[b, s] != seq_idx_BT[b, t]:
                        continue
                    acc = acc + weight_DW[:, width - 1 - j] * x_BDT[b, :, s]
                elif before_BDK is not None:
                    acc = acc + weight_DW[:, width - 1 - j] * before_BDK[b, :, width - 1 + s]
            cols.append(F.silu(acc) if silu else acc)
        rows.append(torch.stack(cols, dim=-1))
    return torch.stack(rows)


def ssd_reference(x, dt, A, B, C, D=None, z=None, dt_bias=None, seq_idx=None, initial=None, softplus=True):
    """The Mamba-2 recurrence one position at a time: ``h = exp(dt A) h + dt x B^T``, ``y = h C + D x``, gated by
    ``silu(z)``; a new sequence (``seq_idx`` changes) starts from zero. Returns ``(y, final h)``."""
    batch, length, heads, _ = x.shape
    per_group = heads // B.shape[2]
    dt = dt + (0 if dt_bias is None else dt_bias)
    dt = F.softplus(dt) if softplus else dt
    ys, finals = [], []
    for b in range(batch):
        h = torch.zeros(heads, x.shape[3], B.shape[3]) if initial is None else initial[b]
        row = []
        for t in range(length):
            if t > 0 and seq_idx is not None and seq_idx[b, t] != seq_idx[b, t - 1]:
                h = torch.zeros_like(h)
            Bt = B[b, t].repeat_interleave(per_group, dim=0)  # [heads, dstate]
            Ct = C[b, t].repeat_interleave(per_group, dim=0)
            step = dt[b, t]  # [heads]
            h = torch.exp(step * A)[:, None, None] * h + step[:, None, None] * x[b, t][:, :, None] * Bt[:, None, :]
            y = (h * Ct[:, None, :]).sum(-1)
            if D is not None:
                y = y + (D[:, None] if D.dim() == 1 else D) * x[b, t]
            row.append(y)
        ys.append(torch.stack(row))
        finals.append(h)
    y = torch.stack(ys)
    if z is not None:
        y = y * F.silu(z)
    return y, torch.stack(finals)


def gated_rmsnorm_reference(x, weight, z=None, eps=1e-6, group=None, norm_before_gate=True):
    """``x`` gated (before or after), each group of ``group`` features divided by its root mean square."""
    if z is not None and not norm_before_gate:
        x = x * F.silu(z)
    group = group or x.shape[-1]
    parts = []
    for i in range(0, x.shape[-1], group):
        part = x[..., i : i + group]
        parts.append(part / torch.sqrt(part.pow(2).mean(-1, keepdim=True) + eps))
    out = torch.cat(parts, dim=-1) * weight
    return out * F.silu(z) if z is not None and norm_before_gate else out


def delta_rule_reference(q, k, v, g, beta, scale, initial=None, spans=None):
    """Per step, per head, with ``M [V, K]``: ``M = exp(g) M (I - beta k k^T) + beta v k^T``, ``o = scale M q``;
    query/key head ``h // (HV / H)`` for value head ``h``. ``spans``: (row, start, stop) sequences, each from its own
    ``initial[n]`` (given as ``[K, V]``, as the kernel takes it). Returns ``(o [B, T, HV, V], finals [N, HV, K, V])``.
    """
    value_heads, groups = v.shape[2], v.shape[2] // q.shape[2]
    spans = spans or [(b, 0, q.shape[1]) for b in range(q.shape[0])]
    out = torch.zeros(v.shape)
    finals = []
    for n, (row, start, stop) in enumerate(spans):
        per_head = []
        for h in range(value_heads):
            M = torch.zeros(v.shape[3], k.shape[3]) if initial is None else initial[n, h].T
            eye = torch.eye(k.shape[3])
            outs = []
            for t in range(start, stop):
                kt, qt, vt, bt = k[row, t, h // groups], q[row, t, h // groups], v[row, t, h], beta[row, t, h]
                M = torch.exp(g[row, t, h]) * M @ (eye - bt * torch.outer(kt, kt)) + bt * torch.outer(vt, kt)
                outs.append(scale * M @ qt)
            out = out.index_put((torch.tensor([row]), torch.arange(start, stop), torch.tensor([h])), torch.stack(outs))
            per_head.append(M.T)
        finals.append(torch.stack(per_head))
    return out, torch.stack(finals)


# ---- causal convolutions ------------------------------------------------------------------------------------------


def _rand(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_causal_conv1d_fn_matches_a_positionwise_convolution_with_packed_sequences():
    inputs = dict(x=_rand(2, 6, 11, seed=1), weight=_rand(6, 4, seed=2), bias=_rand(6, seed=3))
    seq_idx = torch.tensor([[0] * 3 + [1] * 6 + [2] * 2, [0] * 11], dtype=torch.int32)
    _grads_agree(
        inputs,
        lambda x, weight, bias: kernels.causal_conv1d_fn(x, weight, bias, seq_idx=seq_idx, activation="silu"),
        lambda x, weight, bias: conv_reference(x, weight, bias, seq_idx),
    )


def test_causal_conv1d_fn_takes_initial_states_and_returns_final_ones():
    inputs = dict(x=_rand(2, 5, 7, seed=4), weight=_rand(5, 4, seed=5), before=_rand(2, 5, 3, seed=6))

    def stand_in(x, weight, before):
        return kernels.causal_conv1d_fn(x, weight, initial_states=before, return_final_states=True)

    def reference(x, weight, before):
        return conv_reference(x, weight, None, None, before, silu=False), x[..., -3:]

    _grads_agree(inputs, stand_in, reference)


def test_causal_conv1d_varlen_states_are_each_sequences_last_inputs():
    x = _rand(9, 3, seed=7)
    states = kernels.causal_conv1d_varlen_states(x, torch.tensor([0, 2, 9]), state_len=4)
    assert states.shape == (2, 3, 4)
    assert torch.equal(states[0, :, :2], torch.zeros(3, 2)) and torch.equal(states[0, :, 2:], x[0:2].T)
    assert torch.equal(states[1], x[5:9].T)


def test_fla_causal_conv1d_per_sequence_with_states_and_residual():
    # cu_seqlens: each packed sequence convolved on its own, from its own initial state [N, D, W]
    cu = torch.tensor([0, 3, 10, 13])
    inputs = dict(
        x=_rand(1, 13, 6, seed=8), weight=_rand(6, 4, seed=9), bias=_rand(6, seed=10),
        residual=_rand(1, 13, 6, seed=11), state=_rand(3, 6, 4, seed=12),
    )  # fmt: skip

    def stand_in(x, weight, bias, residual, state):
        return kernels.fla_causal_conv1d(
            x, weight, bias, residual, initial_state=state, output_final_state=True, activation="silu", cu_seqlens=cu
        )

    def reference(x, weight, bias, residual, state):
        outs, finals = [], []
        for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
            piece = x[:, a:b].transpose(1, 2)
            outs.append(conv_reference(piece, weight, bias, before_BDK=state[n : n + 1, :, 1:]).transpose(1, 2))
            finals.append(torch.cat([state[n], piece[0]], dim=-1)[:, -4:])
        return torch.cat(outs, dim=1) + residual, torch.stack(finals)

    _grads_agree(inputs, stand_in, reference)


def test_fla_causal_conv1d_batched_without_states():
    inputs = dict(x=_rand(2, 9, 5, seed=13), weight=_rand(5, 3, seed=14))
    _grads_agree(
        inputs,
        lambda x, weight: kernels.fla_causal_conv1d(x, weight, activation="silu")[0],
        lambda x, weight: conv_reference(x.transpose(1, 2), weight).transpose(1, 2),
    )


# ---- gated RMSNorm ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_rmsnorm_groups_and_gate(norm_before_gate):
    inputs = dict(x=_rand(3, 4, 12, seed=15), z=_rand(3, 4, 12, seed=16), weight=_rand(12, seed=17))
    _grads_agree(
        inputs,
        lambda x, z, weight: kernels.rmsnorm_fn(x, weight, None, z, 1e-5, 4, norm_before_gate),
        lambda x, z, weight: gated_rmsnorm_reference(x, weight, z, 1e-5, 4, norm_before_gate),
    )
    norm = kernels.RMSNorm(12, eps=1e-5, group_size=6, norm_before_gate=False)
    x = inputs["x"]
    _close(norm(x), gated_rmsnorm_reference(x, torch.ones(12), None, 1e-5, 6), "RMSNorm(x) without a gate")


# ---- Mamba-2 SSD --------------------------------------------------------------------------------------------------

HEADS, HEADDIM, GROUPS, DSTATE = 4, 3, 2, 5


def _ssd_inputs(batch=2, length=11, seed=20):
    return dict(
        x=_rand(batch, length, HEADS, HEADDIM, seed=seed),
        dt=_rand(batch, length, HEADS, seed=seed + 1),
        A=-torch.rand(HEADS, generator=torch.Generator().manual_seed(seed + 2)) - 0.5,
        B=_rand(batch, length, GROUPS, DSTATE, seed=seed + 3),
        C=_rand(batch, length, GROUPS, DSTATE, seed=seed + 4),
        D=_rand(HEADS, seed=seed + 5),
        z=_rand(batch, length, HEADS, HEADDIM, seed=seed + 6),
        dt_bias=_rand(HEADS, seed=seed + 7),
        initial=_rand(batch, HEADS, HEADDIM, DSTATE, seed=seed + 8),
    )


# sequence 1 starts inside the first chunk of 4, sequence 2 on a chunk boundary
SEQ_IDX = torch.tensor([[0] * 2 + [1] * 6 + [2] * 3, [0] * 5 + [1] * 6], dtype=torch.int32)


@pytest.mark.parametrize("packed", [False, True])
def test_mamba_chunk_scan_combined_matches_a_sequential_scan(packed):
    seq_idx = SEQ_IDX if packed else None

    def stand_in(x, dt, A, B, C, D, z, dt_bias, initial):
        return kernels.mamba_chunk_scan_combined(
            x, dt, A, B, C, 4, D=D, z=z, dt_bias=dt_bias, initial_states=initial, seq_idx=seq_idx, dt_softplus=True,
            return_final_states=True,
        )  # fmt: skip

    def reference(x, dt, A, B, C, D, z, dt_bias, initial):
        return ssd_reference(x, dt, A, B, C, D, z, dt_bias, seq_idx, initial)

    _grads_agree(_ssd_inputs(), stand_in, reference)


def test_mamba_chunk_scan_combined_varlen_states_and_headdim_d():
    inputs = _ssd_inputs(batch=1, length=11)
    inputs["D"] = _rand(HEADS, HEADDIM, seed=30)
    cu = torch.tensor([0, 2, 8, 11])
    seq_idx = SEQ_IDX[:1]
    x, dt, A, B, C, D, z, bias, _ = inputs.values()
    out, varlen = kernels.mamba_chunk_scan_combined(
        x, dt, A, B, C, 4, D=D, dt_bias=bias, seq_idx=seq_idx, cu_seqlens=cu, dt_softplus=True,
        return_varlen_states=True,
    )  # fmt: skip
    want, _ = ssd_reference(x, dt, A, B, C, D, None, bias, seq_idx)
    _close(out, want, "out")
    for n, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        piece = {k: t[:, a:b] for k, t in dict(x=x, dt=dt, B=B, C=C).items()}
        _, final = ssd_reference(piece["x"], piece["dt"], A, piece["B"], piece["C"], D, None, bias)
        _close(varlen[n], final[0], f"sequence {n}'s final state")


@pytest.mark.parametrize("with_norm", [False, True])
def test_mamba_split_conv1d_scan_combined_is_conv_then_scan_then_gate(with_norm):
    # The mixer's training call: z, xBC and dt from one projection; conv, SSD, then silu(z) or the gated RMSNorm.
    batch, length, width = 2, 11, 4
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * DSTATE
    inputs = dict(
        zxbcdt=_rand(batch, length, dim + conv_dim + HEADS, seed=40), weight=_rand(conv_dim, width, seed=41),
        bias=_rand(conv_dim, seed=42), dt_bias=_rand(HEADS, seed=43),
        A=-torch.rand(HEADS, generator=torch.Generator().manual_seed(44)) - 0.5, D=_rand(HEADS, seed=45),
        norm=_rand(dim, seed=46),
    )  # fmt: skip

    def stand_in(zxbcdt, weight, bias, dt_bias, A, D, norm):
        return kernels.mamba_split_conv1d_scan_combined(
            zxbcdt, weight, bias, dt_bias, A, D, 4, seq_idx=SEQ_IDX, headdim=HEADDIM, ngroups=GROUPS,
            rmsnorm_weight=norm if with_norm else None, norm_before_gate=False, return_final_states=True,
        )  # fmt: skip

    def reference(zxbcdt, weight, bias, dt_bias, A, D, norm):
        z, xBC, dt = zxbcdt.split([dim, conv_dim, HEADS], dim=-1)
        xBC = conv_reference(xBC.transpose(1, 2), weight, bias, SEQ_IDX).transpose(1, 2)
        x, B, C = xBC.split([dim, GROUPS * DSTATE, GROUPS * DSTATE], dim=-1)
        x = x.reshape(batch, length, HEADS, HEADDIM)
        B, C = (t.reshape(batch, length, GROUPS, DSTATE) for t in (B, C))
        gate = None if with_norm else z.reshape(batch, length, HEADS, HEADDIM)
        y, final = ssd_reference(x, dt, A, B, C, D, gate, dt_bias, SEQ_IDX)
        y = y.reshape(batch, length, dim)
        if with_norm:
            y = gated_rmsnorm_reference(y, norm, z, 1e-6, dim // GROUPS, norm_before_gate=False)
        return y, final

    _grads_agree(inputs, stand_in, reference)  # without the norm its weight gets no gradient in either


def test_mamba_split_conv1d_scan_combined_with_a_swiglu_part_and_the_output_projection():
    # not the mixer's call, but the function's: 2 * d_nonssm leading features go through SwiGLU, put before the SSD
    # output, then the output projection
    batch, length, extra, out_dim = 1, 9, 3, 7
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * DSTATE
    inputs = dict(
        zxbcdt=_rand(batch, length, 2 * extra + dim + conv_dim + HEADS, seed=47),
        weight=_rand(conv_dim, 4, seed=48), proj=_rand(out_dim, extra + dim, seed=49),
        proj_bias=_rand(out_dim, seed=50),
    )  # fmt: skip
    A, D, dt_bias = -torch.ones(HEADS), torch.ones(HEADS), torch.zeros(HEADS)

    def stand_in(zxbcdt, weight, proj, proj_bias):
        return kernels.mamba_split_conv1d_scan_combined(
            zxbcdt, weight, None, dt_bias, A, D, 4, headdim=HEADDIM, ngroups=GROUPS, outproj_weight=proj,
            outproj_bias=proj_bias,
        )  # fmt: skip

    def reference(zxbcdt, weight, proj, proj_bias):
        zx0, rest = zxbcdt.split([2 * extra, zxbcdt.shape[-1] - 2 * extra], dim=-1)
        z, xBC, dt = rest.split([dim, conv_dim, HEADS], dim=-1)
        xBC = conv_reference(xBC.transpose(1, 2), weight).transpose(1, 2)
        x, B, C = xBC.split([dim, GROUPS * DSTATE, GROUPS * DSTATE], dim=-1)
        x = x.reshape(batch, length, HEADS, HEADDIM)
        B, C = (t.reshape(batch, length, GROUPS, DSTATE) for t in (B, C))
        y, _ = ssd_reference(x, dt, A, B, C, D, z.reshape(batch, length, HEADS, HEADDIM), dt_bias)
        swiglu = F.silu(zx0[..., :extra]) * zx0[..., extra:]
        return torch.cat([swiglu, y.reshape(batch, length, dim)], dim=-1) @ proj.T + proj_bias

    _grads_agree(inputs, stand_in, reference)


# ---- gated delta rule ---------------------------------------------------------------------------------------------


def _gdn_inputs(batch=2, length=37, heads=2, value_heads=4, dk=6, dv=5, seed=50):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        q=F.normalize(torch.randn(batch, length, heads, dk, generator=gen), dim=-1),
        k=F.normalize(torch.randn(batch, length, heads, dk, generator=gen), dim=-1),
        v=torch.randn(batch, length, value_heads, dv, generator=gen),
        g=-torch.rand(batch, length, value_heads, generator=gen),
        beta=torch.rand(batch, length, value_heads, generator=gen),
    )


@pytest.mark.parametrize("with_state", [False, True])
def test_chunk_gated_delta_rule_matches_the_per_step_recurrence(with_state):
    # 37 steps in chunks of 16; four value heads on two query/key heads (grouped value attention)
    inputs = _gdn_inputs()
    if with_state:
        inputs["state"] = _rand(2, 4, 6, 5, seed=51)
    scale = 0.7

    def stand_in(q, k, v, g, beta, state=None):
        return kernels.chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, scale=scale, initial_state=state, output_final_state=True, chunk_size=16
        )

    def reference(q, k, v, g, beta, state=None):
        return delta_rule_reference(q, k, v, g, beta, scale, state)

    _grads_agree(inputs, stand_in, reference)


def test_chunk_gated_delta_rule_packed_sequences_each_start_from_their_state():
    # as Megatron-Core's GDN calls it for a packed (THD) microbatch: batch 1, cu_seqlens, no initial state
    inputs = _gdn_inputs(batch=1, length=37)
    inputs["state"] = _rand(3, 4, 6, 5, seed=52)
    cu = torch.tensor([0, 5, 26, 37])
    spans = [(0, a, b) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())]

    def stand_in(q, k, v, g, beta, state):
        return kernels.chunk_gated_delta_rule(
            q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True, cu_seqlens=cu, chunk_size=16
        )

    def reference(q, k, v, g, beta, state):
        return delta_rule_reference(q, k, v, g, beta, 6**-0.5, state, spans)

    _grads_agree(inputs, stand_in, reference)


def test_chunk_gated_delta_rule_with_megatron_cores_call():
    # Megatron-Core's call (no scale, no state, no l2norm in kernel): also equal to its own torch implementation,
    # the one its deterministic mode uses.
    from megatron.core.ssm.gated_delta_net.common import torch_chunk_gated_delta_rule

    q, k, v, g, beta = _gdn_inputs(heads=4).values()
    got, none = kernels.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None, output_final_state=False,
                                               use_qk_l2norm_in_kernel=False, cu_seqlens=None)  # fmt: skip
    assert none is None
    _close(got, delta_rule_reference(q, k, v, g, beta, 6**-0.5)[0], "reference")
    _close(got, torch_chunk_gated_delta_rule(q, k, v, g, beta)[0], "Megatron-Core's torch_chunk_gated_delta_rule")


def test_l2norm():
    inputs = dict(x=_rand(3, 7, 2, 6, seed=60))
    _grads_agree(
        inputs,
        lambda x: kernels.l2norm(x),
        lambda x: x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6),
    )


# ---- installed as the packages ------------------------------------------------------------------------------------


def _install_after_import(rank: int, world: int) -> dict:
    import megatron.core.ssm.gated_delta_net  # noqa: F401  imported first: Megatron-Core found no package then
    import megatron.core.ssm.mamba_mixer as mixer

    before = {"HAVE_MAMBA_SSM": mixer.HAVE_MAMBA_SSM}
    kernels.install_mamba_kernels()
    kernels.install_gdn_kernels()
    import importlib.util

    from megatron.core.ssm.mamba_mixer import _check_mamba_sequence_packing_support

    found = {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d", "fla")}
    return {
        "before": before,
        "after": kernels.installed(),
        "packing": _check_mamba_sequence_packing_support(False),
        "found": found,  # transformers looks for the packages this way when Bridge imports its model classes
    }


def test_megatron_core_picks_the_stand_ins_up_even_when_imported_first():
    (outcome,) = run_local_ranks(_install_after_import, 1)
    assert outcome.result["before"] == {"HAVE_MAMBA_SSM": False}
    assert all(outcome.result["after"].values()), outcome.result["after"]
    assert outcome.result["packing"] == (True, None)  # its packed-sequence check reads the stand-ins' versions
    assert all(outcome.result["found"].values()), outcome.result["found"]
