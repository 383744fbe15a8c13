"""``moe_cte``: blockwise mixture-of-experts expert computation (context encoding), reference.

Arguments (upstream NKI-lib names and layouts)::

    hidden_states             (T+1, H)      row T is the padding row (any values)
    expert_affinities_masked  ((T+1)*E, 1)  affinity of token t for expert e at t*E + e
                                            (0 for experts the router did not pick)
    gate_up_proj_weight       (E, H, 2, I)  [:, :, 0] gate, [:, :, 1] up projection ([in, out])
    down_proj_weight          (E, I, H)
    token_position_to_id      (N*B,) int32  token of each block slot; padding slots hold T
    block_to_expert           (N, 1) int32  expert of each block (must be < E)
    block_size                B (any; 512 keeps every matmul a full tile)

Semantics: for every block b with e = block_to_expert[b] and ids its B slots,
``out[ids] += aff[ids, e] * ((silu(x[ids] Wg[e]) * (x[ids] Wu[e])) Wd[e])``, summed over all
blocks a token appears in (top-k routing). ``out`` is (T+1, H) in hidden_states' dtype; row T
accumulates the padding slots and is not meaningful.

LNC=2 (the shard-on-block variant): the two programs take alternate blocks and each
accumulates into its own slice of an output of shape (2, T+1, H) -- the result is
``out.sum(0)`` (the torch op does this); cores never write the same rows, so no
cross-core synchronisation is needed.

Per block: the B token rows are gathered with indirect DMAs (one index per partition), the
expert's weights are fetched with DMAs whose expert offset is the run-time value of
block_to_expert[b] (``scalar_offset``), x^T is built on TensorE and the gated MLP runs as in
``mlp`` (weights stationary, 512 tokens moving); the down projection is scaled by the
gathered affinities and added (fp32) to the gathered output rows, which are scattered back.

Numerics: bf16 matmuls (fp32 for fp32 inputs), fp32 accumulation; each block's contribution
is added to the output in fp32 and rounded once per block. Tolerance vs :func:`moe_cte_ref`:
fp32 1e-4, bf16 2e-2 (relative to max |out|).

:func:`moe_cte_bwd` is the backward kernel (AWS: ``blockwise_mm_backward``; recomputes h_g,
h_u; row T of dout ignored, row T of d_hidden / d_affinities 0), :func:`moe_cte_bwd_ref` its
reference. Tolerance (max |err| / max |ref|): fp32 1e-5, bf16 2e-2.
"""

from __future__ import annotations

import numpy as np

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, matmul_dtype, shape_error
from .gated_mlp import GatedMLP, TensorEScratch, load_row_chunks


def _check_moe_shapes(name, hidden_states, expert_affinities_masked, gate_up_proj_weight,
                      down_proj_weight, token_position_to_id, block_to_expert, block_size):
    """Validate the moe_cte layouts shared by forward and backward; returns T+1, H, E, I, N, B."""
    T1, H = hidden_states.shape
    E, H2, two, I = gate_up_proj_weight.shape
    N = block_to_expert.shape[0]
    B = int(block_size)
    if H2 != H or two != 2 or tuple(down_proj_weight.shape) != (E, I, H):
        shape_error(name, f"gate_up_proj_weight {gate_up_proj_weight.shape} must be (E, H={H}, 2, "
                    f"I) and down_proj_weight {down_proj_weight.shape} (E, I, H)",
                    "pass [in, out] expert weights")
    if tuple(expert_affinities_masked.shape) != (T1 * E, 1):
        shape_error(name, f"expert_affinities_masked {expert_affinities_masked.shape} must be "
                    f"((T+1)*E, 1) = ({T1 * E}, 1)", "flatten the (T+1, E) affinities")
    if tuple(token_position_to_id.shape) != (N * B,):
        shape_error(name, f"token_position_to_id {token_position_to_id.shape} must be "
                    f"(N*block_size,) = ({N * B},)", "one token id per block slot")
    return T1, H, E, I, N, B


def _gather_token_rows(ids_flat, hidden_states, s0, rows, H, mdt):
    """Token ids ``ids_flat[s0:s0+rows]`` of a block slot and their hidden-state rows (indirect DMA)."""
    idx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=idx, src=ids_flat[s0:s0 + rows, :])
    xr = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
    nisa.dma_copy(dst=xr, src=hidden_states.ap([[H, rows], [1, H]], vector_offset=idx,
                                               indirect_dim=0))
    return idx, xr


def _gather_affinities(idx, block_to_expert, expert_affinities_masked, b, rows, E):
    """Each token's affinity to block ``b``'s expert: flat index ``t*E + e`` (``e`` broadcast to
    every partition by DMA), then an indirect DMA of the fp32 affinities. Returns (index, aff)."""
    e_col = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=e_col, src=block_to_expert[b:b + 1, :].broadcast_to((rows, 1)))
    aidx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
    nisa.tensor_scalar(aidx, idx, nl.multiply, float(E), op1=nl.add, operand1=e_col)
    aff = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=aff, src=expert_affinities_masked.ap([[1, rows], [1, 1]], vector_offset=aidx,
                                                          indirect_dim=0))
    return aidx, aff


