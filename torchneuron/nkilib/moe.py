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
"""

from __future__ import annotations

import torchneuron.nki as nki
import torchneuron.nki.isa as nisa
import torchneuron.nki.language as nl

from ._common import P, cdiv, matmul_dtype, shape_error
from .gated_mlp import GatedMLP, load_row_chunks


@nki.jit
def moe_cte(hidden_states, expert_affinities_masked, gate_up_proj_weight, down_proj_weight,
            token_position_to_id, block_to_expert, block_size):
    """Blockwise MoE (SiLU-gated experts); see the module docstring."""
    name = "moe_cte"
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
                idx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=idx, src=ids_flat[s0:s0 + rows, :])
                xr = nl.ndarray((rows, H), mdt, buffer=nl.sbuf)
                nisa.dma_copy(dst=xr, src=hidden_states.ap([[H, rows], [1, H]],
                                                           vector_offset=idx, indirect_dim=0))
                # affinity index t*E + e (e broadcast to every partition by DMA)
                e_col = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
                nisa.dma_copy(dst=e_col, src=block_to_expert[b:b + 1, :].broadcast_to((rows, 1)))
                aidx = nl.ndarray((rows, 1), nl.int32, buffer=nl.sbuf)
                nisa.tensor_scalar(aidx, idx, nl.multiply, float(E), op1=nl.add, operand1=e_col)
                aff = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(dst=aff, src=expert_affinities_masked.ap(
                    [[1, rows], [1, 1]], vector_offset=aidx, indirect_dim=0))
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
