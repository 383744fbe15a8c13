"""SDPA's CUDA backend kernels trained through: ``_flash_attention_forward`` /
``_efficient_attention_forward`` and their backward ops on neuron, against CPU autograd of a
float64 reference attention.

Tolerances: the kernels compute in fp32 and round once, so the error is the input dtype's
rounding of the result plus that of the saved ``out`` the backward reads (as CUDA's do):
fp16 2e-3 relative / 2e-3 absolute, bf16 2e-2 / 2e-2, fp32 1e-4 / 1e-5 (gradients of O(1) size).
"""

import math

import pytest
import torch

_TOL = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
        torch.float32: dict(atol=1e-5, rtol=1e-4)}


def _reference(q, k, v, causal_offset=None, bias=None, scale=None, keep=None, dropout_p=0.0):
    """float64 attention on [B, S, H, D] tensors (key/value heads repeated for grouped queries)."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    if kt.shape[1] != qt.shape[1]:
        kt = kt.repeat_interleave(qt.shape[1] // kt.shape[1], 1)
        vt = vt.repeat_interleave(qt.shape[1] // vt.shape[1], 1)
    s = qt @ kt.transpose(-2, -1) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if bias is not None:
        s = s + bias
    if causal_offset is not None:
        m = torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(causal_offset)
        s = s.masked_fill(~m, float("-inf"))
    p = torch.softmax(s, -1)
    if keep is not None:
        p = p * keep / (1 - dropout_p)
    return (p @ vt).transpose(1, 2)


def _leaves(dtype, *shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = [torch.randn(*s, generator=g).to(dtype) for s in shapes]
    dev = [b.to("neuron").requires_grad_() for b in base]
    ref = [b.double().requires_grad_() for b in base]
    return dev, ref


def _check(got, want, dtype):
    assert got.device.type == "neuron" and got.dtype == dtype
    torch.testing.assert_close(got.cpu().double(), want.detach(), **_TOL[dtype])


def _run_both(dev_out, ref_out, dev, ref, dtype, seed=1):
    grad = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(seed)).to(dtype)
    dev_g = torch.autograd.grad(dev_out, dev, grad.to("neuron"))
    ref_g = torch.autograd.grad(ref_out, ref, grad.double())
    _check(dev_out.detach(), ref_out, dtype)
    for a, b in zip(dev_g, ref_g):
        _check(a, b, dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_backward_matches_float64_autograd(dtype, causal):
    # Sq != Sk: flash's causal mask is aligned to the bottom-right corner
    (q, k, v), (rq, rk, rv) = _leaves(dtype, (2, 5, 4, 16), (2, 7, 4, 16), (2, 7, 4, 16))
    out = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 5, 7, 0.0, causal, False)[0]
    want = _reference(rq, rk, rv, 7 - 5 if causal else None)
    _run_both(out, want, [q, k, v], [rq, rk, rv], dtype)


def test_flash_attention_backward_sums_grouped_query_heads():
    dtype = torch.float16
    (q, k, v), (rq, rk, rv) = _leaves(dtype, (2, 6, 6, 8), (2, 6, 2, 8), (2, 6, 2, 8))
    out = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 6, 6, 0.0, True, False, scale=0.3)[0]
    want = _reference(rq, rk, rv, 0, scale=0.3)
    _run_both(out, want, [q, k, v], [rq, rk, rv], dtype)


def test_flash_attention_backward_is_the_neuron_kernel():
    q = torch.randn(1, 4, 2, 8, dtype=torch.half, device="neuron")
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 0.0, False, False)
    g = torch.ops.aten._flash_attention_backward(torch.ones_like(out), q, q, q, out, lse, None, None, 4, 4, 0.0,
                                                 False, rng, unused)
    assert len(g) == 3 and all(t.device.type == "neuron" and t.shape == q.shape and t.dtype == q.dtype for t in g)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("mask_type", [0, 1, 2])
def test_efficient_attention_backward_matches_float64_autograd(dtype, mask_type):
    (q, k, v), (rq, rk, rv) = _leaves(dtype, (2, 6, 3, 8), (2, 9, 3, 8), (2, 9, 3, 4), seed=2)
    out = torch.ops.aten._efficient_attention_forward(q, k, v, None, None, None, None, None, 0.0, mask_type, True)[0]
    want = _reference(rq, rk, rv, {0: None, 1: 0, 2: 9 - 6}[mask_type])
    _run_both(out, want, [q, k, v], [rq, rk, rv], dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_efficient_attention_backward_gives_the_bias_gradient(dtype):
    (q, k, v, b), (rq, rk, rv, rb) = _leaves(dtype, (2, 5, 2, 8), (2, 5, 2, 8), (2, 5, 2, 8), (2, 2, 5, 5), seed=3)
    out = torch.ops.aten._efficient_attention_forward(q, k, v, b, None, None, None, None, 0.0, 1, True)[0]
    want = _reference(rq, rk, rv, 0, bias=rb)
    _run_both(out, want, [q, k, v, b], [rq, rk, rv, rb], dtype)


def test_efficient_attention_backward_sums_a_broadcast_bias_gradient():
    dtype = torch.float32
    (q, k, v, b), (rq, rk, rv, rb) = _leaves(dtype, (2, 4, 3, 8), (2, 6, 3, 8), (2, 6, 3, 8), (1, 3, 1, 6), seed=4)
    out = torch.ops.aten._efficient_attention_forward(q, k, v, b, None, None, None, None, 0.0, 0, True)[0]
    want = _reference(rq, rk, rv, None, bias=rb)
    _run_both(out, want, [q, k, v, b], [rq, rk, rv, rb], dtype)


def test_efficient_attention_backward_of_a_variable_length_batch():
    dtype = torch.float32
    (q, k, v), (rq, rk, rv) = _leaves(dtype, (1, 7, 2, 8), (1, 9, 2, 8), (1, 9, 2, 8), seed=5)
    cq, ck = torch.tensor([0, 3, 7], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    out = torch.ops.aten._efficient_attention_forward(q, k, v, None, cq.to("neuron"), ck.to("neuron"), 4, 5, 0.0, 2,
                                                      True)[0]
    want = torch.cat([_reference(rq[:, 0:3], rk[:, 0:4], rv[:, 0:4], 1),
                      _reference(rq[:, 3:7], rk[:, 4:9], rv[:, 4:9], 1)], 1)
    _run_both(out, want, [q, k, v], [rq, rk, rv], dtype)


def test_efficient_attention_backward_refuses_a_forward_without_logsumexp():
    q = torch.randn(1, 4, 2, 8, device="neuron", requires_grad=True)
    out = torch.ops.aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.0, 0, False)[0]
    with pytest.raises(RuntimeError, match="compute_log_sumexp=True"):
        out.sum().backward()


# Dropout: the forward takes its mask from the device generator's Philox at the (seed, offset) it
# returns, and the backward regenerates it from them. The reference mask is drawn through the
# public generator API at that state (neuron's bernoulli_ is checked word for word against numpy
# Philox4x32-10 in test_random.py).
def _mask_at(seed, offset, shape, p):
    g = torch.Generator(device="neuron")
    g.manual_seed(seed % 2 ** 64)
    g.set_offset(offset)
    return torch.empty(shape, device="neuron").bernoulli_(1 - p, generator=g).cpu().double()


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_dropout_backward_uses_the_forward_mask(causal):
    dtype, p = torch.float16, 0.3
    (q, k, v), (rq, rk, rv) = _leaves(dtype, (2, 5, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8), seed=6)
    out, _, rng_state, _, _ = torch.ops.aten._flash_attention_forward(q, k, v, None, None, 5, 6, p, causal, False)
    seed, offset = rng_state.cpu().tolist()
    keep = _mask_at(seed, offset, (2, 4, 5, 6), p)
    assert 0 < keep.mean() < 1
    want = _reference(rq, rk, rv, 1 if causal else None, keep=keep, dropout_p=p)
    _run_both(out, want, [q, k, v], [rq, rk, rv], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_efficient_attention_dropout_backward_uses_the_forward_mask(dtype):
    p = 0.25
    (q, k, v, b), (rq, rk, rv, rb) = _leaves(dtype, (2, 6, 3, 8), (2, 7, 3, 8), (2, 7, 3, 8), (2, 3, 6, 7), seed=7)
    out, _, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(q, k, v, b, None, None, None, None, p, 2,
                                                                             True)
    assert seed.dtype == offset.dtype == torch.int64 and seed.dim() == offset.dim() == 0
    keep = _mask_at(int(seed), int(offset), (2, 3, 6, 7), p)
    want = _reference(rq, rk, rv, 1, bias=rb, keep=keep, dropout_p=p)
    _run_both(out, want, [q, k, v, b], [rq, rk, rv, rb], dtype)


@pytest.mark.parametrize("kernel", ["flash", "efficient"])
def test_attention_dropout_same_seed_same_output_and_offset_advances(kernel):
    q = torch.randn(2, 9, 2, 8, device="neuron", dtype=torch.half)

    def run():
        if kernel == "flash":
            r = torch.ops.aten._flash_attention_forward(q, q, q, None, None, 9, 9, 0.5, False, False)
            return r[0], tuple(r[2].cpu().tolist())
        r = torch.ops.aten._efficient_attention_forward(q, q, q, None, None, None, None, None, 0.5, 0, True)
        return r[0], (int(r[2]) % 2 ** 64, int(r[3]))

    torch.manual_seed(1234)
    first, (seed1, off1) = run()
    second, (seed2, off2) = run()
    after_two = torch.neuron.random.default_generators[0].get_offset()
    torch.manual_seed(1234)
    again, (seed3, off3) = run()
    assert seed1 == seed3 == 1234 and off3 == off1 == 0
    # each call reserves one Philox position per mask element (2 * 2 * 9 * 9 = 324)
    assert off2 == 324 and after_two == 648
    assert torch.equal(first.cpu(), again.cpu())
    assert not torch.equal(first.cpu(), second.cpu())


def test_attention_dropout_refuses_p_of_one():
    q = torch.randn(1, 4, 2, 8, device="neuron", dtype=torch.half)
    with pytest.raises(RuntimeError, match=r"dropout_p must be in \[0, 1\)"):
        torch.ops.aten._flash_attention_forward(q, q, q, None, None, 4, 4, 1.0, False, False)


def test_efficient_attention_dropout_refuses_packed_batches_naming_it():
    q = torch.randn(1, 6, 2, 8, device="neuron")
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device="neuron")
    with pytest.raises(NotImplementedError, match="dropout_with_cu_seqlens=True"):
        torch.ops.aten._efficient_attention_forward(q, q, q, None, cu, cu, 4, 4, 0.1, 0, True)
