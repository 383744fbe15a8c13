"""RMSNorm on neuron: `_fused_rms_norm` and its backward as one kernel each (rms_norm.cpp).

The oracle is the composite's arithmetic in float64 (torch's decomposition), rounded once to
the input's dtype: the kernels accumulate in fp32 (fp64 for fp64), like CUDA's fused kernel.
"""

import pytest
import torch
import torch.nn.functional as F

import torchneuron

DEV = "neuron"
# one unit in the last place of each dtype near 1, as a relative tolerance (sums of up to a few
# thousand fp32 terms add at most a few fp32 ulps, far below a 16-bit dtype's)
RTOL = {torch.float32: 4e-6, torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float64: 1e-13}


def _reference(x, shape, w, eps, g):
    """Output, input gradient and weight gradient of F.rms_norm in float64 (CPU's composite)."""
    xd = x.double().requires_grad_()
    wd = w.double().requires_grad_() if w is not None else None
    e = eps if eps is not None else torch.finfo(torch.float64 if x.dtype == torch.float64 else torch.float32).eps
    y = F.rms_norm(xd, shape, wd, e)
    grads = torch.autograd.grad(y, [xd] + ([wd] if wd is not None else []), g.double())
    return y.detach(), grads[0], grads[1] if wd is not None else None


def _on_neuron(x, shape, w, eps, g):
    xd = x.to(DEV).requires_grad_()
    wd = w.to(DEV).requires_grad_() if w is not None else None
    y = F.rms_norm(xd, shape, wd, eps)
    assert type(y.grad_fn).__name__ == "FusedRmsNormBackward0"
    y.backward(g.to(DEV))
    return y.detach().cpu(), xd.grad.cpu(), wd.grad.cpu() if wd is not None else None


def _close(got, exact, dtype, atol_scale):
    # one rounding of the exact value, plus the fp32 accumulation's few ulps
    torch.testing.assert_close(got.double(), exact, rtol=RTOL[dtype], atol=RTOL[dtype] * atol_scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("shape", [(6, 1000), (2, 3, 17), (5, 4, 250), (3, 1)], ids=str)
def test_rms_norm_forward_and_backward_match_the_exact_composite(dtype, shape):
    torch.manual_seed(0)
    norm = (4, 250) if shape == (5, 4, 250) else shape[-1:]
    x = torch.randn(shape).to(dtype)
    w = torch.randn(norm).to(dtype)
    g = torch.randn(shape).to(dtype)
    y, dx, dw = _on_neuron(x, norm, w, 1e-6, g)
    ey, edx, edw = _reference(x, norm, w, 1e-6, g)
    _close(y, ey, dtype, 1.0)
    _close(dx, edx, dtype, 4 * _dx_scale(x, norm, w, g))
    _close(dw, edw, dtype, edw.abs().max().item())


def _dx_scale(x, norm, w, g):
    """The size of dx's terms, |g w| r: dx is their difference (all of it cancels with one
    normalized element), so its error is relative to them, not to dx."""
    dims = tuple(range(x.dim() - len(norm), x.dim()))
    r = x.double().pow(2).mean(dims, keepdim=True).add(1e-6).rsqrt()
    gw = g.double() * (w.double() if w is not None else 1.0)
    return (gw.abs() * r).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_without_weight_and_with_the_default_eps(dtype):
    torch.manual_seed(1)
    x, g = torch.randn(64, 48).to(dtype), torch.randn(64, 48).to(dtype)
    y, dx, _ = _on_neuron(x, (48,), None, None, g)
    ey, edx, _ = _reference(x, (48,), None, None, g)
    _close(y, ey, dtype, 1.0)
    _close(dx, edx, dtype, 4 * _dx_scale(x, (48,), None, g))
    # the default eps is fp32's epsilon: an all-zero row normalizes to zeros, not NaN
    z = F.rms_norm(torch.zeros(2, 48, dtype=dtype, device=DEV), (48,))
    assert torch.equal(z.cpu(), torch.zeros(2, 48, dtype=dtype))


def test_bf16_results_round_ties_to_even():
    # [1 x5, 3 x3] has mean square 4, so with eps = 0 r is exactly 0.5 and y = 1.5 w for the 3s:
    # w = 1 + 2^-7 gives 1.1000001|1 in binary, a tie rounded up to even; w = 1 + 3 * 2^-7 gives
    # 1.1000100|1, one rounded down
    x = torch.tensor([[1.0] * 5 + [3.0] * 3], dtype=torch.bfloat16)
    up, down = 1 + 2 ** -7, 1 + 3 * 2 ** -7
    w = torch.tensor([1.0] * 5 + [up, down, up], dtype=torch.bfloat16)
    got = F.rms_norm(x.to(DEV), (8,), w.to(DEV), 0.0).cpu()
    want = (x.double() * 0.5 * w.double()).bfloat16()
    assert torch.equal(got, want) and got[0, 5:].tolist() == [1.515625, 1.53125, 1.515625]


def test_rms_norm_runs_one_kernel_each_way():
    x = torch.randn(8, 32, device=DEV, requires_grad=True)
    w = torch.ones(32, device=DEV, requires_grad=True)
    torchneuron.clear_op_tracking()
    F.rms_norm(x, (32,), w).backward(torch.randn(8, 32, device=DEV))
    ops = torchneuron.get_executed_ops()
    assert "aten::_fused_rms_norm" in ops and "aten::_fused_rms_norm_backward" in ops
    assert not any(op in ops for op in ("aten::pow", "aten::rsqrt", "aten::mean"))


def test_rms_norm_of_strided_input_and_expanded_gradient_is_the_same_computation():
    # a transposed input and y.sum()'s expanded gradient are copied contiguous, then normalized
    torch.manual_seed(2)
    base = torch.randn(40, 24, dtype=torch.bfloat16)
    w = torch.randn(40, dtype=torch.bfloat16)
    xd = base.to(DEV).t().requires_grad_()
    wd = w.to(DEV).requires_grad_()
    F.rms_norm(xd, (40,), wd).sum().backward()
    ey, edx, edw = _reference(base.t(), (40,), w, None, torch.ones(24, 40, dtype=torch.bfloat16))
    _close(F.rms_norm(xd.detach(), (40,), wd.detach()).cpu(), ey, torch.bfloat16, 1.0)
    _close(xd.grad.cpu(), edx, torch.bfloat16, 4 * _dx_scale(base.t(), (40,), w, torch.ones(24, 40)))
    _close(wd.grad.cpu(), edw, torch.bfloat16, edw.abs().max().item())


def test_rms_norm_weight_gradient_bits_do_not_depend_on_the_thread_count():
    torch.manual_seed(3)
    x = torch.randn(1000, 96, device=DEV, requires_grad=True)
    w = torch.randn(96, device=DEV, requires_grad=True)
    g = torch.randn(1000, 96, device=DEV)
    before = torch.get_num_threads()
    grads = []
    try:
        for threads in (1, before):
            torch.set_num_threads(threads)
            grads.append(torch.autograd.grad(F.rms_norm(x, (96,), w), [x, w], g))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(grads[0][0].cpu(), grads[1][0].cpu()) and torch.equal(grads[0][1].cpu(), grads[1][1].cpu())


def test_rms_norm_with_a_weight_of_another_dtype_takes_the_composite():
    # ATen's rms_norm warns and runs its composite (fp32 weight, bf16 input): the same here
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16)
    with pytest.warns(UserWarning, match="Mismatch dtype"):
        got = F.rms_norm(x.to(DEV), (16,), w.to(DEV))
    torch.testing.assert_close(got.cpu(), F.rms_norm(x, (16,), w))


