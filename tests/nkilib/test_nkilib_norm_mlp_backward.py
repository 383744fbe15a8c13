"""rmsnorm_bwd / mlp_bwd kernels and the autograd of ops.rmsnorm / ops.mlp.

Tolerances (max |error| / max |reference|): rmsnorm_bwd fp32 1e-5, bf16 1e-2; mlp_bwd fp32
1e-5, bf16 2e-2 -- against the explicit-formula references (*_bwd_ref) and against torch
autograd of a plain fp32 PyTorch implementation.
"""

import pytest
import torch

import nki
import torchneuron.nkilib.gated_mlp as gated_mlp_mod
from torchneuron.nkilib import mlp_bwd, mlp_bwd_ref, mlp_ref, rmsnorm_bwd, rmsnorm_bwd_ref, rmsnorm_ref
from torchneuron.nki import NKIShapeError


def _g(seed=0):
    return torch.Generator().manual_seed(seed)


def _close_rel(a, b, tol, what=""):
    a, b = a.detach().cpu().float(), b.detach().cpu().float()
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max() / b.abs().max().clamp(min=1e-30)
    assert err < tol, f"{what}: relative error {err:.2e} >= {tol}"


def _autograd(fn, inputs, dy):
    """Gradients of fn w.r.t. every input by torch autograd, in fp32."""
    leaves = [t.detach().float().requires_grad_() for t in inputs]
    fn(*leaves).backward(dy.float())
    return [t.grad for t in leaves]