@nki.jit
def moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
            token_position_to_id, block_to_expert, block_size):
    """Blockwise MoE (SiLU-gated experts); see the module docstring."""
    name = "moe_cte"
    T1, H, E, I, N, B = _check_moe_shapes(name, hidden_states, expert_affinities_masked,
                                           gate_up_proj_weight, down_proj_weight,
                                           token_position_to_id, block_to_expert, block_size)
    mdt = matmul_dtype(hidden_states.dtype)
    nprog = nl.num_programs()
    pid = nl.program_id(0)
    out_all = nl.ndarray((nprog, T1, H) if nprog > 1 else (T1, H), hidden_states.dtype,
                         buffer=nl.shared_hbm)
    out = out_all[pid] if nprog > 1 else out_all
    # zero this program's output (DMA from a zero tile; every row chunk)
    zero = nl.ndarray((P, H), hidden_states.dtype, buffer=nl.sbuf)
    nisa.memset(zero, 0.0, engine=nisa.engine.gpsimd)
    for r0 in range(0, T1, P):
        nisa.dma_copy(dst=out[r0:min(T1, r0 + P), :], src=zero[:min(P, T1 - r0), :])
    g = GatedMLP(H, I, mdt)
    ids_flat = token_position_to_id.reshape((N * B, 1))
    for b in range(pid, N, nprog):
        e_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=e_t, src=block_to_expert[b:b + 1, :])

        def load_gate(dst, ic, ki):
            load_row_chunks(dst, gate_up_proj_weight, H, 2 * I, ic * P, ki,
                            pre=[[H * 2 * I, 1]], offset=0, scalar_offset=e_t)

        def load_up(dst, ic, ki):
            load_row_chunks(dst, gate_up_proj_weight, H, 2 * I, ic * P, ki,
                            pre=[[H * 2 * I, 1]], offset=I, scalar_offset=e_t)

        def load_down(dst, h0, hw):
            load_row_chunks(dst, down_proj_weight, I, H, h0, hw, pre=[[I * H, 1]],
                            scalar_offset=e_t)

        for c0 in range(0, B, 512):  # token tiles of up to 512 within the block
            tt = min(512, B - c0)
            idxs, rows_tiles, affs, accs = [], [], [], []
            for s in range(cdiv(tt, P)):
                rows = min(P, tt - s * P)
                s0 = b * B + c0 + s * P
                idx, xr = _gather_token_rows(ids_flat, hidden_states, s0, rows, H, mdt)
                aidx, aff = _gather_affinities(idx, block_to_expert, expert_affinities_masked, b,
                                               rows, E)
                acc = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=acc, src=out.ap([[H, rows], [1, H]], vector_offset=idx,
                                                  indirect_dim=0))
                idxs.append(idx)
                rows_tiles.append(xr)
                affs.append(aff)
                accs.append(acc)
            xT = g.transpose_in(rows_tiles, tt)
            hT = g.up(xT, tt, load_gate, load_up)

            def emit(s, rows, h0, hw, o):
                # acc += aff * y  (one VectorE instruction, fp32)
                nisa.scalar_tensor_tensor(accs[s][:, h0:h0 + hw], o, nl.multiply, affs[s],
                                          nl.add, accs[s][:, h0:h0 + hw])

            g.down(hT, tt, load_down, emit)
            for s in range(len(accs)):
                rows = accs[s].shape[0]
                res = nl.ndarray((rows, H), hidden_states.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(res, accs[s])
                nisa.dma_copy(dst=out.ap([[H, rows], [1, H]], vector_offset=idxs[s],
                                         indirect_dim=0), src=res)
    return out_all


@nki.jit
def moe_cte_shard_on_i(hidden_states, expert_affinities_masked, gate_up_proj_weight,
                       down_proj_weight, token_position_to_id, block_to_expert, block_size):
    """Blockwise MoE with the intermediate dimension I sharded across the LNC's cores.

    Same arguments and semantics as :func:`moe_cte`, output (T+1, H). Under LNC=2 core c
    computes the gated MLP of every block for I columns [c I/2, (c+1) I/2) -- half of each
    expert's weights, so the two cores read disjoint weight halves -- giving a partial
    down-projection [tokens, H]. The cores exchange the H half the other one owns with
    ``nisa.sendrecv`` and each adds the two partials for its half, scales by the affinities
    and read-modify-writes its H half of the gathered output rows: the cores never write the
    same bytes, and every block needs one exchange. LNC=1 runs the whole I on one core.
    """
    name = "moe_cte_shard_on_i"
    T1, H, E, I, N, B = _check_moe_shapes(name, hidden_states, expert_affinities_masked,
                                           gate_up_proj_weight, down_proj_weight,
                                           token_position_to_id, block_to_expert, block_size)
    nprog = nl.num_programs()
    pid = nl.program_id(0)
    if nprog > 1 and (I % nprog or H % nprog):
        shape_error(name, f"I={I} and H={H} must be divisible by the {nprog} cores",
                    "pad I and H to even sizes")
    Ic, Hc = I // nprog, H // nprog
    i_off, h_own = pid * Ic, pid * Hc
    mdt = matmul_dtype(hidden_states.dtype)
    out = nl.ndarray((T1, H), hidden_states.dtype, buffer=nl.shared_hbm)
    zero = nl.ndarray((P, Hc), hidden_states.dtype, buffer=nl.sbuf)
    nisa.memset(zero, 0.0, engine=nisa.engine.gpsimd)
    for r0 in range(0, T1, P):  # each core zeroes its column half
        nisa.dma_copy(dst=out[r0:min(T1, r0 + P), h_own:h_own + Hc], src=zero[:min(P, T1 - r0), :])
    if nprog > 1:
        nisa.core_barrier(out, (0, 1))  # both halves zeroed before any block reads them
    g = GatedMLP(H, Ic, mdt)
    ids_flat = token_position_to_id.reshape((N * B, 1))
    for b in range(N):
        e_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=e_t, src=block_to_expert[b:b + 1, :])

        def load_gate(dst, ic, ki):
            load_row_chunks(dst, gate_up_proj_weight, H, 2 * I, i_off + ic * P, ki,
                            pre=[[H * 2 * I, 1]], offset=0, scalar_offset=e_t)

        def load_up(dst, ic, ki):
            load_row_chunks(dst, gate_up_proj_weight, H, 2 * I, i_off + ic * P, ki,
                            pre=[[H * 2 * I, 1]], offset=I, scalar_offset=e_t)

        def load_down(dst, h0, hw):
            load_row_chunks(dst, down_proj_weight, Ic, H, h0, hw, pre=[[I * H, 1]],
                            offset=i_off * H, scalar_offset=e_t)

        for c0 in range(0, B, 512):
            tt = min(512, B - c0)
            idxs, rows_tiles, affs, parts = [], [], [], []
            for s in range(cdiv(tt, P)):
                rows = min(P, tt - s * P)
                s0 = b * B + c0 + s * P
                idx, xr = _gather_token_rows(ids_flat, hidden_states, s0, rows, H, mdt)
                aidx, aff = _gather_affinities(idx, block_to_expert, expert_affinities_masked, b,
                                               rows, E)
                part = nl.ndarray((rows, H), nl.float32, buffer=nl.sbuf)
                idxs.append(idx)
                rows_tiles.append(xr)
                affs.append(aff)
                parts.append(part)
            xT = g.transpose_in(rows_tiles, tt)
            hT = g.up(xT, tt, load_gate, load_up)

            def emit(s, rows, h0, hw, o):
                # partial (this core's I columns) scaled by the affinity, fp32
                nisa.tensor_scalar(parts[s][:, h0:h0 + hw], o, nl.multiply, affs[s])

            g.down(hT, tt, load_down, emit)
            for s in range(len(parts)):
                rows = parts[s].shape[0]
                own = parts[s][:, h_own:h_own + Hc]
                if nprog > 1:
                    other = parts[s][:, (1 - pid) * Hc:(2 - pid) * Hc]
                    got = nl.ndarray((rows, Hc), nl.float32, buffer=nl.sbuf)
                    nisa.sendrecv(other, got, send_to_rank=1 - pid, recv_from_rank=1 - pid,
                                  pipe_id=0)
                    nisa.tensor_tensor(own, own, got, nl.add)
                dst = out[:, h_own:h_own + Hc]
                cur = nl.ndarray((rows, Hc), nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=cur, src=dst.ap([[H, rows], [1, Hc]], vector_offset=idxs[s],
                                                  indirect_dim=0))
                res = nl.ndarray((rows, Hc), hidden_states.dtype, buffer=nl.sbuf)
                nisa.tensor_tensor(res, cur, own, nl.add)
                nisa.dma_copy(dst=dst.ap([[H, rows], [1, Hc]], vector_offset=idxs[s],
                                         indirect_dim=0), src=res)
    return out