def test_rms_norm_bad_shapes_raise_cpus_errors():
    x = torch.randn(4, 16, device=DEV)
    with pytest.raises(RuntimeError, match="Expected weight to be of same shape"):
        torch.ops.aten._fused_rms_norm(x, [16], torch.ones(8, device=DEV), 1e-5)
    with pytest.raises(RuntimeError, match="normalized_shape"):
        torch.ops.aten._fused_rms_norm(x, [8], None, 1e-5)
    y, rstd = torch.ops.aten._fused_rms_norm(x, [16], None, 1e-5)
    with pytest.raises(RuntimeError, match="rstd has 2 values for 4 rows"):
        torch.ops.aten._fused_rms_norm_backward(torch.ones_like(x), x, [16], rstd[:2], None, [True, False])


def test_rms_norm_forward_and_backward_replay_in_a_graph():
    # both kernels queue, so a capture records them; a replay recomputes from the inputs' memory
    torch.manual_seed(4)
    x = torch.randn(64, 128, device=DEV)
    w = torch.randn(128, device=DEV)
    g = torch.randn(64, 128, device=DEV)
    rstd_shape = torch.ops.aten._fused_rms_norm(x, [128], w, 1e-5)[1].shape
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        y, rstd = torch.ops.aten._fused_rms_norm(x, [128], w, 1e-5)
        dx, dw = torch.ops.aten._fused_rms_norm_backward(g, x, [128], rstd, w, [True, True])
    x.copy_(torch.randn(64, 128, device=DEV))
    graph.replay()
    ey, er = torch.ops.aten._fused_rms_norm(x, [128], w, 1e-5)
    edx, edw = torch.ops.aten._fused_rms_norm_backward(g, x, [128], er, w, [True, True])
    assert rstd.shape == rstd_shape == (64, 1) and rstd.dtype == torch.float32
    for got, want in ((y, ey), (rstd, er), (dx, edx), (dw, edw)):
        assert torch.equal(got.cpu(), want.cpu())
