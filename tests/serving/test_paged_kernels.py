"""torchneuron's vLLM kernels (csrc/backend/vllm_kernels.cpp) against CPU PyTorch.

``torchneuron::paged_kv_write`` and ``torchneuron::paged_decode_attention`` read and write the
token-major paged cache ``[blocks, block_size, kv_heads, 2 * head]`` through slot mappings and
block tables; the oracle is ``index_copy_`` and SDPA on the gathered context, on CPU. The
rotary and RMSNorm kernels are compared with vLLM's native formulas, written out here.
No vLLM needed.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torchneuron  # noqa: F401  (registers the ops)

BLOCKS, BS, KVH, D = 24, 8, 2, 16


def _cache(dtype=torch.float32, device="neuron"):
    g = torch.Generator().manual_seed(0)
    return torch.randn(BLOCKS, BS, KVH, 2 * D, generator=g).to(dtype).to(device)


def _reference_decode(q, cache, table, lens, scale):
    """SDPA per request over its gathered context (CPU, fp32); any cache shape."""
    q, cache = q.cpu().float(), cache.cpu().float()
    kvh, d = cache.shape[2], cache.shape[3] // 2
    outs = []
    for r, n in enumerate(lens.tolist()):
        rows = cache[table[r].cpu().long()].reshape(-1, kvh, 2 * d)[:n]  # [n, kvh, 2d]
        k, v = rows[..., :d].transpose(0, 1), rows[..., d:].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r][:, None, :], k, v, scale=scale,
                                           enable_gqa=q.shape[1] != kvh)
        outs.append(o[:, 0, :])
    return torch.stack(outs)


def _decode_case(heads, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    lens = torch.tensor([1, 7, 8, 9, 23, 32], dtype=torch.int32)
    n = len(lens)
    perm = torch.randperm(BLOCKS, generator=g)
    table = perm[: n * 4].view(n, 4).to(torch.int32)  # 4 blocks = 32 tokens per request
    q = torch.randn(n, heads, D, generator=g).to(dtype)
    return q, table, lens


@pytest.mark.parametrize("heads", [KVH, 4 * KVH], ids=["mha", "gqa"])
def test_decode_attention_matches_sdpa_on_gathered_context(heads):
    cache = _cache()
    q, table, lens = _decode_case(heads)
    out = torch.full((len(lens), heads, D), float("nan"), device="neuron")
    torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), cache, table.to("neuron"),
                                                 lens.to("neuron"), D ** -0.5, out)
    assert out.device.type == "neuron"
    torch.testing.assert_close(out.cpu(), _reference_decode(q, cache, table, lens, D ** -0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_an_fp8_cache_dequantizes_keys_and_values_by_their_scales(fp8, dtype):
    # each cached key read as code * k_scale, each value as code * v_scale, in fp32
    codes = (_cache() * 8).to(fp8)
    k_scale, v_scale = 0.125, 0.5
    q, table, lens = _decode_case(4 * KVH, dtype)
    out = torch.full((len(lens), 4 * KVH, D), float("nan"), dtype=dtype, device="neuron")
    torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), codes.to("neuron"), table.to("neuron"),
                                                 lens.to("neuron"), D ** -0.5, out, k_scale, v_scale)
    deq = codes.float()
    deq[..., :D] *= k_scale
    deq[..., D:] *= v_scale
    want = _reference_decode(q, deq, table, lens, D ** -0.5)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.cpu().float(), want, atol=tol, rtol=tol)


def test_kv_write_copies_fp8_codes_into_an_fp8_cache():
    cache = torch.zeros(BLOCKS, BS, KVH, 2 * D, dtype=torch.float8_e4m3fn, device="neuron")
    g = torch.Generator().manual_seed(5)
    k = torch.randn(3, KVH, D, generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(3, KVH, D, generator=g).to(torch.float8_e4m3fn)
    torch.ops.torchneuron.paged_kv_write(k.to("neuron"), v.to("neuron"), cache,
                                         torch.tensor([5, -1, 17], device="neuron"))
    rows = cache.cpu().view(torch.uint8).view(-1, KVH, 2 * D)
    assert torch.equal(rows[5, :, :D], k[0].view(torch.uint8)) and torch.equal(rows[5, :, D:], v[0].view(torch.uint8))
    assert torch.equal(rows[17, :, :D], k[2].view(torch.uint8))
    assert int(rows.count_nonzero()) == int(torch.cat([k[0], v[0], k[2], v[2]]).view(torch.uint8).count_nonzero())


def test_decode_attention_refuses_a_query_dtype_other_than_a_non_fp8_caches():
    q, table, lens = _decode_case(KVH)
    with pytest.raises(RuntimeError, match="differs from the kv_cache"):
        torch.ops.torchneuron.paged_decode_attention(
            q.to("neuron"), _cache(torch.bfloat16), table.to("neuron"), lens.to("neuron"), 1.0,
            torch.empty(len(lens), KVH, D, device="neuron"))


def test_decode_attention_reads_strided_query_and_writes_strided_out():
    # vLLM hands views of the fused qkv projection and of a larger output buffer
    cache = _cache()
    q, table, lens = _decode_case(4)
    big_q = torch.randn(len(lens), 4 * D + 40).to("neuron")
    qv = big_q[:, 8: 8 + 4 * D].view(len(lens), 4, D)
    qv.copy_(q.to("neuron"))
    big_out = torch.zeros(len(lens), 4 * D + 24, device="neuron")
    ov = big_out[:, : 4 * D].view(len(lens), 4, D)
    torch.ops.torchneuron.paged_decode_attention(qv, cache, table.to("neuron"), lens.to("neuron"),
                                                 0.3, ov)
    torch.testing.assert_close(ov.cpu(), _reference_decode(q, cache, table, lens, 0.3),
                               atol=1e-5, rtol=1e-5)
    assert (big_out[:, 4 * D:] == 0).all()  # nothing written past the view


def test_decode_attention_bf16_accumulates_in_fp32():
    cache = _cache(torch.bfloat16)
    q, table, lens = _decode_case(4, torch.bfloat16)
    out = torch.empty(len(lens), 4, D, dtype=torch.bfloat16, device="neuron")
    torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), cache, table.to("neuron"),
                                                 lens.to("neuron"), D ** -0.5, out)
    ref = _reference_decode(q, cache, table, lens, D ** -0.5)  # fp32 math on the bf16 inputs
    torch.testing.assert_close(out.cpu().float(), ref, atol=1e-2, rtol=1e-2)


def test_kv_write_fills_slots_and_skips_padding():
    cache = _cache()
    expect = cache.cpu().clone()
    g = torch.Generator().manual_seed(2)
    key, value = torch.randn(5, KVH, D, generator=g), torch.randn(5, KVH, D, generator=g)
    slots = torch.tensor([3, 17, -1, BLOCKS * BS - 1], dtype=torch.int64)  # 5th row: padding
    torch.ops.torchneuron.paged_kv_write(key.to("neuron"), value.to("neuron"), cache,
                                         slots.to("neuron"))
    flat = expect.view(-1, KVH, 2 * D)
    keep = slots >= 0
    flat[..., :D].index_copy_(0, slots[keep], key[:4][keep])
    flat[..., D:].index_copy_(0, slots[keep], value[:4][keep])
    assert torch.equal(cache.cpu(), expect)


def test_decode_attention_rejects_block_outside_cache():
    cache = _cache()
    q, table, lens = _decode_case(4)
    table[2, 0] = BLOCKS + 5
    out = torch.empty(len(lens), 4, D, device="neuron")
    # a value error: raised by the kernel, so at the next synchronization when it was queued
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), cache, table.to("neuron"),
                                                     lens.to("neuron"), 1.0, out)
        torch.neuron.synchronize()


def test_kv_write_rejects_slot_outside_cache():
    cache = _cache()
    kv = torch.zeros(1, KVH, D, device="neuron")
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        torch.ops.torchneuron.paged_kv_write(kv, kv, cache,
                                             torch.tensor([BLOCKS * BS], device="neuron"))
        torch.neuron.synchronize()


def test_decode_attention_rejects_non_token_major_cache():
    cache = _cache().permute(0, 2, 1, 3)  # head-major view: not the layout the kernel reads
    q, table, lens = _decode_case(4)
    with pytest.raises(RuntimeError, match="token-major"):
        torch.ops.torchneuron.paged_decode_attention(
            q.to("neuron"), cache, table.to("neuron"), lens.to("neuron"), 1.0,
            torch.empty(len(lens), 4, D, device="neuron"))


def _reference_rotary(positions, x, head, cache, neox):
    """The native formula (vLLM's forward_static) on CPU."""
    t = x.shape[0]
    x = x.cpu().reshape(t, -1, head).clone()
    rot = cache.shape[1]
    cos, sin = cache.cpu()[positions.cpu()].chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rot]
    x1, x2 = (xr[..., : rot // 2], xr[..., rot // 2:]) if neox else (xr[..., ::2], xr[..., 1::2])
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if neox else torch.stack((o1, o2), -1).flatten(-2)
    return torch.cat((out, x[..., rot:]), -1).reshape(t, -1)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "gptj"])