def moe_cte_ref(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                token_position_to_id, block_to_expert, block_size):
    """PyTorch reference (fp32 math; padding row T excluded, set to 0). Returns (T+1, H)."""
    import torch
    T1, H = hidden_states.shape
    E = gate_up_proj_weight.shape[0]
    x = hidden_states.float()
    aff = expert_affinities_masked.float().reshape(T1, E)
    out = torch.zeros(T1, H)
    ids_all = token_position_to_id.long().reshape(-1, block_size)
    for b in range(block_to_expert.shape[0]):
        e = int(block_to_expert[b, 0])
        ids = ids_all[b]
        w = gate_up_proj_weight[e].float()
        xb = x[ids]
        h = torch.nn.functional.silu(xb @ w[:, 0]) * (xb @ w[:, 1])
        y = (h @ down_proj_weight[e].float()) * aff[ids, e][:, None]
        out.index_add_(0, ids, y)
    out[T1 - 1] = 0
    return out.to(hidden_states.dtype)


def make_blocks(expert_ids, num_experts, block_size, num_tokens):
    """Host-side helper (torch): build ``token_position_to_id`` and ``block_to_expert`` from
    a (T, k) tensor of routed expert ids: each expert's tokens fill blocks of ``block_size``,
    padded with the padding row ``num_tokens``."""
    import torch
    ids, blocks = [], []
    for e in range(num_experts):
        toks = (expert_ids == e).any(-1).nonzero().flatten()
        for s in range(0, len(toks), block_size):
            chunk = toks[s:s + block_size]
            pad = torch.full((block_size - len(chunk),), num_tokens, dtype=torch.long)
            ids.append(torch.cat([chunk, pad]))
            blocks.append(e)
    if not blocks:  # keep at least one (all-padding) block
        ids.append(torch.full((block_size,), num_tokens, dtype=torch.long))
        blocks.append(0)
    return (torch.cat(ids).to(torch.int32),
            torch.tensor(blocks, dtype=torch.int32).reshape(-1, 1))


