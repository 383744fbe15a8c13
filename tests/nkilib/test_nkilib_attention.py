"""attention_cte / attention_bwd against their PyTorch references, and the torch ops."""

import math

import pytest
import torch

import nki
import torchneuron.nkilib.attention as attn_mod
from torchneuron.nkilib import attention_bwd, attention_bwd_ref, attention_cte, attention_ref
from torchneuron.nki import NKIArgumentError, NKIShapeError

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _qkv(B, Bkv, Sq, Skv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return mk(B, Sq, d), mk(Bkv, Skv, d), mk(Bkv, Skv, d)


def _fwd(q, k, v, lnc=1, **kw):
    return nki.simulate(attention_cte)[lnc](q, k, v, **kw)


def _check_fwd(B, Bkv, Sq, Skv, d, dtype, lnc=1, **kw):
    q, k, v = _qkv(B, Bkv, Sq, Skv, d, dtype)
    kt = k.transpose(1, 2).contiguous()  # default tp_k=False layout (Bkv, d, Skv)
    kw.setdefault("scale", 1 / math.sqrt(d))
    out = _fwd(q, kt, v, lnc, **kw)
    ref = attention_ref(q, kt, v, **kw)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_cte_causal_fp32_ragged_tiles():
    _check_fwd(2, 2, 200, 200, 64, torch.float32)


def test_cte_causal_bf16():
    _check_fwd(2, 2, 300, 300, 128, torch.bfloat16)


def test_cte_non_causal_long_kv_crosses_sections():
    # 2100 keys: 5 key tiles -> two online-softmax sections, ragged last tile
    _check_fwd(1, 1, 130, 2100, 32, torch.float32, causal_mask=False)


def test_cte_gqa_four_query_heads_per_kv_head():
    _check_fwd(8, 2, 150, 150, 64, torch.float32)


def test_cte_sliding_window_causal():
    _check_fwd(2, 1, 600, 600, 32, torch.float32, sliding_window=200)


def test_cte_sliding_window_non_causal():
    _check_fwd(1, 1, 256, 1100, 32, torch.float32, causal_mask=False, sliding_window=300)


def test_cte_lnc2_matches_reference():
    _check_fwd(3, 1, 260, 260, 64, torch.float32, lnc=2)


def test_cte_bf16_lnc2():
    _check_fwd(2, 2, 256, 256, 64, torch.bfloat16, lnc=2)


def test_cte_transposed_layouts():
    q, k, v = _qkv(2, 1, 140, 300, 48, torch.float32)
    qT = q.transpose(1, 2).contiguous()
    kw = dict(scale=0.2, causal_mask=True, tp_q=False, tp_k=True, tp_out=True)
    out = _fwd(qT, k, v, **kw)
    assert out.shape == (2, 48, 140)
    torch.testing.assert_close(out, attention_ref(qT, k, v, **kw), atol=1e-5, rtol=1e-5)


def test_cte_streaming_kv_when_not_resident(monkeypatch):
    monkeypatch.setattr(attn_mod, "RESIDENT_KV_BYTES", 0)
    _check_fwd(2, 1, 200, 700, 32, torch.float32, causal_mask=False)


def test_cte_cache_softmax_returns_lse():
    q, k, v = _qkv(2, 1, 200, 200, 32, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    out, lse = _fwd(q, kt, v, scale=0.3, cache_softmax=True)
    rout, rlse = attention_ref(q, kt, v, scale=0.3, cache_softmax=True)
    assert lse.shape == (2, 128, 2) and lse.dtype == torch.float32
    valid = lambda x: x.transpose(1, 2).reshape(2, -1)[:, :200]  # noqa: E731
    torch.testing.assert_close(valid(lse), valid(rlse), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, rout, atol=1e-5, rtol=1e-5)


def test_cte_sink_adds_a_logit_to_the_softmax_denominator():
    # GPT-OSS attention sinks: softmax over [scores, sink_b], the sink column dropped
    q, k, v = _qkv(4, 2, 200, 200, 64, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    sink = torch.tensor([2.0, -1.0, 0.5, 3.0])
    s = torch.einsum("bqd,bkd->bqk", q, k.repeat_interleave(2, 0)) / 8
    s = s.masked_fill(torch.ones(200, 200, dtype=torch.bool).triu(1), float("-inf"))
    p = torch.cat([s, sink[:, None, None].expand(4, 200, 1)], -1).softmax(-1)[..., :-1]
    out = _fwd(q, kt, v, scale=1 / 8, sink=sink)
    torch.testing.assert_close(out, p @ v.repeat_interleave(2, 0), atol=1e-5, rtol=1e-5)


def test_cte_sink_lse_includes_the_sink():
    q, k, v = _qkv(2, 2, 130, 130, 32, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    sink = torch.tensor([1.5, -0.5])
    _, lse = _fwd(q, kt, v, scale=0.2, sink=sink, cache_softmax=True)
    _, ref = attention_ref(q, kt, v, scale=0.2, sink=sink, cache_softmax=True)
    _, plain = attention_ref(q, kt, v, scale=0.2, cache_softmax=True)
    assert (ref - plain)[:, :, 0].min() > 0  # the sink raises every row's lse
    torch.testing.assert_close(lse[:, :, 0], ref[:, :, 0], atol=1e-5, rtol=1e-5)


def test_cte_cp_offset_shifts_the_causal_diagonal():
    # a rank holding queries 384.. of a context-parallel sequence sees keys j <= 384 + i
    q, k, v = _qkv(1, 1, 200, 700, 32, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    out = _fwd(q, kt, v, scale=0.2, cp_offset=384)
    keep = torch.arange(700)[None, :] <= torch.arange(200)[:, None] + 384
    p = (q @ k.transpose(1, 2) * 0.2).masked_fill(~keep, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, p @ v, atol=1e-5, rtol=1e-5)


def test_cte_cp_offset_with_sliding_window():
    _check_fwd(1, 1, 300, 900, 32, torch.float32, cp_offset=500, sliding_window=250)


# ---- prefix KV (k_prior / v_prior / prior_used_len) and strided context parallelism -----------
def _keep_mask(Sq, Skv, Sp, used, causal=True, window=None, cp_offset=0, step=1):
    """Boolean keep mask over concat(k_prior (all Sp), k), written out independently of
    attention_ref: prefix index j sits at position j - used (valid iff j < used), chunk key j at
    j, query row i at cp_offset + i * step."""
    t = (torch.arange(Sq) * step + cp_offset)[:, None]
    pos = torch.cat([torch.arange(Sp) - used, torch.arange(Skv)])[None, :]
    keep = torch.cat([torch.arange(Sp) < used, torch.ones(Skv, dtype=torch.bool)])[None, :]
    keep = keep.expand(Sq, Sp + Skv).clone()
    keep[:, Sp:] &= (pos[:, Sp:] <= t) if causal else True
    if window is not None:
        keep &= (t - pos) < window
    return keep


def _sdpa_masked(q, k, v, keep, scale):
    """F.scaled_dot_product_attention with an explicit boolean mask; (B, S, d) layouts, GQA by
    repeating k / v."""
    g = q.shape[0] // k.shape[0]
    return torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(g, 0), v.float().repeat_interleave(g, 0),
        attn_mask=keep, scale=scale)


def _check_prefix(B, Bkv, Sq, Skv, Sp, d, dtype, used, lnc=1, causal=True, window=None, **kw):
    """Kernel vs attention_ref (out and lse), and attention_ref vs SDPA with an explicit mask."""
    q, k, v = _qkv(B, Bkv, Sq, Skv, d, dtype)
    _, kp, vp = _qkv(B, Bkv, 1, Sp, d, dtype, seed=5)
    sc = 1 / math.sqrt(d)
    kt, kpt = k.transpose(1, 2).contiguous(), kp.transpose(1, 2).contiguous()
    pul = torch.tensor([used], dtype=torch.int32) if isinstance(used, tuple) else used
    n = Sp if used is None else (used[0] if isinstance(used, tuple) else used)
    args = dict(scale=sc, causal_mask=causal, sliding_window=window, k_prior=kpt, v_prior=vp,
                prior_used_len=pul, cache_softmax=True, **kw)
    out, lse = _fwd(q, kt, v, lnc, **args)
    ref, rlse = attention_ref(q, kt, v, **args)
    assert out.dtype == dtype and out.shape == ref.shape == (B, Sq, d)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    valid = lambda x: x.transpose(1, 2).reshape(B, -1)[:, :Sq]  # noqa: E731
    torch.testing.assert_close(valid(lse), valid(rlse), atol=TOL[dtype], rtol=TOL[dtype])
    step = kw.get("global_cp_deg", 1) if kw.get("cp_strided_q_slicing") else 1
    keep = _keep_mask(Sq, Skv, Sp, n, causal, window, kw.get("cp_offset", 0), step)
    sd = _sdpa_masked(q, torch.cat([kp, k], 1), torch.cat([vp, v], 1), keep, sc)
    torch.testing.assert_close(ref.float(), sd.to(dtype).float(), atol=TOL[dtype], rtol=TOL[dtype])
    return out


def test_cte_prefix_causal_fp32_gqa_ragged():
    # prefix 300 and chunk 200: neither a multiple of the 128 / 512 tiles
    _check_prefix(4, 2, 200, 200, 300, 32, torch.float32, used=None)


def test_cte_prefix_used_len_tensor_bf16():
    # run-time prior_used_len (AWS's (1,) tensor) < prefix length: dynamic mask
    _check_prefix(2, 1, 200, 200, 300, 64, torch.bfloat16, used=(170,))


def test_cte_prefix_non_causal_lnc2():
    _check_prefix(4, 2, 150, 260, 300, 32, torch.float32, used=(250,), lnc=2, causal=False)


def test_cte_prefix_bf16_lnc2_static_used_len():
    _check_prefix(2, 2, 256, 256, 400, 64, torch.bfloat16, used=333, lnc=2)


@pytest.mark.parametrize("used", [250, (250,)], ids=["int", "tensor"])
def test_cte_prefix_sliding_window_reaches_into_the_prefix(used):
    # query at position t keeps prefix key j iff t - (j - used) < W: the first 149 queries
    # still see the tail of the prefix
    _check_prefix(2, 1, 300, 300, 300, 32, torch.float32, used=used, window=150)


def test_cte_prefix_used_len_zero_is_plain_attention():
    q, k, v = _qkv(2, 1, 200, 200, 32, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    kp, vp = torch.full((1, 32, 300), 9.0), torch.full((1, 300, 32), 9.0)
    for pul in (0, torch.tensor([0], dtype=torch.int32)):
        out = _fwd(q, kt, v, scale=0.2, k_prior=kp, v_prior=vp, prior_used_len=pul)
        torch.testing.assert_close(out, attention_ref(q, kt, v, scale=0.2), atol=1e-5, rtol=1e-5)


def test_cte_prefix_tp_k_sink_streamed_kv(monkeypatch):
    # k_prior follows k's layout (tp_k=True: (Bkv, Sp, d)); K/V streamed per section
    monkeypatch.setattr(attn_mod, "RESIDENT_KV_BYTES", 0)
    q, k, v = _qkv(2, 1, 140, 300, 48, torch.float32)
    _, kp, vp = _qkv(2, 1, 1, 700, 48, torch.float32, seed=3)
    kw = dict(scale=0.2, tp_k=True, k_prior=kp, v_prior=vp, sink=torch.tensor([1.0, -2.0]),
              prior_used_len=torch.tensor([600], dtype=torch.int32))
    torch.testing.assert_close(_fwd(q, k, v, **kw), attention_ref(q, k, v, **kw),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rank", [0, 2])
def test_cte_cp_strided_matches_rows_of_global_causal_attention(rank):
    # rank r of G=3 holds query rows r, r+3, r+6, ... of a global causal sequence of 600
    G, S = 3, 600
    q, k, v = _qkv(2, 1, S, S, 32, torch.float32)
    kt = k.transpose(1, 2).contiguous()
    full = torch.nn.functional.scaled_dot_product_attention(
        q, k.expand(2, S, 32), v.expand(2, S, 32), is_causal=True, scale=0.2)
    kw = dict(scale=0.2, cp_offset=rank, global_cp_deg=G, cp_strided_q_slicing=True)
    out = _fwd(q[:, rank::G].contiguous(), kt, v, **kw)
    torch.testing.assert_close(out, full[:, rank::G], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(attention_ref(q[:, rank::G], kt, v, **kw), full[:, rank::G],
                               atol=1e-5, rtol=1e-5)


def test_cte_cp_strided_sliding_window_lnc2():
    _check_fwd(2, 1, 200, 700, 32, torch.float32, lnc=2, cp_offset=1, global_cp_deg=3,
               cp_strided_q_slicing=True, sliding_window=100)


def test_cte_cp_strided_with_prefix_bf16():
    _check_prefix(2, 1, 150, 500, 200, 32, torch.bfloat16, used=(120,), cp_offset=1,
                  global_cp_deg=3, cp_strided_q_slicing=True)


def _bad(**kw):
    q, k, v = _qkv(2, 1, 128, 128, 32, torch.float32)
    kw.setdefault("k_prior", torch.zeros(1, 32, 200))
    kw.setdefault("v_prior", torch.zeros(1, 200, 32))
    return _fwd(q, k.transpose(1, 2).contiguous(), v, **kw)


def test_cte_prefix_rejects_bad_inputs():
    with pytest.raises(NKIShapeError, match=r"inconsistent prefix shapes.*expected k_prior"):
        _bad(k_prior=torch.zeros(1, 200, 32))  # tp_k=False wants (Bkv, d, Sp)
    with pytest.raises(NKIShapeError, match=r"v_prior \(1, 150, 32\)"):
        _bad(v_prior=torch.zeros(1, 150, 32))
    with pytest.raises(NKIShapeError, match="inconsistent prefix shapes"):
        _bad(k_prior=torch.zeros(2, 32, 200), v_prior=torch.zeros(2, 200, 32))  # Bkv 2 != 1
    for n in (-1, 201):
        with pytest.raises(NKIArgumentError, match=r"prior_used_len=.* out of range.*\[0, 200\]"):
            _bad(prior_used_len=n)
    with pytest.raises(NKIShapeError, match="1-element tensor"):
        _bad(prior_used_len=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(NKIArgumentError, match="both k_prior and v_prior"):
        _bad(v_prior=None)
    with pytest.raises(NKIArgumentError, match="without k_prior"):
        _bad(k_prior=None, v_prior=None, prior_used_len=3)
    q, k, v = _qkv(1, 1, 10, 10, 8, torch.float32)
    with pytest.raises(ValueError, match="prior_used_len=11"):
        attention_ref(q, k.transpose(1, 2), v, k_prior=k.transpose(1, 2), v_prior=v,
                      prior_used_len=torch.tensor([11], dtype=torch.int32))


def test_cte_cp_strided_rejects_offset_beyond_degree():
    q, k, v = _qkv(1, 1, 128, 128, 32, torch.float32)
    with pytest.raises(NKIArgumentError, match="must be < global_cp_deg=2"):
        _fwd(q, k.transpose(1, 2).contiguous(), v, cp_offset=2, global_cp_deg=2,
             cp_strided_q_slicing=True)


def test_cte_rejects_sink_of_wrong_shape():
    q, k, v = _qkv(2, 2, 128, 128, 32, torch.float32)
    with pytest.raises(NKIShapeError, match=r"expected \(2,\)"):
        _fwd(q, k.transpose(1, 2).contiguous(), v, sink=torch.zeros(3))


def test_cte_rejects_head_dim_over_128():
    q, k, v = _qkv(1, 1, 128, 128, 192, torch.float32)
    with pytest.raises(NKIShapeError, match="d <= 128"):
        _fwd(q, k.transpose(1, 2).contiguous(), v)


def test_cte_rejects_batch_not_multiple_of_kv_batch():
    q, k, v = _qkv(3, 2, 128, 128, 32, torch.float32)
    with pytest.raises(NKIShapeError, match="multiple of kv batch"):
        _fwd(q, k.transpose(1, 2).contiguous(), v)


# ---- backward -------------------------------------------------------------------------------
def _check_bwd(bs, H, Hkv, Sq, Skv, d, dtype, causal=True, window=None, lnc=1, tol=None):
    g = torch.Generator().manual_seed(1)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q, k, v, dy = mk(bs, H, d, Sq), mk(bs, Hkv, d, Skv), mk(bs, Hkv, d, Skv), mk(bs, H, d, Sq)
    sc = 1 / math.sqrt(d)
    o, lse = _fwd(q.reshape(bs * H, d, Sq), k.reshape(bs * Hkv, d, Skv),
                  v.transpose(2, 3).reshape(bs * Hkv, Skv, d).contiguous(), scale=sc,
                  causal_mask=causal, sliding_window=window, tp_q=False, tp_out=True,
                  cache_softmax=True)
    o, lse = o.reshape(bs, H, d, Sq), lse.reshape(bs, H, 128, -1)
    kw = dict(use_causal_mask=causal, softmax_scale=sc, sliding_window=window)
    got = nki.simulate(attention_bwd)[lnc](q, k, v, o, dy, lse, **kw)
    ref = attention_bwd_ref(q, k, v, o, dy, lse, **kw)
    tol = tol or {torch.float32: 1e-5, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in zip(("dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape and a.dtype == dtype, name
        err = (a.float() - b.float()).abs().max() / b.float().abs().max()
        assert err < tol, f"{name}: relative error {err:.2e}"


def test_bwd_causal_fp32_ragged():
    _check_bwd(1, 2, 2, 200, 200, 64, torch.float32)


def test_bwd_non_causal_sq_ne_skv():
    _check_bwd(1, 2, 2, 130, 300, 32, torch.float32, causal=False)


def test_bwd_gqa_accumulates_dk_dv_over_group():
    _check_bwd(1, 4, 2, 160, 160, 32, torch.float32)


def test_bwd_bf16():
    _check_bwd(2, 2, 1, 256, 256, 128, torch.bfloat16)


def test_bwd_sliding_window_lnc2():
    _check_bwd(1, 2, 2, 300, 300, 32, torch.float32, window=100, lnc=2)


def test_bwd_kv_tile_nobody_attends_gets_zero_grad():
    # causal with Skv > Sq: keys 200.. are in every query's future
    _check_bwd(1, 1, 1, 150, 300, 32, torch.float32)


# ---- torch ops ------------------------------------------------------------------------------
def _grads(fn, q, k, v):
    q, k, v = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    o = fn(q, k, v)
    (o.float() * torch.linspace(-1, 1, o.shape[-1], device=o.device)).sum().backward()
    return o.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()


def _sdpa_ref(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                            enable_gqa=True)


def test_op_attention_autograd_matches_sdpa():
    from torchneuron.nkilib.ops import attention
    q, k, v = torch.randn(1, 4, 150, 32), torch.randn(1, 2, 150, 32), torch.randn(1, 2, 150, 32)
    for a, b in zip(_grads(attention, q, k, v), _grads(_sdpa_ref, q, k, v)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_op_attention_on_neuron_device():
    from torchneuron.nkilib.ops import attention
    q, k, v = torch.randn(1, 2, 130, 32), torch.randn(1, 2, 130, 32), torch.randn(1, 2, 130, 32)
    qn, kn, vn = [x.to("neuron") for x in (q, k, v)]
    out = _grads(attention, qn, kn, vn)
    for a, b in zip(out, _grads(_sdpa_ref, q, k, v)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_op_attention_under_torch_compile_is_one_node():
    from torchneuron.nkilib.ops import attention
    q, k, v = torch.randn(1, 2, 130, 32), torch.randn(1, 2, 130, 32), torch.randn(1, 2, 130, 32)
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm

    f = torch.compile(lambda a, b, c: attention(a, b, c) * 2, backend=backend, fullgraph=True)
    out = _grads(f, q, k, v)
    ref = _grads(lambda a, b, c: _sdpa_ref(a, b, c) * 2, q, k, v)
    for a, b in zip(out, ref):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)
    src = graphs[0].code
    assert "nkilib.attention_fwd" in src and "scaled_dot_product" not in src


def test_sdpa_override_routes_neuron_sdpa_through_nki():
    from torchneuron.nkilib import sdpa
    q, k, v = torch.randn(2, 4, 100, 32), torch.randn(2, 2, 100, 32), torch.randn(2, 2, 100, 32)
    qn, kn, vn = [x.to("neuron") for x in (q, k, v)]
    was = sdpa.enabled()
    sdpa.enable()
    try:
        before = sdpa.calls()["nki"]
        out = _grads(_sdpa_ref, qn, kn, vn)
        assert sdpa.calls()["nki"] == before + 1
    finally:
        if not was:
            sdpa.disable()
    for a, b in zip(out, _grads(_sdpa_ref, q, k, v)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-4)


def test_sdpa_override_falls_back_for_explicit_mask():
    from torchneuron.nkilib import sdpa
    q = torch.randn(1, 2, 64, 16)
    mask = torch.rand(64, 64) > 0.3
    mask[:, 0] = True
    was = sdpa.enabled()
    sdpa.enable()
    try:
        before = sdpa.calls()
        out = torch.nn.functional.scaled_dot_product_attention(
            q.to("neuron"), q.to("neuron"), q.to("neuron"), attn_mask=mask.to("neuron"))
        after = sdpa.calls()
        assert after["fallback"] == before["fallback"] + 1 and after["nki"] == before["nki"]
    finally:
        if not was:
            sdpa.disable()
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    torch.testing.assert_close(out.cpu(), ref, atol=1e-5, rtol=1e-5)


def test_sdpa_override_inside_torch_compile_puts_nki_ops_in_both_graphs():
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from torchneuron.nkilib import sdpa
    graphs = []

    def compiler(gm, inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    q = torch.randn(1, 2, 100, 32)
    was = sdpa.enabled()
    sdpa.enable()
    before = sdpa.calls()
    try:
        f = torch.compile(lambda a: _sdpa_ref(a, a, a) * 2,
                          backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler))
        qn = q.to("neuron").requires_grad_()
        out = f(qn)
        out.sum().backward()
    finally:
        if not was:
            sdpa.disable()
    assert len(graphs) == 2, (before, sdpa.calls())
    assert "nkilib.attention_fwd" in graphs[0] and "nkilib.attention_bwd" in graphs[1]
    qc = q.clone().requires_grad_()
    ref = _sdpa_ref(qc, qc, qc) * 2
    ref.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(qn.grad.cpu(), qc.grad, atol=2e-5, rtol=1e-4)