@pytest.mark.parametrize("rot", [D, D // 2], ids=["full", "partial"])
def test_rotary_in_place_matches_native_formula(neox, rot):
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 * KVH) * D, generator=g).to("neuron")  # fused projection
    q, k = qkv[:, : 4 * D], qkv[:, 4 * D: (4 + KVH) * D]  # strided views, as vLLM passes them
    cache = torch.randn(64, rot, generator=g).to("neuron")
    positions = torch.tensor([0, 5, 63, 7, 7]).to("neuron")
    q_ref = _reference_rotary(positions, q, D, cache, neox)
    k_ref = _reference_rotary(positions, k, D, cache, neox)
    v_before = qkv[:, (4 + KVH) * D:].cpu()
    torch.ops.torchneuron.rotary_embedding_(positions, q, k, D, cache, neox)
    torch.testing.assert_close(q.cpu(), q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k.cpu(), k_ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, (4 + KVH) * D:].cpu(), v_before)  # the values untouched


def test_rotary_rejects_position_outside_cache():
    q = torch.zeros(2, D, device="neuron")
    cache = torch.zeros(8, D, device="neuron")
    with pytest.raises(RuntimeError, match="outside the cos/sin cache"):
        torch.ops.torchneuron.rotary_embedding_(torch.tensor([1, 8], device="neuron"), q, None,
                                                D, cache, True)
        torch.neuron.synchronize()


