"""moe_cte_bwd (blockwise MoE backward) vs its reference vs torch autograd; LNC=2; torch op."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nki
from torchneuron.nkilib import moe_cte_bwd, moe_cte_bwd_ref
from moe_cases import moe_case
from torchneuron.nki import NKIShapeError

T_, H_, I_, E_, B_ = 100, 72, 40, 4, 32  # non-tile-multiple shapes, top-2 routing


def _case(T, H, I, E, k, B, dtype, seed=0):
    return moe_case(T, H, I, E, k, B, dtype, seed, with_dout=True)


def _autograd(x, aff, gu, dw, tp, be, dout, B):
    """fp32 autograd of ops._moe_torch with dout[T] = 0 and row T of dx / d_aff zeroed."""
    from torchneuron.nkilib.ops import _moe_torch
    leaves = [t.float().clone().requires_grad_() for t in (x, aff, gu, dw)]
    g = dout.float().clone()
    g[-1] = 0
    dx, daff, dgu, ddn = torch.autograd.grad(_moe_torch(*leaves, tp, be, B), leaves, g)
    T1 = x.shape[0]
    dx[T1 - 1] = 0
    daff = daff.reshape(T1, -1)
    daff[T1 - 1] = 0
    return dx, daff.reshape(-1, 1), dgu, ddn


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def _check(got, want, tol):
    for name, a, b in zip(("d_hidden", "d_aff", "d_gate_up", "d_down"), got, want):
        assert a.shape == b.shape, name
        assert _rel(a, b) < tol, (name, _rel(a, b))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_moe_bwd_matches_reference_and_autograd(dtype, tol):
    args = _case(T_, H_, I_, E_, 2, B_, dtype)
    got = nki.simulate(moe_cte_bwd)(*args)
    ref = moe_cte_bwd_ref(*args)
    assert [t.dtype for t in got] == [dtype, torch.float32, dtype, dtype]
    assert got[1].shape == ((T_ + 1) * E_, 1)
    _check(got, ref, tol)
    _check(ref, _autograd(*args), 1e-5 if dtype == torch.float32 else 1e-2)
    assert got[0][T_].abs().max() == 0 and got[1].reshape(T_ + 1, E_)[T_].abs().max() == 0


def test_moe_bwd_multi_tile_shapes_and_blocks_over_512():
    # H, I over 128 (ragged chunks), block of 600 slots (two token chunks)
    args = _case(700, 160, 136, 2, 1, 600, torch.float32)
    _check(nki.simulate(moe_cte_bwd)(*args), moe_cte_bwd_ref(*args), 1e-5)


def test_moe_bwd_duplicate_blocks_accumulate_and_padding_row_ignored():
    x, aff, gu, dw, tp, be, dout, B = _case(T_, H_, I_, E_, 2, B_, torch.float32)
    single = nki.simulate(moe_cte_bwd)(x, aff, gu, dw, tp, be, dout, B)
    # every block twice (the same token twice for the same expert): gradients double
    tp2 = torch.cat([tp, tp])
    be2 = torch.cat([be, be])
    dout2 = dout.clone()
    dout2[-1] = 1e3  # the padding row's gradient is ignored
    double = nki.simulate(moe_cte_bwd)(x, aff, gu, dw, tp2, be2, dout2, B)
    _check(double, [2 * t for t in single], 1e-5)
    _check(double, moe_cte_bwd_ref(x, aff, gu, dw, tp2, be2, dout2, B), 1e-5)


def test_moe_bwd_lnc2_shard_on_block_partials_sum_to_reference():
    args = _case(T_, H_, I_, E_, 2, B_, torch.bfloat16)
    parts = nki.simulate(moe_cte_bwd)[2](*args)
    assert [tuple(p.shape) for p in parts] == [(2, T_ + 1, H_), (2, (T_ + 1) * E_, 1),
                                               (2, E_, H_, 2, I_), (2, E_, I_, H_)]
    assert all(p.dtype == torch.float32 for p in parts)
    _check([p.sum(0) for p in parts], moe_cte_bwd_ref(*args), 2e-2)


def test_moe_bwd_rejects_bad_dout_shape():
    x, aff, gu, dw, tp, be, dout, B = _case(T_, H_, I_, E_, 2, B_, torch.float32)
    with pytest.raises(NKIShapeError, match="dout"):
        nki.simulate(moe_cte_bwd)(x, aff, gu, dw, tp, be, dout[:-1], B)


class _OpLog(TorchDispatchMode):
    """Names of the ops that reach the dispatcher below autograd."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_moe_op_gradients_on_neuron_use_the_kernel(dtype, tol):
    from torchneuron.nkilib import ops
    x, aff, gu, dw, tp, be, dout, B = _case(T_, H_, I_, E_, 2, B_, dtype)
    leaves = [t.to("neuron").requires_grad_() for t in (x, aff, gu, dw)]
    out = ops.moe_cte(*leaves, tp.to("neuron"), be.to("neuron"), B, 1)
    with _OpLog() as log:
        (out[:T_].float() * dout[:T_].float().to("neuron")).sum().backward()
    # the backward is the NKI kernel's op, once, and no matmul ran outside it
    assert log.names.count("nkilib.moe_cte_bwd") == 1, log.names
    assert not {"aten.mm", "aten.bmm", "aten.matmul"} & set(log.names), log.names
    g = dout.clone()
    g[-1] = 0
    ref = moe_cte_bwd_ref(x, aff, gu, dw, tp, be, g, B)
    got = [t.grad.cpu() for t in leaves]
    assert [t.dtype for t in got] == [dtype, torch.float32, dtype, dtype]
    _check(got, ref, tol)
    if dtype == torch.float32:
        _check(got, _autograd(x, aff, gu, dw, tp, be, g, B), tol)
    # the backward op under LNC=2 agrees with LNC=1
    g2 = ops.moe_cte_bwd(x, aff, gu, dw, tp, be, dout, B, 2)
    _check(g2, ops.moe_cte_bwd(x, aff, gu, dw, tp, be, dout, B, 1), tol)
