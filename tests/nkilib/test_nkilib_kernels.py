"""rmsnorm, rope, mlp, router_topk, cross_entropy, cumsum against their PyTorch references."""

import pytest
import torch

import nki
from torchneuron.nkilib import (cross_entropy_bwd, cross_entropy_bwd_ref, cross_entropy_fwd,
                    cross_entropy_ref, cumsum, cumsum_ref, mlp, mlp_ref, rmsnorm, rmsnorm_ref,
                    rope, rope_ref, router_topk, router_topk_ref)
from torchneuron.nki import NKIArgumentError, NKIShapeError


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _close_rel(a, b, tol):
    err = (a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30)
    assert err < tol, f"relative error {err:.2e} >= {tol}"


# ---- rmsnorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rmsnorm_matches_reference(dtype, tol):
    x = torch.randn(300, 1000, generator=_g()).to(dtype)
    w = torch.randn(1000, generator=_g(1)).to(dtype)
    out = nki.simulate(rmsnorm)(x, w, eps=1e-5)
    assert out.dtype == dtype
    _close_rel(out, rmsnorm_ref(x, w, 1e-5), tol)


def test_rmsnorm_lnc2_matches_reference():
    x, w = torch.randn(260, 256, generator=_g()), torch.randn(256, generator=_g(1))
    torch.testing.assert_close(nki.simulate(rmsnorm)[2](x, w), rmsnorm_ref(x, w), atol=1e-5,
                               rtol=1e-5)


def test_rmsnorm_rejects_hidden_over_limit():
    with pytest.raises(NKIShapeError, match="H <= 16384"):
        nki.simulate(rmsnorm)(torch.zeros(2, 20000), torch.zeros(20000))


# ---- rope -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_rope_matches_reference(dtype, tol):
    x = torch.randn(2, 200, 4, 64, generator=_g()).to(dtype)
    ang = torch.randn(200, 32, generator=_g(1))
    out = nki.simulate(rope)[2](x, ang.cos(), ang.sin())
    _close_rel(out, rope_ref(x, ang.cos(), ang.sin()), tol)


def test_rope_preserves_norm_of_each_pair():
    x = torch.randn(1, 130, 2, 32, generator=_g())
    ang = torch.randn(130, 16, generator=_g(1))
    out = nki.simulate(rope)(x, ang.cos(), ang.sin())
    torch.testing.assert_close(out.norm(dim=-1), x.norm(dim=-1), atol=1e-4, rtol=1e-5)


def test_rope_rejects_odd_head_dim():
    with pytest.raises(NKIShapeError, match="even"):
        nki.simulate(rope)(torch.zeros(1, 4, 1, 7), torch.zeros(4, 3), torch.zeros(4, 3))


# ---- mlp ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol,lnc", [(torch.float32, 1e-5, 1), (torch.bfloat16, 2e-2, 2)])
def test_mlp_matches_reference_ragged(dtype, tol, lnc):
    T, H, I = 600, 200, 330  # none a multiple of the tile sizes
    x = torch.randn(T, H, generator=_g()).to(dtype)
    wg, wu = [(torch.randn(H, I, generator=_g(s)) / H ** .5).to(dtype) for s in (1, 2)]
    wd = (torch.randn(I, H, generator=_g(3)) / I ** .5).to(dtype)
    _close_rel(nki.simulate(mlp)[lnc](x, wg, wu, wd), mlp_ref(x, wg, wu, wd), tol)


def test_mlp_rejects_mismatched_weights():
    with pytest.raises(NKIShapeError, match="w_gate"):
        nki.simulate(mlp)(torch.zeros(4, 8), torch.zeros(8, 16), torch.zeros(8, 16),
                          torch.zeros(8, 16))


# ---- router ---------------------------------------------------------------------------------
@pytest.mark.parametrize("normalize", [False, True])
def test_router_topk_matches_reference(normalize):
    logits = torch.randn(300, 16, generator=_g())
    aff, idx = nki.simulate(router_topk)[2](logits, k=4, normalize=normalize)
    raff, ridx = router_topk_ref(logits, 4, normalize)
    assert idx.dtype == torch.int32 and torch.equal(idx, ridx)
    torch.testing.assert_close(aff, raff, atol=1e-6, rtol=1e-5)


def test_router_topk_bf16_logits_single_expert():
    # distinct per row (ties in bf16 would legitimately select extra experts)
    logits = torch.stack([torch.randperm(64, generator=_g(r)) for r in range(130)]) * 0.125
    logits = logits.bfloat16()
    aff, idx = nki.simulate(router_topk)(logits, k=1)
    raff, ridx = router_topk_ref(logits, 1)
    assert torch.equal(idx, ridx)
    torch.testing.assert_close(aff, raff, atol=1e-6, rtol=1e-5)