def _decode_general(heads, kvh, d, lens, block_size, dtype=torch.float32, q_scale=1.0):
    """A decode case of any shape: (q, cache, table, lens) on CPU."""
    g = torch.Generator().manual_seed(5)
    per_req = -(-max(lens) // block_size)
    blocks = per_req * len(lens) + 3
    cache = torch.randn(blocks, block_size, kvh, 2 * d, generator=g).to(dtype)
    table = torch.randperm(blocks, generator=g)[: per_req * len(lens)].view(len(lens), per_req)
    q = (torch.randn(len(lens), heads, d, generator=g) * q_scale).to(dtype)
    return q, cache, table.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def _run_decode(q, cache, table, lens, scale):
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device="neuron")
    torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), cache.to("neuron"),
                                                 table.to("neuron"), lens.to("neuron"), scale, out)
    return out.cpu()


def test_decode_attention_long_context_rescales_running_softmax():
    # contexts of many 8-token chunks, sharp scores: the running maximum moves between chunks,
    # so every earlier partial sum must be rescaled (a missing rescale is off by far more)
    q, cache, table, lens = _decode_general(8, 2, 32, [200, 97, 8, 9, 1], 16, q_scale=4.0)
    torch.testing.assert_close(_run_decode(q, cache, table, lens, 32 ** -0.5),
                               _reference_decode(q, cache, table, lens, 32 ** -0.5),
                               atol=2e-5, rtol=2e-5)


def test_decode_attention_head_size_not_a_multiple_of_eight():
    # head 12: the scalar inner loops (the AVX2 ones need 8 | head)
    q, cache, table, lens = _decode_general(4, 4, 12, [30, 5, 17], 8)
    torch.testing.assert_close(_run_decode(q, cache, table, lens, 0.25),
                               _reference_decode(q, cache, table, lens, 0.25),
                               atol=1e-5, rtol=1e-5)


