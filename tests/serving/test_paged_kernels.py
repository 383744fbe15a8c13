"""NEURON_ATTN's paged-KV kernels (csrc/backend/paged_attention.cpp) against CPU PyTorch.

``torchneuron::paged_kv_write`` and ``torchneuron::paged_decode_attention`` read and write the
token-major paged cache ``[blocks, block_size, kv_heads, 2 * head]`` through slot mappings and
block tables; the oracle is ``index_copy_`` and SDPA on the gathered context, on CPU.
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
    """SDPA per request over its gathered context (CPU, fp32)."""
    q, cache = q.cpu().float(), cache.cpu().float()
    outs = []
    for r, n in enumerate(lens.tolist()):
        rows = cache[table[r].cpu().long()].reshape(-1, KVH, 2 * D)[:n]  # [n, kvh, 2D]
        k, v = rows[..., :D].transpose(0, 1), rows[..., D:].transpose(0, 1)
        o = F.scaled_dot_product_attention(q[r][:, None, :], k, v, scale=scale,
                                           enable_gqa=q.shape[1] != KVH)
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
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        torch.ops.torchneuron.paged_decode_attention(q.to("neuron"), cache, table.to("neuron"),
                                                     lens.to("neuron"), 1.0, out)


def test_kv_write_rejects_slot_outside_cache():
    cache = _cache()
    kv = torch.zeros(1, KVH, D, device="neuron")
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        torch.ops.torchneuron.paged_kv_write(kv, kv, cache,
                                             torch.tensor([BLOCKS * BS], device="neuron"))


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
