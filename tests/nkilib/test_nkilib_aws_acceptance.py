"""Acceptance, in the style of AWS NKI-lib's tests: the bundled ``nkilib`` kernels called with
AWS's module paths and signatures, on tiny shapes, against PyTorch / numpy references written
from AWS's documented semantics."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
from nkilib.core.attention.attention_cte import attention_cte
from nkilib.core.cumsum.cumsum import cumsum
from nkilib.core.embeddings.rope import RoPE
from nkilib.core.moe.moe_cte.moe_cte import MoECTEImplementation, MoECTESpec, moe_cte
from nkilib.core.rmsnorm.rmsnorm_quant import RmsNormQuantKernelArgs, rmsnorm_quant_kernel
from nkilib.core.subkernels.rmsnorm_tkg import rmsnorm_tkg
from nkilib.core.utils.common_types import NormType, QuantizationType
from torchneuron.nkilib import make_blocks

BF = ml_dtypes.bfloat16


def launch(kernel, lnc):
    return nki.simulate(kernel)[lnc] if lnc > 1 else nki.simulate(kernel)


# --- cumsum ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape,dtype,tol", [((200, 300), np.float32, 1e-5),
                                             ((3, 5, 70), np.float32, 1e-5),
                                             ((130, 64), BF, 2e-2)])
def test_cumsum(shape, dtype, tol):
    x = np.random.default_rng(0).standard_normal(shape).astype(dtype)
    out = nki.simulate(cumsum)(x)
    ref = np.cumsum(x.astype(np.float32), axis=-1)
    assert out.shape == shape and out.dtype == x.dtype
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=tol * np.abs(ref).max())


def test_cumsum_other_axes_are_not_implemented():
    with pytest.raises(NotImplementedError, match="axis=0"):
        nki.simulate(cumsum)(np.zeros((4, 4), np.float32), axis=0)


# --- RoPE ---------------------------------------------------------------------------------------------

def rope_ref(x, cos, sin, contiguous):
    d = x.shape[0]
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    x1, x2 = (x[:d // 2], x[d // 2:]) if contiguous else (x[0::2], x[1::2])
    a, b = x1 * c - x2 * s, x2 * c + x1 * s
    out = np.empty_like(x)
    if contiguous:
        out[:d // 2], out[d // 2:] = a, b
    else:
        out[0::2], out[1::2] = a, b
    return out


@pytest.mark.parametrize("lnc,lnc_shard,contiguous", [(1, False, True), (2, True, True),
                                                      (2, True, False), (1, False, False)])
def test_rope(lnc, lnc_shard, contiguous):
    d, B, H, S = 64, 2, 4, 32
    rng = np.random.default_rng(1)
    x = rng.standard_normal((d, B, H, S)).astype(np.float32)
    ang = rng.standard_normal((d // 2, B, S)).astype(np.float32)
    out = launch(RoPE, lnc)(x, np.cos(ang), np.sin(ang), lnc_shard=lnc_shard,
                            contiguous_layout=contiguous)
    np.testing.assert_allclose(out, rope_ref(x, np.cos(ang), np.sin(ang), contiguous),
                               rtol=1e-6, atol=1e-6)


def test_rope_lnc_shard_splits_the_sequence_between_cores():
    d, B, H, S = 64, 1, 2, 64
    x = np.zeros((d, B, H, S), np.float32)
    ang = np.zeros((d // 2, B, S), np.float32)
    args = (x, np.cos(ang), np.sin(ang))
    one = nki.benchmark(RoPE, numerics=False)(*args)
    dup = nki.benchmark(RoPE, numerics=False)[2](*args, lnc_shard=False)  # both cores do it all
    split = nki.benchmark(RoPE, numerics=False)[2](*args, lnc_shard=True)
    assert dup.dma_bytes == 2 * one.dma_bytes
    assert split.dma_bytes == one.dma_bytes  # each core moves its half of S


# --- rmsnorm_tkg ----------------------------------------------------------------------------------------

def rmsnorm_tkg_ref(x, g, lnc, hidden_actual=None, hidden_dim_tp=False, eps=1e-6):
    """AWS's documented output layout: result [BxS, H] -> [128, BxS, H/128]; at LNC=2 each H
    half is laid out on its half of the last dim; hidden_dim_tp views H as (H/128, 128)."""
    B, S, H = x.shape
    t = torch.from_numpy(x.astype(np.float32)).reshape(B * S, H)
    n = hidden_actual or H
    y = t * torch.rsqrt((t * t).sum(-1, keepdim=True) / n + eps) * torch.from_numpy(
        g.astype(np.float32)).reshape(1, H)
    if hidden_dim_tp:
        return y.reshape(B * S, H // 128, 128).permute(2, 0, 1).numpy()
    halves = torch.chunk(y, lnc, dim=1)
    return torch.cat([h.reshape(B * S, 128, -1).transpose(0, 1) for h in halves], dim=2).numpy()


@pytest.mark.parametrize("lnc,B,S,H,hidden_actual,hidden_dim_tp,shard_on_h", [
    (1, 1, 8, 1024, None, False, False),
    (1, 1, 1, 512, 384, False, False),
    (2, 2, 8, 1024, None, False, False),
    (2, 1, 1, 2048, None, False, False),
    (1, 1, 1, 512, 384, True, False),
    (2, 2, 8, 512, None, True, False),
    (2, 2, 8, 1024, None, False, True),   # shard on H: partial sums exchanged with sendrecv
    (2, 1, 1, 2048, None, False, True),
])
def test_rmsnorm_tkg(lnc, B, S, H, hidden_actual, hidden_dim_tp, shard_on_h):
    rng = np.random.default_rng(42)
    x = rng.standard_normal((B, S, H)).astype(np.float16)
    if hidden_actual:
        x[..., hidden_actual:] = 0
    g = rng.standard_normal((1, H)).astype(np.float16)
    out = np.zeros((128, B * S, H // 128), np.float16)
    y = launch(rmsnorm_tkg, lnc)(x, g, out, hidden_actual=hidden_actual,
                                 hidden_dim_tp=hidden_dim_tp, shard_on_h=shard_on_h)
    ref = rmsnorm_tkg_ref(x, g, lnc, hidden_actual, hidden_dim_tp)
    np.testing.assert_allclose(y.astype(np.float32), ref, rtol=2e-2, atol=1e-5)


def test_rmsnorm_tkg_shard_on_h_needs_lnc2():
    x = np.zeros((1, 1, 512), np.float16)
    with pytest.raises(Exception, match="shard_on_h needs an LNC=2 launch"):
        nki.simulate(rmsnorm_tkg)(x, np.zeros((1, 512), np.float16),
                                  np.zeros((128, 1, 4), np.float16), shard_on_h=True)


# --- rmsnorm_quant ----------------------------------------------------------------------------------------

def rmsnorm_quant_ref(x, g, kargs, scale=None):
    x = x.astype(np.float32)
    y = x
    if kargs.norm_type == NormType.RMS_NORM:
        y = x / np.sqrt((x * x).mean(-1, keepdims=True) + kargs.eps) * g.astype(np.float32)
    if kargs.quantization_type == QuantizationType.ROW:
        if kargs.lower_bound > 0:
            y = np.clip(y, -kargs.lower_bound, kargs.lower_bound)
        deq = np.maximum(np.abs(y).max(-1, keepdims=True) / 240.0, 1e-6)
        return y, deq
    return y, None


@pytest.mark.parametrize("lnc,kargs", [
    (1, RmsNormQuantKernelArgs()),
    (2, RmsNormQuantKernelArgs()),
    (1, RmsNormQuantKernelArgs(lower_bound=1.0)),
    (2, RmsNormQuantKernelArgs(norm_type=NormType.NO_NORM)),
    (1, RmsNormQuantKernelArgs(quantization_type=QuantizationType.STATIC)),
])
def test_rmsnorm_quant(lnc, kargs):
    rng = np.random.default_rng(7)
    B, S, H = 2, 72, 256
    x = rng.standard_normal((B, S, H)).astype(BF)
    g = rng.standard_normal((H,)).astype(BF)
    scale = np.full((128, 1), 0.02, np.float32) if kargs.is_static_quant() else None
    out = launch(rmsnorm_quant_kernel, lnc)(x, g, kargs, scale)
    y, deq = rmsnorm_quant_ref(x, g, kargs, scale)
    assert out.dtype == ml_dtypes.float8_e4m3
    if kargs.is_row_quant():
        assert out.shape == (B, S, H + 4)
        got_deq = np.ascontiguousarray(out[..., H:]).view(np.float32)
        np.testing.assert_allclose(got_deq, deq, rtol=1e-5)
        recon = out[..., :H].astype(np.float32) * got_deq
        # fp8 e4m3 keeps 3 mantissa bits: |error| <= 2^-4 of the value, + one step near 0
        assert np.all(np.abs(recon - y) <= np.abs(y) / 16 + deq)
    else:
        assert out.shape == (B, S, H)
        recon = out.astype(np.float32) * 0.02
        assert np.all(np.abs(recon - np.clip(y, -4.8, 4.8)) <= np.abs(y) / 16 + 0.02 * 2 ** -6)


def test_rmsnorm_quant_rejects_unsupported_configurations():
    with pytest.raises(NotImplementedError, match="MX quantization"):
        RmsNormQuantKernelArgs(quantization_type=QuantizationType.MX)


# --- attention_cte -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("lnc,causal", [(1, True), (1, False), (2, True), (2, False)])
def test_attention_cte(lnc, causal):
    rng = np.random.default_rng(3)
    B, Bkv, Sq, Sk, d = 4, 2, 160, 160, 64
    q = rng.standard_normal((B, Sq, d)).astype(BF)
    k = rng.standard_normal((Bkv, d, Sk)).astype(BF)
    v = rng.standard_normal((Bkv, Sk, d)).astype(BF)
    scale = 1 / math.sqrt(d)
    out = launch(attention_cte, lnc)(q, k, v, scale=scale, causal_mask=causal)
    qt = torch.from_numpy(q.astype(np.float32))
    kt = torch.from_numpy(k.astype(np.float32)).transpose(1, 2).repeat_interleave(B // Bkv, 0)
    vt = torch.from_numpy(v.astype(np.float32)).repeat_interleave(B // Bkv, 0)
    ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal,
                                                           scale=scale).numpy()
    assert out.shape == (B, Sq, d)
    np.testing.assert_allclose(out.astype(np.float32), ref, atol=2e-2)


def test_attention_cte_options_we_do_not_implement_raise():
    q = np.zeros((1, 128, 64), BF)
    k = np.zeros((1, 64, 128), BF)
    v = np.zeros((1, 128, 64), BF)
    with pytest.raises(NotImplementedError, match="cache_softmax"):
        nki.simulate(attention_cte)(q, k, v, cache_softmax=True)
    with pytest.raises(NotImplementedError, match="bound_min"):
        nki.simulate(attention_cte)(q, k, v, bound_min=np.zeros((1,), np.float32))


# --- moe_cte (blockwise, shard on intermediate) ----------------------------------------------------------

def moe_ref(x, aff, wgu, wd, tok, b2e, bs):
    out = np.zeros((x.shape[0], x.shape[1]), np.float32)
    T = x.shape[0] - 1
    E = wgu.shape[0]
    a = aff.reshape(T + 1, E).astype(np.float32)
    for b, e in enumerate(b2e[:, 0]):
        ids = tok[b * bs:(b + 1) * bs]
        h = x[ids].astype(np.float32)
        g = h @ wgu[e, :, 0].astype(np.float32)
        u = h @ wgu[e, :, 1].astype(np.float32)
        y = (g / (1 + np.exp(-g)) * u) @ wd[e].astype(np.float32)
        for j, t in enumerate(ids):
            if t < T:
                out[t] += a[t, e] * y[j]
    return out


@pytest.mark.parametrize("lnc,dtype,tol", [(2, np.float32, 1e-5), (2, BF, 2e-2), (1, BF, 2e-2)])
def test_moe_cte_shard_on_intermediate(lnc, dtype, tol):
    rng = np.random.default_rng(9)
    T, H, I, E, bs, k = 96, 256, 256, 4, 64, 2
    x = rng.standard_normal((T + 1, H)).astype(dtype)
    wgu = (rng.standard_normal((E, H, 2, I)) * 0.05).astype(dtype)
    wd = (rng.standard_normal((E, I, H)) * 0.05).astype(dtype)
    experts = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(t))[:k]
                           for t in range(T)])
    aff = np.zeros((T + 1, E), np.float32)
    for t in range(T):
        aff[t, experts[t].numpy()] = rng.random(k)
    tok, b2e = (v.numpy() for v in make_blocks(experts, E, bs, T))
    spec = MoECTESpec(implementation=MoECTEImplementation.shard_on_i)
    out = launch(moe_cte, lnc)(x, aff.reshape(-1, 1).astype(dtype), wgu, wd, tok, b2e, bs, spec)
    ref = moe_ref(x, aff.reshape(-1, 1), wgu, wd, tok, b2e, bs)
    assert out.shape == (T + 1, H)
    err = np.abs(out[:T].astype(np.float32) - ref[:T]).max() / np.abs(ref[:T]).max()
    assert err < tol


def test_moe_cte_other_implementations_are_not_implemented():
    spec = MoECTESpec(implementation=MoECTEImplementation.shard_on_block_mx)
    z = np.zeros
    with pytest.raises(NotImplementedError, match="shard_on_block_mx"):
        nki.simulate(moe_cte)(z((5, 8), np.float32), z((20, 1), np.float32),
                              z((4, 8, 2, 8), np.float32), z((4, 8, 8), np.float32),
                              z((4,), np.int32), z((1, 1), np.int32), 4, spec)