def test_decode_attention_fp16_long_context_accumulates_in_fp32():
    q, cache, table, lens = _decode_general(8, 4, 32, [150, 33], 16, dtype=torch.float16)
    ref = _reference_decode(q, cache, table, lens, 32 ** -0.5)  # fp32 math on fp16 inputs
    torch.testing.assert_close(_run_decode(q, cache, table, lens, 32 ** -0.5).float(), ref,
                               atol=2e-3, rtol=2e-3)


def test_decode_attention_empty_context_gives_zeros():
    q, cache, table, lens = _decode_general(4, 2, 16, [0, 3], 8)
    out = _run_decode(q, cache, table, lens, 1.0)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], _reference_decode(q, cache, table, lens, 1.0)[1:])


# ---- RMSNorm: vLLM's IR ops rms_norm / fused_add_rms_norm ----------------------------------
def _native_rms(x, weight, eps, residual=None):
    """vLLM's native code (vllm/ir/ops/layernorm.py), on CPU."""
    orig = x.dtype
    x = x.float()
    if residual is not None:
        x = x + residual.float()
        residual = x.to(orig)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig), residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no_weight"])
def test_rms_norm_matches_vllm_native_code(dtype, with_weight):
    g = torch.Generator().manual_seed(6)
    x = (torch.randn(7, 260, generator=g) * 3).to(dtype)  # 260: a tail after the 8-wide sums
    w = torch.randn(260, generator=g).to(dtype) if with_weight else None
    out = torch.ops.torchneuron.rms_norm(x.to("neuron"), None if w is None else w.to("neuron"),
                                         1e-5)
    assert out.device.type == "neuron" and out.dtype == dtype
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)
    torch.testing.assert_close(out.cpu(), _native_rms(x, w, 1e-5)[0], **tol)


def test_rms_norm_reads_strided_rows():
    g = torch.Generator().manual_seed(7)
    big = torch.randn(5, 300, generator=g)
    x = big[:, 10:266]  # rows 300 apart, as a slice of a fused projection
    w = torch.randn(256, generator=g)
    out = torch.ops.torchneuron.rms_norm(big.to("neuron")[:, 10:266], w.to("neuron"), 1e-6)
    torch.testing.assert_close(out.cpu(), _native_rms(x, w, 1e-6)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_add_rms_norm_updates_x_and_residual_in_place(dtype):
    g = torch.Generator().manual_seed(8)
    x, res = torch.randn(6, 128, generator=g).to(dtype), torch.randn(6, 128, generator=g).to(dtype)
    w = torch.randn(128, generator=g).to(dtype)
    want_x, want_res = _native_rms(x, w, 1e-5, residual=res)
    xn, rn = x.to("neuron"), res.to("neuron")
    torch.ops.torchneuron.fused_add_rms_norm_(xn, rn, w.to("neuron"), 1e-5)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=0, rtol=8e-3)
    assert torch.equal(rn.cpu(), want_res)  # the rounded sum, exactly
    torch.testing.assert_close(xn.cpu(), want_x, **tol)


def test_rms_norm_rejects_weight_of_another_dtype():
    x = torch.randn(2, 16, device="neuron")
    with pytest.raises(RuntimeError, match="weight dtype"):
        torch.ops.torchneuron.rms_norm(x, torch.ones(16, dtype=torch.bfloat16, device="neuron"), 1e-5)


@pytest.mark.parametrize("kernel", ["rms_norm", "fused_add_rms_norm_", "paged_kv_write"])
def test_integer_operands_are_refused_at_the_call_naming_the_dtypes(kernel):
    # argument errors raise at the call even when the kernel would be queued
    x = torch.ones(3, 2 * D, dtype=torch.int32, device="neuron")
    with pytest.raises(RuntimeError, match="must be float32, float64, float16 or bfloat16, got Int"):
        if kernel == "rms_norm":
            torch.ops.torchneuron.rms_norm(x, None, 1e-5)
        elif kernel == "fused_add_rms_norm_":
            torch.ops.torchneuron.fused_add_rms_norm_(x, x.clone(), None, 1e-5)
        else:
            kv = torch.ones(1, KVH, D, dtype=torch.int32, device="neuron")
            cache = torch.zeros(BLOCKS, BS, KVH, 2 * D, dtype=torch.int32, device="neuron")
            torch.ops.torchneuron.paged_kv_write(kv, kv, cache, torch.tensor([0], device="neuron"))