# ---------------------------------------------------------------------------------------------
# backward (AWS NKI-lib: blockwise_mm_backward)
# ---------------------------------------------------------------------------------------------
_BWD_SBUF_BUDGET = 170000  # bytes per partition for one token chunk's working set
_ZW = 2048  # free size of the zero / cast DMA chunks (elements per partition row)
_DXW = 512  # dx columns per PSUM accumulation
_ICG = 16  # 128-row chunks of I per streamed W^T block in the dx phase
_WG_COLS = 2048  # weight-gradient columns per read-modify-write DMA
_WG_SLAB = 49152  # bytes per partition of one weight-gradient read-modify-write slab


def _flat_chunks(n):
    """(offset, rows, width) pieces covering n elements as [rows, width] row-major blocks."""
    out, o = [], 0
    while n - o >= _ZW:
        rows = min(P, (n - o) // _ZW)
        out.append((o, rows, _ZW))
        o += rows * _ZW
    if n - o:
        out.append((o, 1, n - o))
    return out


def _zero_hbm(t, n, zero, base=0):
    """Zero elements base..base+n of HBM tensor ``t`` with DMAs from an SBUF zero tile."""
    for o, rows, w in _flat_chunks(n):
        nisa.dma_copy(dst=t.ap([[w, rows], [1, w]], offset=base + o), src=zero[:rows, :w])


def _copy_hbm(dst, src, n):
    """HBM -> HBM copy of n elements (the DMA casts through fp32 when the dtypes differ)."""
    for o, rows, w in _flat_chunks(n):
        nisa.dma_copy(dst=dst.ap([[w, rows], [1, w]], offset=o), src=src.ap([[w, rows], [1, w]],
                                                                            offset=o))


@nki.jit
def moe_cte_bwd(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
                token_position_to_id, block_to_expert, dout, block_size):
    """Backward of :func:`moe_cte` (AWS NKI-lib: ``blockwise_mm_backward``) for the output
    gradient ``dout`` (T+1, H).

    Returns ``(d_hidden (T+1, H) in hidden_states' dtype, d_affinities ((T+1)*E, 1) fp32,
    d_gate_up (E, H, 2, I), d_down (E, I, H) in the weights' dtypes)``. Under LNC=2 (shard on
    block: the programs take alternate blocks) every output is a per-core fp32 partial with a
    leading dimension 2, which the caller sums (no cross-core synchronisation).

    Padding: row T of ``dout`` is ignored (padding slots contribute nothing to any gradient:
    their affinity is masked to 0), and row T of d_hidden / d_affinities is 0 -- as
    :func:`moe_cte_bwd_ref`. (Equivalently: autograd of the forward with dout[T] = 0.)

    Per block b (e = block_to_expert[b], run-time) and chunk of up to 512 slots, with
    a = silu(h_g) h_u, g = dout Wd^T (unscaled): d_aff[t*E+e] += rowsum(a * g)
    (= rowsum(dout * y), y = a Wd), da = aff g, dWd[e] += a^T (aff dout),
    dh_u = da silu(h_g), dh_g = da h_u silu'(h_g), dx += dh_g Wg^T + dh_u Wu^T,
    dWg[e] += x^T dh_g, dWu[e] += x^T dh_u.

    Phases: (0) Wg^T, Wu^T (E, I, H) and Wd^T (E, H, I) for every expert by TensorE transposes
    into private HBM scratch; fp32 accumulators zeroed. (1) per block chunk: token rows of x
    and dout gathered by indirect DMA, x^T / dout^T by TensorE transposes; per 128 columns of
    I and 128 tokens h_g, h_u, g accumulate over H in PSUM (stationary x^T / dout^T, moving
    the expert's weight columns, loaded with ``scalar_offset`` = e); the SiLU' chain on
    ScalarE / VectorE / GpSimd; dh^T by TensorE transposes; dx [tokens, 512 of H] over I
    (W^T streamed from scratch), added into the fp32 d_hidden rows (gather, add, scatter --
    top-k duplicates across blocks accumulate); d_aff likewise; the weight gradients contract
    over the chunk's tokens (already on partitions) in PSUM and are added into the expert's
    fp32 accumulator slice by read-modify-write DMAs at the run-time expert offset.
    (2) bf16: the fp32 accumulators are cast into the outputs (HBM -> HBM DMAs).
    """
    name = "moe_cte_bwd"
    T1, H, E, I, N, B = _check_moe_shapes(name, hidden_states, expert_affinities_masked,
                                           gate_up_proj_weight, down_proj_weight,
                                           token_position_to_id, block_to_expert, block_size)
    if tuple(dout.shape) != (T1, H):
        shape_error(name, f"dout {dout.shape} must be (T+1, H) = ({T1}, {H})",
                    "pass the gradient of moe_cte's output")
    T = T1 - 1
    mdt = matmul_dtype(hidden_states.dtype)
    bsz = mdt.itemsize
    HC, IC = cdiv(H, P), cdiv(I, P)
    # token chunk: up to 512 slots of a block, smaller if the SBUF working set needs it
    TB = None
    for tb in (512, 256, P):
        ns = cdiv(tb, P)
        common = (2 * ns * H + 3 * ns * I + 2 * IC * tb) * bsz  # x, dy rows; a, dh; dh^T
        est = common + max(2 * HC * tb * bsz + 3 * HC * P * bsz + 8 * P * 4,  # x^T, dout^T, W
                           ns * H * 4 + 2 * min(IC, _ICG) * _DXW * bsz,  # dx rows, W^T
                           _WG_SLAB)  # weight-gradient slab
        if est <= _BWD_SBUF_BUDGET:
            TB = tb
            break
    if TB is None:
        shape_error(name, f"H={H}, I={I} need about {est} bytes per SBUF partition even with "
                    f"128-token chunks (limit {_BWD_SBUF_BUDGET})",
                    "shard I (or H) across calls and sum the gradients")
    nprog = nl.num_programs()
    pid = nl.program_id(0)
    f32 = nl.float32
    ngu, ndd = E * H * 2 * I, E * I * H
    if nprog > 1:  # per-core fp32 partials, caller sums dim 0
        dx_o = nl.ndarray((nprog, T1, H), f32, buffer=nl.shared_hbm)
        da_o = nl.ndarray((nprog, T1 * E, 1), f32, buffer=nl.shared_hbm)
        dgu_o = nl.ndarray((nprog, E, H, 2, I), f32, buffer=nl.shared_hbm)
        ddn_o = nl.ndarray((nprog, E, I, H), f32, buffer=nl.shared_hbm)
        dx_acc, da_acc, dgu_acc, ddn_acc = dx_o[pid], da_o[pid], dgu_o[pid], ddn_o[pid]
        cast = False
    else:
        dx_o = nl.ndarray((T1, H), hidden_states.dtype, buffer=nl.shared_hbm)
        da_o = nl.ndarray((T1 * E, 1), f32, buffer=nl.shared_hbm)
        dgu_o = nl.ndarray((E, H, 2, I), gate_up_proj_weight.dtype, buffer=nl.shared_hbm)
        ddn_o = nl.ndarray((E, I, H), down_proj_weight.dtype, buffer=nl.shared_hbm)
        da_acc = da_o
        cast = any(np.dtype(t.dtype) != np.dtype(np.float32)
                   for t in (hidden_states, gate_up_proj_weight, down_proj_weight))
        if cast:
            dx_acc = nl.ndarray((T1, H), f32, buffer=nl.private_hbm)
            dgu_acc = nl.ndarray((E, H, 2, I), f32, buffer=nl.private_hbm)
            ddn_acc = nl.ndarray((E, I, H), f32, buffer=nl.private_hbm)
        else:
            dx_acc, dgu_acc, ddn_acc = dx_o, dgu_o, ddn_o
    zero = nl.ndarray((P, _ZW), f32, buffer=nl.sbuf)
    nisa.memset(zero, 0.0, engine=nisa.engine.gpsimd)
    for t, n in ((dx_acc, T1 * H), (da_acc, T1 * E), (dgu_acc, ngu), (ddn_acc, ndd)):
        _zero_hbm(t, n, zero)

    te = TensorEScratch(mdt, (P, 512), (P, 512))
    ident, next_tr, next_acc, evacuate = te.ident, te.next_tr, te.next_acc, te.evacuate

    # ---- phase 0: per-expert transposed weights in private HBM scratch ----------------------
    wgT = nl.ndarray((E, I, H), mdt, buffer=nl.private_hbm)
    wuT = nl.ndarray((E, I, H), mdt, buffer=nl.private_hbm)
    wdT = nl.ndarray((E, H, I), mdt, buffer=nl.private_hbm)

    for e in range(E):
        te.transpose_to_hbm(gate_up_proj_weight, H, I, wgT, off=e * H * 2 * I, rs=2 * I,
                            doff=e * I * H)
        te.transpose_to_hbm(gate_up_proj_weight, H, I, wuT, off=e * H * 2 * I + I, rs=2 * I,
                            doff=e * I * H)
        te.transpose_to_hbm(down_proj_weight, I, H, wdT, off=e * I * H, doff=e * H * I)

    # ---- phase 1: blocks ----------------------------------------------------------------------
    ids_flat = token_position_to_id.reshape((N * B, 1))


    def rmw(acc, estride, row_stride, nrows, ncols, base, e_t, psum_fn):
        """acc[e] (expert stride estride) rows 0..nrows (stride row_stride, at base) +=
        psum_fn(r0, kr, n0, nw): read-modify-write at the run-time expert offset, in slabs of
        up to _WG_SLAB bytes per partition (one load and one store DMA per slab: indirect
        accesses conflict with every other access of the tensor, so few large DMAs)."""
        for c0 in range(0, ncols, _WG_COLS):
            cw = min(_WG_COLS, ncols - c0)
            grp = min(max(1, _WG_SLAB // (cw * 4)), cdiv(nrows, P))
            for g0 in range(0, cdiv(nrows, P), grp):
                r_lo = g0 * P
                nr = min(nrows - r_lo, grp * P)
                slab = nl.ndarray((P, grp, cw), f32, buffer=nl.sbuf)
                off = base + r_lo * row_stride + c0
                full, tail = nr // P, nr % P
                views = []
                if full:
                    views.append((slab[:, :full, :cw], [[estride, 1], [row_stride, P],
                                                        [P * row_stride, full], [1, cw]], off))
                if tail:
                    views.append((slab[:tail, full, :cw], [[estride, 1], [row_stride, tail],
                                                           [1, cw]], off + full * P * row_stride))
                for sb, pat, o in views:
                    nisa.dma_copy(dst=sb, src=acc.ap(pat, offset=o, scalar_offset=e_t,
                                                      indirect_dim=0))
                for k in range(cdiv(nr, P)):
                    r0 = r_lo + k * P
                    kr = min(P, nrows - r0)
                    for n0 in range(c0, c0 + cw, 512):
                        nw = min(512, c0 + cw - n0)
                        ps = psum_fn(r0, kr, n0, nw)
                        dst = slab[:kr, k, n0 - c0:n0 - c0 + nw]
                        nisa.tensor_tensor(dst, dst, ps, nl.add)
                for sb, pat, o in views:
                    nisa.dma_copy(dst=acc.ap(pat, offset=o, scalar_offset=e_t, indirect_dim=0),
                                  src=sb)

    for b in range(pid, N, nprog):
        e_t = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=e_t, src=block_to_expert[b:b + 1, :])
        # the expert dimension of every weight access pattern is selected by e_t at run time:
        # pattern pair [stride, 1] with indirect_dim 0 (see load_row_chunks' ``pre``)
        pre_gu, pre_dd = [[H * 2 * I, 1]], [[I * H, 1]]
        for c0 in range(0, B, TB):
            tt = min(TB, B - c0)
            NS = cdiv(tt, P)
            idxs, xrs, drs, affs, aidxs = [], [], [], [], []
            for s in range(NS):
                rows = min(P, tt - s * P)
                s0 = b * B + c0 + s * P
                idx, xr = _gather_token_rows(ids_flat, hidden_states, s0, rows, H, mdt)
                dr = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
                nisa.dma_copy(dst=dr, src=dout.ap([[H, rows], [1, H]], vector_offset=idx,
                                                  indirect_dim=0))
                aidx, aff = _gather_affinities(idx, block_to_expert, expert_affinities_masked, b,
                                               rows, E)
                # padding slots (id T) contribute nothing: aff *= (id < T)
                nisa.tensor_scalar(aff, idx, nl.less, float(T), op1=nl.multiply, operand1=aff,
                                   engine=nisa.engine.gpsimd)
                idxs.append(idx)
                xrs.append(xr)
                drs.append(dr)
                affs.append(aff)
                aidxs.append(aidx)
            xT = te.transpose_rows(xrs, tt, H, TB)
            dT = te.transpose_rows(drs, tt, H, TB)
            # dy = aff * dout (token-major, for dWd), in place over the gathered dout rows
            for s in range(NS):
                nisa.tensor_scalar(drs[s], drs[s], nl.multiply, affs[s])
            a_t = nl.ndarray((P, NS, I), mdt, buffer=nl.sbuf)
            dg_t = nl.ndarray((P, NS, I), mdt, buffer=nl.sbuf)
            du_t = nl.ndarray((P, NS, I), mdt, buffer=nl.sbuf)
            dgT = nl.ndarray((P, IC, TB), mdt, buffer=nl.sbuf)
            duT = nl.ndarray((P, IC, TB), mdt, buffer=nl.sbuf)
            dap = nl.ndarray((P, NS, IC), f32, buffer=nl.sbuf)  # d_aff partial per I chunk
            for ic in range(IC):
                i0 = ic * P
                iw = min(P, I - i0)
                wg = nl.ndarray((P, HC, P), mdt, buffer=nl.sbuf)
                wu = nl.ndarray((P, HC, P), mdt, buffer=nl.sbuf)
                wd = nl.ndarray((P, HC, P), mdt, buffer=nl.sbuf)
                load_row_chunks(wg, gate_up_proj_weight, H, 2 * I, i0, iw, pre=pre_gu,
                                scalar_offset=e_t)
                load_row_chunks(wu, gate_up_proj_weight, H, 2 * I, i0, iw, pre=pre_gu,
                                offset=I, scalar_offset=e_t)
                load_row_chunks(wd, wdT, H, I, i0, iw, pre=[[H * I, 1]], scalar_offset=e_t)
                for s in range(NS):
                    rows = min(P, tt - s * P)
                    cols = slice(s * P, s * P + rows)
                    hg, hu, gg = [next_acc()[:rows, :iw] for _ in range(3)]
                    for dst, lhs, w in ((hg, xT, wg), (hu, xT, wu), (gg, dT, wd)):
                        for hc in range(HC):
                            kh = min(P, H - hc * P)
                            nisa.nc_matmul(dst, lhs[:kh, hc, cols], w[:kh, hc, :iw],
                                           accumulate=hc > 0)
                    sg = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.activation(sg, nl.sigmoid, hg)
                    hus = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.activation(hus, nl.identity, hu)
                    silu = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_tensor(silu, hg, sg, nl.multiply)
                    a32 = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_tensor(a32, silu, hus, nl.multiply, engine=nisa.engine.gpsimd)
                    nisa.tensor_copy(a_t[:rows, s, i0:i0 + iw], a32, engine=nisa.engine.gpsimd)
                    # d_aff partial: rowsum(a * g) (g = dout Wd^T, unscaled)
                    prod = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_tensor(prod, a32, gg, nl.multiply)
                    nisa.tensor_reduce(dap[:rows, s, ic:ic + 1], nl.add, prod, axis=1,
                                       keepdims=True)
                    da = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_scalar(da, gg, nl.multiply, affs[s])
                    nisa.tensor_tensor(du_t[:rows, s, i0:i0 + iw], da, silu, nl.multiply)
                    dah = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_tensor(dah, da, hus, nl.multiply)
                    # silu'(h) = (1 - s) silu + s
                    ds = nl.ndarray((rows, iw), f32, buffer=nl.sbuf)
                    nisa.tensor_scalar(ds, sg, nl.subtract, 1.0, reverse0=True,
                                       engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(ds, ds, silu, nl.multiply, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(ds, ds, sg, nl.add, engine=nisa.engine.gpsimd)
                    nisa.tensor_tensor(dg_t[:rows, s, i0:i0 + iw], dah, ds, nl.multiply,
                                       engine=nisa.engine.gpsimd)
                    ps = next_tr()
                    nisa.nc_matmul(ps[:iw, 0:rows], dg_t[:rows, s, i0:i0 + iw],
                                   ident[:rows, :rows], is_transpose=True)
                    nisa.nc_matmul(ps[:iw, P:P + rows], du_t[:rows, s, i0:i0 + iw],
                                   ident[:rows, :rows], is_transpose=True)
                    evacuate(dgT[:iw, ic, cols], ps[:iw, 0:rows])
                    evacuate(duT[:iw, ic, cols], ps[:iw, P:P + rows])
                del wg, wu, wd
            del xT, dT
            # d_aff[t*E + e] += sum over I chunks (gather, add, scatter)
            for s in range(NS):
                rows = min(P, tt - s * P)
                dsum = nl.ndarray((rows, 1), f32, buffer=nl.sbuf)
                nisa.tensor_reduce(dsum, nl.add, dap[:rows, s, :], axis=1, keepdims=True)
                cur = nl.ndarray((rows, 1), f32, buffer=nl.sbuf)
                nisa.dma_copy(dst=cur, src=da_acc.ap([[1, rows], [1, 1]], vector_offset=aidxs[s],
                                                     indirect_dim=0))
                nisa.tensor_tensor(cur, cur, dsum, nl.add)
                nisa.dma_copy(dst=da_acc.ap([[1, rows], [1, 1]], vector_offset=aidxs[s],
                                            indirect_dim=0), src=cur)
            # dx rows += dh_g Wg^T + dh_u Wu^T (gather the fp32 rows, add per 512 columns)
            dxr = []
            for s in range(NS):
                rows = min(P, tt - s * P)
                t = nl.ndarray((rows, H), f32, buffer=nl.sbuf)
                nisa.dma_copy(dst=t, src=dx_acc.ap([[H, rows], [1, H]], vector_offset=idxs[s],
                                                   indirect_dim=0))
                dxr.append(t)
            for h0 in range(0, H, _DXW):
                hw = min(_DXW, H - h0)
                accs = [next_acc() for _ in range(NS)]
                for g0 in range(0, IC, _ICG):
                    ng = min(_ICG, IC - g0)
                    nr = min(I - g0 * P, ng * P)
                    wgt = nl.ndarray((P, _ICG, _DXW), mdt, buffer=nl.sbuf)
                    wut = nl.ndarray((P, _ICG, _DXW), mdt, buffer=nl.sbuf)
                    load_row_chunks(wgt, wgT, nr, H, h0, hw, pre=pre_dd, offset=g0 * P * H,
                                    scalar_offset=e_t)
                    load_row_chunks(wut, wuT, nr, H, h0, hw, pre=pre_dd, offset=g0 * P * H,
                                    scalar_offset=e_t)
                    for s in range(NS):
                        rows = min(P, tt - s * P)
                        cols = slice(s * P, s * P + rows)
                        n = 0
                        for lhsT, wt in ((dgT, wgt), (duT, wut)):
                            for k in range(ng):
                                ki = min(P, I - (g0 + k) * P)
                                nisa.nc_matmul(accs[s][:rows, :hw], lhsT[:ki, g0 + k, cols],
                                               wt[:ki, k, :hw], accumulate=g0 > 0 or n > 0)
                                n += 1
                    del wgt, wut
                for s in range(NS):
                    rows = min(P, tt - s * P)
                    nisa.tensor_tensor(dxr[s][:, h0:h0 + hw], dxr[s][:, h0:h0 + hw],
                                       accs[s][:rows, :hw], nl.add)
            for s in range(NS):
                rows = min(P, tt - s * P)
                nisa.dma_copy(dst=dx_acc.ap([[H, rows], [1, H]], vector_offset=idxs[s],
                                            indirect_dim=0), src=dxr[s])
            del dxr, dgT, duT, lhsT, wt
            # weight gradients: contract over the chunk's tokens (on partitions) in PSUM

            def wg_psum(src_rows, right, roff):
                def fn(r0, kr, n0, nw):
                    ps = next_acc()[:kr, :nw]
                    for s in range(NS):
                        rows = min(P, tt - s * P)
                        nisa.nc_matmul(ps, src_rows(s)[:rows, r0:r0 + kr],
                                       right(s)[:rows, roff + n0:roff + n0 + nw],
                                       accumulate=s > 0)
                    return ps
                return fn

            rmw(dgu_acc, H * 2 * I, 2 * I, H, I, 0, e_t,
                wg_psum(lambda s: xrs[s], lambda s: dg_t[:, s, :], 0))
            rmw(dgu_acc, H * 2 * I, 2 * I, H, I, I, e_t,
                wg_psum(lambda s: xrs[s], lambda s: du_t[:, s, :], 0))
            rmw(ddn_acc, I * H, H, I, H, 0, e_t,
                wg_psum(lambda s: a_t[:, s, :], lambda s: drs[s], 0))
            # free this chunk's SBUF (loop variables keep tiles alive too)
            del a_t, dg_t, du_t, xrs, drs, xr, dr, sg, hus, silu, a32, prod, da, dah, ds

    # ---- phase 2: padding row, casts ----------------------------------------------------------
    if cast:
        _copy_hbm(dx_o, dx_acc, T1 * H)
        _copy_hbm(dgu_o, dgu_acc, ngu)
        _copy_hbm(ddn_o, ddn_acc, ndd)
    zt = nl.ndarray((1, max(H, E)), dx_o.dtype, buffer=nl.sbuf)
    nisa.memset(zt, 0.0, engine=nisa.engine.gpsimd)
    dx_fin = dx_o[pid] if nprog > 1 else dx_o
    nisa.dma_copy(dst=dx_fin[T:T1, :], src=zt[:, :H])
    nisa.dma_copy(dst=da_acc.ap([[E, 1], [1, E]], offset=T * E), src=zero[:1, :E])
    return dx_o, da_o, dgu_o, ddn_o


def moe_cte_bwd_ref(hidden_states, expert_affinities_masked, gate_up_proj_weight,
                    down_proj_weight, token_position_to_id, block_to_expert, dout, block_size):
    """PyTorch reference of :func:`moe_cte_bwd` (fp32 math, explicit per-block formulas):
    ``(d_hidden, d_affinities ((T+1)*E, 1) fp32, d_gate_up, d_down)`` in the inputs' dtypes.
    Row T of dout is ignored (padding slots contribute nothing); row T of d_hidden and
    d_affinities is 0."""
    import torch
    T1, H = hidden_states.shape
    E, _, _, I = gate_up_proj_weight.shape
    x = hidden_states.float()
    aff = expert_affinities_masked.float().reshape(T1, E)
    g = dout.float().clone()
    g[T1 - 1] = 0
    dx = torch.zeros(T1, H)
    daff = torch.zeros(T1, E)
    dgu = torch.zeros(E, H, 2, I)
    ddn = torch.zeros(E, I, H)
    ids_all = token_position_to_id.long().reshape(-1, block_size)
    for b in range(block_to_expert.shape[0]):
        e = int(block_to_expert[b, 0])
        ids = ids_all[b]
        valid = ids < T1 - 1
        ids, xb, gb = ids[valid], x[ids[valid]], g[ids[valid]]
        wg, wu = gate_up_proj_weight[e, :, 0].float(), gate_up_proj_weight[e, :, 1].float()
        wd = down_proj_weight[e].float()
        hg, hu = xb @ wg, xb @ wu
        s = torch.sigmoid(hg)
        silu = hg * s
        a = silu * hu
        y = a @ wd
        daff[:, e].index_add_(0, ids, (gb * y).sum(-1))
        dy = gb * aff[ids, e][:, None]
        da = dy @ wd.t()
        ddn[e] += a.t() @ dy
        dhu = da * silu
        dhg = da * hu * s * (1 + hg * (1 - s))
        dx.index_add_(0, ids, dhg @ wg.t() + dhu @ wu.t())
        dgu[e, :, 0] += xb.t() @ dhg
        dgu[e, :, 1] += xb.t() @ dhu
    dx[T1 - 1] = 0
    daff[T1 - 1] = 0
    return (dx.to(hidden_states.dtype), daff.reshape(-1, 1), dgu.to(gate_up_proj_weight.dtype),
            ddn.to(down_proj_weight.dtype))
