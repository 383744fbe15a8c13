"""moe_cte (blockwise MoE) against its PyTorch reference, LNC=2 shard-on-block, torch op."""

import pytest
import torch

import nki
from torchneuron.nkilib import moe_cte, moe_cte_ref
from moe_cases import moe_case
from torchneuron.nki import NKIShapeError


def _case(T, H, I, E, k, B, dtype, seed=0):
    return moe_case(T, H, I, E, k, B, dtype, seed, with_dout=False)


def _rel(a, b, T):
    return ((a.float() - b.float())[:T].abs().max() / b.float()[:T].abs().max()).item()


def test_moe_fp32_matches_reference_ragged_block():
    args = _case(200, 96, 160, 4, 2, 128, torch.float32)
    assert _rel(nki.simulate(moe_cte)(*args), moe_cte_ref(*args), 200) < 1e-5


def test_moe_bf16_block_not_multiple_of_128():
    args = _case(300, 128, 256, 4, 2, 200, torch.bfloat16)
    out = nki.simulate(moe_cte)(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (301, 128)
    assert _rel(out, moe_cte_ref(*args), 300) < 2e-2


def test_moe_block_larger_than_512_tokens():
    args = _case(700, 64, 128, 2, 1, 600, torch.float32)
    assert _rel(nki.simulate(moe_cte)(*args), moe_cte_ref(*args), 700) < 1e-5


def test_moe_lnc2_shard_on_block_partials_sum_to_reference():
    args = _case(200, 96, 160, 4, 2, 128, torch.float32)
    parts = nki.simulate(moe_cte)[2](*args)
    assert parts.shape == (2, 201, 96)
    assert _rel(parts.sum(0), moe_cte_ref(*args), 200) < 1e-5


def test_moe_token_in_no_block_gets_zero():
    args = list(_case(64, 32, 64, 2, 1, 128, torch.float32))
    # drop every block of expert 1: its tokens must come out as exact zeros
    keep = (args[5].reshape(-1) == 0).nonzero().flatten()
    args[4] = args[4].reshape(-1, 128)[keep].reshape(-1)
    args[5] = args[5][keep]
    out = nki.simulate(moe_cte)(*args)
    routed = set(args[4].tolist()) - {64}
    others = [t for t in range(64) if t not in routed]
    assert others and out[others].abs().max() == 0
    assert _rel(out, moe_cte_ref(*args), 64) < 1e-5


def test_moe_rejects_bad_weight_shape():
    x, aff, gu, dw, tp, be, B = _case(64, 32, 64, 2, 1, 128, torch.float32)
    with pytest.raises(NKIShapeError, match="gate_up_proj_weight"):
        nki.simulate(moe_cte)(x, aff, gu[:, :, :1], dw, tp, be, B)


def test_moe_op_autograd_and_lnc2_on_neuron():
    from torchneuron.nkilib.ops import _moe_torch
    from torchneuron.nkilib.ops import moe_cte as moe_op
    x, aff, gu, dw, tp, be, B = _case(100, 32, 64, 4, 2, 128, torch.float32)
    leaves = [t.to("neuron").requires_grad_() for t in (x, gu, dw)]
    out = moe_op(leaves[0], aff.to("neuron"), leaves[1], leaves[2], tp.to("neuron"),
                 be.to("neuron"), B, 2)
    (out[:100] ** 2).sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, gu, dw)]
    ref = _moe_torch(ref_leaves[0], aff, ref_leaves[1], ref_leaves[2], tp, be, B)
    (ref[:100] ** 2).sum().backward()
    torch.testing.assert_close(out.cpu()[:100], ref[:100], atol=1e-5, rtol=1e-5)
    for a, b in zip(leaves, ref_leaves):
        torch.testing.assert_close(a.grad.cpu(), b.grad, atol=1e-4, rtol=1e-4)