def test_rms_norm_rejects_rows_that_are_not_dense():
    x = torch.randn(16, 4, device="neuron").t()  # last dim strided
    with pytest.raises(RuntimeError, match="dense last dim"):
        torch.ops.torchneuron.rms_norm(x, None, 1e-5)


@pytest.mark.parametrize("fused", [False, True], ids=["rms_norm", "fused_add"])
def test_rms_norm_bf16_rounds_like_native_code_bit_for_bit(fused):
    # integer inputs: the mean square is exact in any summation order, so only the rounding
    # steps (to bf16 before the weight multiply, then after it) decide the bits
    g = torch.Generator().manual_seed(9)
    x = torch.randint(-4, 5, (8, 256), generator=g).to(torch.bfloat16)
    res = torch.randint(-4, 5, (8, 256), generator=g).to(torch.bfloat16)
    w = torch.randn(256, generator=g).to(torch.bfloat16)
    want, _ = _native_rms(x, w, 1e-5, residual=res if fused else None)
    if fused:
        got = x.to("neuron")
        torch.ops.torchneuron.fused_add_rms_norm_(got, res.to("neuron"), w.to("neuron"), 1e-5)
    else:
        got = torch.ops.torchneuron.rms_norm(x.to("neuron"), w.to("neuron"), 1e-5)
    assert torch.equal(got.cpu(), want)


# ---- queued on the execution engine; captured in graphs (vLLM's decode graphs) --------------
def _step_kernels():
    """One call of each kernel on small device operands, as name -> thunk."""
    g = torch.Generator().manual_seed(10)
    cache = _cache()
    q, table, lens = _decode_case(4)
    q, table, lens = q.to("neuron"), table.to("neuron"), lens.to("neuron")
    out = torch.empty(len(lens), 4, D, device="neuron")
    kv = torch.randn(3, KVH, D, generator=g).to("neuron")
    slots = torch.tensor([0, -1, 9], device="neuron")
    x = torch.randn(3, 64, generator=g).to("neuron")
    rot = torch.randn(16, D, generator=g).to("neuron")
    pos, residual = torch.tensor([0, 3, 15], device="neuron"), x * 2
    return {
        "paged_kv_write": lambda: torch.ops.torchneuron.paged_kv_write(kv, kv, cache, slots),
        "paged_decode_attention": lambda: torch.ops.torchneuron.paged_decode_attention(
            q, cache, table, lens, 1.0, out),
        "rotary_embedding_": lambda: torch.ops.torchneuron.rotary_embedding_(
            pos, x[:, :2 * D], None, D, rot, True),
        "rms_norm": lambda: torch.ops.torchneuron.rms_norm(x, None, 1e-5),
        "fused_add_rms_norm_": lambda: torch.ops.torchneuron.fused_add_rms_norm_(x, residual, None,
                                                                                 1e-5),
    }


@pytest.mark.parametrize("name", ["paged_kv_write", "paged_decode_attention", "rotary_embedding_",
                                  "rms_norm", "fused_add_rms_norm_"])
def test_kernel_is_queued_on_the_execution_engine(name, engine_on):
    call = _step_kernels()[name]
    torch.neuron.synchronize()
    before = torch.neuron.engine.stats()["enqueued"]
    call()
    # one queued kernel, no wait for the queue (the operands' own copies were synchronized)
    assert torch.neuron.engine.stats()["enqueued"] - before == 1