def _rms_plain(x, w, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _mlp_plain(x, wg, wu, wd):
    return (torch.nn.functional.silu(x @ wg) * (x @ wu)) @ wd


# ---- rmsnorm_bwd kernel ---------------------------------------------------------------------
@pytest.mark.parametrize("dtype,tol,lnc,N,H", [
    (torch.float32, 1e-5, 1, 200, 300),
    (torch.float32, 1e-5, 2, 200, 300),
    (torch.bfloat16, 1e-2, 1, 200, 300),
    (torch.bfloat16, 1e-2, 2, 300, 2500),   # several 2048-column chunks, 3 row tiles
    (torch.float32, 1e-5, 1, 130, 9000),    # large rows: dy streamed, dx stored per chunk
    (torch.bfloat16, 1e-2, 2, 130, 16384),  # the H limit
])
def test_rmsnorm_bwd_matches_reference_and_autograd(dtype, tol, lnc, N, H):
    x = torch.randn(N, H, generator=_g()).to(dtype)
    w = torch.randn(H, generator=_g(1)).to(dtype)
    dy = torch.randn(N, H, generator=_g(2)).to(dtype)
    dx, dw = nki.simulate(rmsnorm_bwd)[lnc](x, w, dy, eps=1e-5)
    assert dx.dtype == dtype
    if lnc == 2:  # one fp32 partial per core, summed by the caller
        assert dw.shape == (2, H) and dw.dtype == torch.float32
        dw = dw.sum(0)
    else:
        assert dw.shape == (H,) and dw.dtype == dtype
    rdx, rdw = rmsnorm_bwd_ref(x, w, dy, 1e-5)
    _close_rel(dx, rdx, tol, "dx vs ref")
    _close_rel(dw, rdw, tol, "dw vs ref")
    adx, adw = _autograd(_rms_plain, (x, w), dy)
    _close_rel(dx, adx, tol, "dx vs autograd")
    _close_rel(dw, adw, tol, "dw vs autograd")


def test_rmsnorm_bwd_lnc2_idle_core_writes_zero_partial():
    x, w, dy = (torch.randn(*s, generator=_g(i)) for i, s in enumerate(((64, 128), (128,),
                                                                          (64, 128))))
    dx, dw = nki.simulate(rmsnorm_bwd)[2](x, w, dy)
    assert torch.all(dw[1] == 0)  # 64 rows = one tile, all on core 0
    rdx, rdw = rmsnorm_bwd_ref(x, w, dy)
    _close_rel(dx, rdx, 1e-5)
    _close_rel(dw.sum(0), rdw, 1e-5)


def test_rmsnorm_bwd_rejects_bad_inputs():
    with pytest.raises(NKIShapeError, match="rmsnorm_bwd.*dy"):
        nki.simulate(rmsnorm_bwd)(torch.zeros(4, 8), torch.zeros(8), torch.zeros(4, 9))
    with pytest.raises(NKIShapeError, match="H <= 16384"):
        nki.simulate(rmsnorm_bwd)(torch.zeros(2, 20000), torch.zeros(20000),
                                  torch.zeros(2, 20000))


# ---- mlp_bwd kernel -------------------------------------------------------------------------
def _mlp_inputs(T, H, I, dtype):
    x = torch.randn(T, H, generator=_g()).to(dtype)
    wg, wu = [(torch.randn(H, I, generator=_g(s)) / H ** .5).to(dtype) for s in (1, 2)]
    wd = (torch.randn(I, H, generator=_g(3)) / I ** .5).to(dtype)
    dy = torch.randn(T, H, generator=_g(4)).to(dtype)
    return x, wg, wu, wd, dy


def _check_mlp_bwd(out, inputs, tol, lnc):
    x, wg, wu, wd, dy = inputs
    dx, dwg, dwu, dwd = out
    if lnc == 2:
        assert dwg.shape == (2,) + tuple(wg.shape) and dwg.dtype == torch.float32
        dwg, dwu, dwd = dwg.sum(0), dwu.sum(0), dwd.sum(0)
    else:
        assert dwg.dtype == wg.dtype
    got = (dx, dwg, dwu, dwd)
    names = ("dx", "dw_gate", "dw_up", "dw_down")
    for n, a, r in zip(names, got, mlp_bwd_ref(*inputs)):
        _close_rel(a, r, tol, f"{n} vs ref")
    for n, a, r in zip(names, got, _autograd(_mlp_plain, (x, wg, wu, wd), dy)):
        _close_rel(a, r, tol, f"{n} vs autograd")


@pytest.mark.parametrize("dtype,tol,lnc,T", [
    (torch.float32, 1e-5, 1, 130),
    (torch.bfloat16, 2e-2, 1, 130),
    (torch.float32, 1e-5, 2, 600),   # two token tiles, one per core
    (torch.bfloat16, 2e-2, 2, 130),  # core 1 has no tokens: zero partials
])
def test_mlp_bwd_matches_reference_and_autograd(dtype, tol, lnc, T):
    inputs = _mlp_inputs(T, 200, 136, dtype)  # no dimension a multiple of the tiles
    out = nki.simulate(mlp_bwd)[lnc](*inputs)
    assert out[0].dtype == dtype
    _check_mlp_bwd(out, inputs, tol, lnc)


@pytest.mark.parametrize("resident,budget", [(2000, None), (0, None), (None, 20000)])
def test_mlp_bwd_other_schedules(monkeypatch, resident, budget):
    """Phase 2 with the lhs resident / both operands streamed; 128-token tiles."""
    if resident is not None:
        monkeypatch.setattr(gated_mlp_mod, "WGRAD_RESIDENT_BYTES", resident)
    if budget is not None:
        monkeypatch.setattr(gated_mlp_mod, "SBUF_BUDGET", budget)
    inputs = _mlp_inputs(300, 200, 136, torch.float32)
    _check_mlp_bwd(nki.simulate(mlp_bwd)(*inputs), inputs, 1e-5, 1)


def test_mlp_bwd_rejects_bad_inputs():
    x = torch.zeros(4, 8)
    with pytest.raises(NKIShapeError, match="mlp_bwd.*w_down"):
        nki.simulate(mlp_bwd)(x, torch.zeros(8, 16), torch.zeros(8, 16), torch.zeros(8, 16),
                              torch.zeros(4, 8))
    with pytest.raises(NKIShapeError, match="mlp_bwd.*dy"):
        nki.simulate(mlp_bwd)(x, torch.zeros(8, 16), torch.zeros(8, 16), torch.zeros(16, 8),
                              torch.zeros(5, 8))


# ---- torch ops: autograd on neuron tensors --------------------------------------------------
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_op_rmsnorm_mlp_grads_on_neuron_match_cpu_autograd(dtype, tol):
    from torchneuron.nkilib import ops
    H, I = 64, 96
    x = torch.randn(2, 65, H, generator=_g()).to(dtype)  # leading dims folded by the ops
    w = (1 + 0.1 * torch.randn(H, generator=_g(1))).to(dtype)
    wg, wu = [(torch.randn(H, I, generator=_g(s)) / 8).to(dtype) for s in (2, 3)]
    wd = (torch.randn(I, H, generator=_g(4)) / 10).to(dtype)
    dout = torch.randn(2, 65, H, generator=_g(5)).to(dtype)
    leaves = [t.to("neuron").requires_grad_() for t in (x, w, wg, wu, wd)]
    out = ops.mlp(ops.rmsnorm(leaves[0], leaves[1], 1e-6), *leaves[2:])
    grads = torch.autograd.grad(out, leaves, dout.to("neuron"))
    ref_leaves = [t.float().requires_grad_() for t in (x, w, wg, wu, wd)]
    rout = mlp_ref(rmsnorm_ref(ref_leaves[0], ref_leaves[1], 1e-6), *ref_leaves[2:])
    rgrads = torch.autograd.grad(rout, ref_leaves, dout.float())
    _close_rel(out, rout, tol, "out")
    for name, g, r, t in zip(("x", "w", "w_gate", "w_up", "w_down"), grads, rgrads, leaves):
        assert g.device.type == "neuron" and g.dtype == dtype and g.shape == t.shape
        _close_rel(g, r, tol, f"grad {name}")


def test_op_backward_kernels_lnc2_on_neuron():
    from torchneuron.nkilib import ops
    x = torch.randn(300, 200, generator=_g())
    w = torch.randn(200, generator=_g(1))
    dy = torch.randn(300, 200, generator=_g(2))
    dx, dw = ops.rmsnorm_bwd(x.to("neuron"), w.to("neuron"), dy.to("neuron"), 1e-6, 2)
    for a, r in zip((dx, dw), rmsnorm_bwd_ref(x, w, dy)):
        assert a.device.type == "neuron"
        _close_rel(a, r, 1e-5)
    inputs = _mlp_inputs(600, 200, 136, torch.bfloat16)
    got = ops.mlp_bwd(*(t.to("neuron") for t in inputs), 2)
    for a, r, t in zip(got, mlp_bwd_ref(*inputs), inputs):
        assert a.dtype == t.dtype and a.shape == t.shape
        _close_rel(a, r, 2e-2)
    with pytest.raises(ValueError, match="lnc"):
        ops.rmsnorm_bwd(x, w, dy, 1e-6, 3)


def test_compiled_training_step_through_rmsnorm_and_mlp_matches_eager():
    from torchneuron.nkilib import ops
    H, I = 64, 96
    x = torch.randn(130, H, generator=_g())
    init = [1 + 0.1 * torch.randn(H, generator=_g(1)), torch.randn(H, I, generator=_g(2)) / 8,
            torch.randn(H, I, generator=_g(3)) / 8, torch.randn(I, H, generator=_g(4)) / 10]

    def run(fwd):
        params = [p.to("neuron").requires_grad_() for p in init]
        xn = x.to("neuron")
        w, wg, wu, wd = params
        loss = fwd(xn, w, wg, wu, wd)
        grads = torch.autograd.grad(loss, params)
        return loss, grads

    def fwd(xn, w, wg, wu, wd):
        y = ops.mlp(ops.rmsnorm(xn, w, 1e-6), wg, wu, wd)
        return (y * y).mean()

    eager_loss, eager_grads = run(fwd)
    comp_loss, comp_grads = run(torch.compile(fwd, backend="neuron"))
    assert comp_grads[0].device.type == "neuron"
    torch.testing.assert_close(comp_loss.cpu(), eager_loss.cpu(), atol=1e-6, rtol=1e-6)
    for c, e in zip(comp_grads, eager_grads):
        torch.testing.assert_close(c.cpu(), e.cpu(), atol=1e-6, rtol=1e-5)
    # one SGD step with the compiled gradients matches the CPU reference step
    ref = [p.clone().requires_grad_() for p in init]
    rloss = mlp_ref(rmsnorm_ref(x, ref[0], 1e-6), *ref[1:]).pow(2).mean()
    rgrads = torch.autograd.grad(rloss, ref)
    for p, c, r in zip(init, comp_grads, rgrads):
        _close_rel(p - 0.1 * c.cpu(), p - 0.1 * r, 1e-5)