def test_router_topk_rejects_k_over_8():
    with pytest.raises(NKIArgumentError, match="k=9"):
        nki.simulate(router_topk)(torch.zeros(4, 16), k=9)


# ---- cumsum ---------------------------------------------------------------------------------
def test_cumsum_fp32_carries_across_chunks():
    x = torch.randn(300, 9000, generator=_g())  # 3 chunks of 4096 columns
    _close_rel(nki.simulate(cumsum)(x), cumsum_ref(x), 1e-5)


def test_cumsum_bf16_lnc2():
    x = torch.randn(260, 700, generator=_g()).bfloat16()
    _close_rel(nki.simulate(cumsum)[2](x), cumsum_ref(x), 1e-2)


# ---- cross entropy --------------------------------------------------------------------------
def _ce_inputs(dtype, N=300, V=9000):
    logits = (3 * torch.randn(N, V, generator=_g())).to(dtype)
    labels = torch.randint(0, V, (N,), generator=_g(1), dtype=torch.int32)
    labels[5] = -100
    return logits, labels


@pytest.mark.parametrize("dtype,lnc", [(torch.float32, 1), (torch.bfloat16, 2)])
def test_cross_entropy_fwd_matches_reference(dtype, lnc):
    logits, labels = _ce_inputs(dtype)
    loss, lse = nki.simulate(cross_entropy_fwd)[lnc](logits, labels)
    rloss, rlse = cross_entropy_ref(logits, labels)
    torch.testing.assert_close(loss, rloss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5)
    assert loss[5] == 0  # ignore_index row


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_cross_entropy_bwd_matches_reference(dtype, tol):
    logits, labels = _ce_inputs(dtype)
    _, lse = cross_entropy_ref(logits, labels)
    dloss = torch.rand(300, generator=_g(2))
    got = nki.simulate(cross_entropy_bwd)[2](logits, labels, lse, dloss)
    ref = cross_entropy_bwd_ref(logits, labels, lse, dloss)
    assert got.dtype == dtype
    _close_rel(got, ref, tol)
    assert got[5].abs().max() == 0


# ---- torch ops ------------------------------------------------------------------------------
def test_op_cross_entropy_autograd_matches_torch_on_neuron():
    from torchneuron.nkilib.ops import cross_entropy
    logits, labels = _ce_inputs(torch.float32, N=150, V=1000)
    ln = logits.to("neuron").requires_grad_()
    loss = cross_entropy(ln, labels.to("neuron"))
    loss.backward()
    lr = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(lr, labels.long())
    ref.backward()
    torch.testing.assert_close(loss.cpu(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ln.grad.cpu(), lr.grad, atol=1e-6, rtol=1e-5)


def test_op_rope_autograd_is_inverse_rotation():
    from torchneuron.nkilib.ops import rope as rope_op
    x = torch.randn(1, 130, 2, 32, generator=_g()).requires_grad_()
    ang = torch.randn(130, 16, generator=_g(1))
    w = torch.randn(1, 130, 2, 32, generator=_g(2))
    (rope_op(x, ang.cos(), ang.sin()) * w).sum().backward()
    xr = x.detach().clone().requires_grad_()
    (rope_ref(xr, ang.cos(), ang.sin()) * w).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, atol=1e-5, rtol=1e-5)


def test_ops_inference_chain_under_torch_compile():
    from torchneuron.nkilib import ops
    x = torch.randn(130, 64, generator=_g())
    w = torch.randn(64, generator=_g(1))
    wg, wu = torch.randn(64, 96, generator=_g(2)) / 8, torch.randn(64, 96, generator=_g(3)) / 8
    wd = torch.randn(96, 64, generator=_g(4)) / 10

    def f(x):
        h = ops.rmsnorm(x, w, 1e-6)
        return ops.cumsum(ops.mlp(h, wg, wu, wd))

    got = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    ref = cumsum_ref(mlp_ref(rmsnorm_ref(x, w), wg, wu, wd))
    _close_rel(got, ref, 1e-5)


def test_op_router_topk_on_neuron():
    from torchneuron.nkilib.ops import router_topk as rt
    logits = torch.randn(64, 8, generator=_g())
    aff, idx = rt(logits.to("neuron"), 2, True)
    raff, ridx = router_topk_ref(logits, 2, True)
    assert aff.device.type == "neuron"
    torch.testing.assert_close(aff.cpu(), raff, atol=1e-6, rtol=1e-5)
    assert torch.equal(idx.cpu(), ridx)