def test_decode_kernels_captured_in_a_graph_read_new_slots_and_lengths_at_each_replay():
    # vLLM's decode graphs: persistent buffers refilled in place between replays
    g = torch.Generator().manual_seed(11)
    heads, n = 4, 3
    cache = torch.zeros(BLOCKS, BS, KVH, 2 * D, device="neuron")
    table = torch.randperm(BLOCKS, generator=g)[: n * 4].view(n, 4).to(torch.int32).to("neuron")
    lens = torch.zeros(n, dtype=torch.int32, device="neuron")
    slots = torch.full((n,), -1, dtype=torch.int64, device="neuron")
    key, value = torch.zeros(n, KVH, D, device="neuron"), torch.zeros(n, KVH, D, device="neuron")
    q = torch.zeros(n, heads, D, device="neuron")
    out = torch.empty(n, heads, D, device="neuron")
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        torch.ops.torchneuron.paged_kv_write(key, value, cache, slots)
        torch.ops.torchneuron.paged_decode_attention(q, cache, table, lens, D ** -0.5, out)
    assert torch.equal(cache.cpu(), torch.zeros_like(cache.cpu()))  # captured, not run
    want = torch.zeros(BLOCKS * BS, KVH, 2 * D)
    table_cpu = table.cpu().long()
    for step in range(1, 4):  # request r decodes its token number step + r
        new_lens = torch.tensor([step + r for r in range(n)], dtype=torch.int32)
        pos = new_lens.long() - 1
        new_slots = table_cpu[torch.arange(n), pos // BS] * BS + pos % BS
        k_new, v_new = torch.randn(n, KVH, D, generator=g), torch.randn(n, KVH, D, generator=g)
        q_new = torch.randn(n, heads, D, generator=g)
        for buf, val in ((lens, new_lens), (slots, new_slots), (key, k_new), (value, v_new),
                         (q, q_new)):
            buf.copy_(val)
        graph.replay()
        want[new_slots] = torch.cat([k_new, v_new], dim=-1)
        ref_cache = want.view(BLOCKS, BS, KVH, 2 * D)
        assert torch.equal(cache.cpu(), ref_cache)
        torch.testing.assert_close(out.cpu(), _reference_decode(q_new, ref_cache, table_cpu,
                                                                new_lens, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)


def test_rotary_and_rms_norm_captured_in_a_graph_read_new_positions_at_replay():
    g = torch.Generator().manual_seed(12)
    rot = torch.randn(16, D, generator=g)
    positions = torch.zeros(3, dtype=torch.int64, device="neuron")
    x = torch.zeros(3, 2 * D, device="neuron")
    rot_n = rot.to("neuron")
    graph = torch.neuron.NeuronGraph()
    with torch.neuron.graph(graph):
        torch.ops.torchneuron.rotary_embedding_(positions, x, None, D, rot_n, True)
        y = torch.ops.torchneuron.rms_norm(x, None, 1e-5)
    for _ in range(2):
        pos, x0 = torch.randint(0, 16, (3,), generator=g), torch.randn(3, 2 * D, generator=g)
        positions.copy_(pos)
        x.copy_(x0)
        graph.replay()
        want = x0.clone()
        torch.ops.torchneuron.rotary_embedding_(pos, want, None, D, rot, True)  # CPU kernel
        torch.testing.assert_close(x.cpu(), want)
        torch.testing.assert_close(y.cpu(), _native_rms(want, None, 1e-5)[0], atol=1e-6, rtol=1e-6)


def test_weak_ref_tensor_shares_memory_without_owning_it():
    x = torch.arange(12.0, device="neuron").view(3, 4)[1:, 1:]
    w = torch.ops.torchneuron.weak_ref_tensor(x)
    assert (w.data_ptr(), w.shape, w.stride()) == (x.data_ptr(), x.shape, x.stride())
    x.add_(1)
    assert torch.equal(w.cpu(), x.cpu())  # one memory
    big = torch.empty(1 << 18, device="neuron")
    allocated = torch.neuron.memory_allocated()
    ref = torch.ops.torchneuron.weak_ref_tensor(big)
    del big
    # the block is freed with its tensor: the weak reference does not keep it
    assert torch.neuron.memory_allocated() == allocated - (1 << 20)
    with pytest.raises(RuntimeError, match="not resizable"):
        ref.resize_(1 << 19)
