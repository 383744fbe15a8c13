"""fp32 attention of short sequences runs small_attention.cpp's kernel (sdpa.cpp routes it: at
least 16 queries, up to 512 keys causal or 256 otherwise (512 with a mask leaving at most 60 % of
the scores), head size up to 128, an additive mask or none, an AVX-512 host), forward and backward, eager, queued and synchronous; fp16 reaches it
through its exact fp32 copies. It sums in another order than CPU's flash kernel, so the oracle is
float64 attention (CPU math) within fp32 rounding; outside its domain neuron still gives CPU's
bits, which pins the routing's limits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchneuron import _C

pytestmark = pytest.mark.skipif(not _C._precision_routes()["fp32_small_attention"],
                                reason="the kernel needs AVX-512 (elsewhere CPU's flash kernel runs)")


@pytest.fixture
def cpu_kernel_only():
    _C._set_small_attention_enabled(False)
    yield
    _C._set_small_attention_enabled(True)


def inputs(B, H, L, S, E, layout="contiguous", seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)

    def one(n):
        if layout == "contiguous":
            return torch.randn(B, H, n, E, generator=g, dtype=torch.float64)
        return torch.randn(B, n, H, E, generator=g, dtype=torch.float64).transpose(1, 2)  # nn attention's views
    q, k, v = one(L), one(S), one(S)
    grad = torch.randn(B, H, L, E, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, grad)]


def attention(device, q, k, v, grad, **kw):
    """Output and the gradients of q, k and v on `device`, returned on CPU."""
    leaves = [t.detach().to(device).requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*leaves, **kw)
    out.backward(grad.to(device, out.dtype))
    return [out.detach().cpu()] + [t.grad.cpu() for t in leaves]


def close_to_float64(got, q, k, v, grad, rtol=4e-6, **kw):
    want = attention("cpu", q.double(), k.double(), v.double(), grad.double(), **kw)
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, want):
        torch.testing.assert_close(a.double(), b, rtol=rtol, atol=rtol * b.abs().max().item(), msg=name)


SHAPES = {  # B, H, L, S, E
    "demo_gpt": (16, 4, 64, 64, 32),
    "fewest_queries": (2, 3, 16, 16, 8),
    "head_size_1": (2, 2, 20, 20, 1),
    "head_size_17": (1, 2, 70, 70, 17),
    "head_size_128": (1, 2, 33, 40, 128),
    "more_keys": (2, 2, 33, 100, 64),
    "more_queries": (1, 2, 130, 40, 16),
    "tiles_of_64": (1, 1, 200, 200, 16),
    "keys_256": (1, 2, 40, 256, 16),
}


@pytest.mark.parametrize("layout", ["contiguous", "split_heads"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_forward_and_backward_match_float64_within_fp32_rounding(shape, causal, layout):
    q, k, v, grad = inputs(*shape, layout=layout)
    close_to_float64(attention("neuron", q, k, v, grad, is_causal=causal), q, k, v, grad, is_causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("heads", [(4, 2), (6, 1), (8, 4)], ids=["4_of_2", "6_of_1", "8_of_4"])
def test_grouped_query_attention(heads, causal):
    # Hugging Face's Llama, Qwen and Mistral pass enable_gqa: query head h reads key/value head
    # h / (H / Hk), and the key/value gradients sum over their group's query heads.
    H, Hk = heads
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 80, H, 16, generator=g).transpose(1, 2)
    k, v = (torch.randn(2, 80, Hk, 16, generator=g).transpose(1, 2) for _ in range(2))
    grad = torch.randn(2, H, 80, 16, generator=g)
    close_to_float64(attention("neuron", q, k, v, grad, is_causal=causal, enable_gqa=True), q, k, v, grad,
                     is_causal=causal, enable_gqa=True)


def test_causal_attention_of_512_keys_runs_the_kernel():
    q, k, v, grad = inputs(1, 2, 520, 512, 16)
    got = attention("neuron", q, k, v, grad, is_causal=True)
    close_to_float64(got, q, k, v, grad, is_causal=True)
    assert not all(torch.equal(a, b) for a, b in zip(got, attention("cpu", q, k, v, grad, is_causal=True)))


def test_the_kernel_is_not_cpus_flash_kernel(cpu_kernel_only):
    # The routing is real: the kernel's sums differ from CPU's in the last place somewhere, and
    # disabled, neuron gives CPU's bits again.
    q, k, v, grad = inputs(*SHAPES["demo_gpt"], layout="split_heads")
    cpu = attention("cpu", q, k, v, grad, is_causal=True)
    for a, b in zip(attention("neuron", q, k, v, grad, is_causal=True), cpu):
        assert torch.equal(a, b)
    _C._set_small_attention_enabled(True)
    for a, b in zip(attention("neuron", q, k, v, grad, is_causal=True), cpu):
        assert not torch.equal(a, b)


OUTSIDE = {  # B, H, L, S, E, is_causal: CPU's flash kernel runs, CPU's bits
    "15_queries": (2, 2, 15, 15, 8, True),
    "257_keys_full": (1, 1, 20, 257, 8, False),
    "513_keys_causal": (1, 1, 520, 513, 8, True),
    "head_size_129": (1, 1, 20, 20, 129, False),
}


@pytest.mark.parametrize("shape", OUTSIDE.values(), ids=OUTSIDE.keys())
def test_outside_its_domain_neuron_gives_cpus_bits(shape):
    *dims, causal = shape
    q, k, v, grad = inputs(*dims)
    got, cpu = attention("neuron", q, k, v, grad, is_causal=causal), attention("cpu", q, k, v, grad, is_causal=causal)
    for a, b in zip(got, cpu):
        assert torch.equal(a, b)


def causal_and_padding(B, H, L, S, left=False):
    """Hugging Face's mask for a padded batch: causal (the last query sees every key), the last
    (or, left-padded, the first) third of batch 0's keys padding."""
    keep = torch.ones(B, S, dtype=torch.bool)
    if left:
        keep[0, :S // 3] = False
    else:
        keep[0, -(S // 3):] = False
    return torch.ones(L, S, dtype=torch.bool).tril(S - L)[None, None] & keep[:, None, None, :]


def rand(*shape, seed=3):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


MASKS = {  # B, H, L, S, E and the mask (SDPA's attn_mask)
    "hf_causal_padding": ((2, 4, 64, 64, 32), lambda: causal_and_padding(2, 4, 64, 64)),
    "hf_left_padding": ((2, 4, 64, 64, 32), lambda: causal_and_padding(2, 4, 64, 64, left=True)),
    "hf_float_min": ((2, 2, 70, 90, 16), lambda: torch.zeros(2, 1, 70, 90).masked_fill(
        ~causal_and_padding(2, 1, 70, 90), torch.finfo(torch.float32).min)),
    "additive_b1ls": ((2, 3, 100, 130, 24), lambda: rand(2, 1, 100, 130)),
    "additive_2d": ((2, 2, 40, 50, 17), lambda: rand(40, 50)),
    "per_head_keys": ((2, 3, 40, 50, 16), lambda: rand(1, 3, 1, 50)),
    "bool_random": ((2, 2, 32, 32, 8), lambda: (rand(32, 32) > -0.5) | torch.eye(32, dtype=torch.bool)),
    "keys_256": ((1, 2, 33, 256, 16), lambda: causal_and_padding(1, 2, 33, 256)),
}


@pytest.mark.parametrize("case", MASKS.values(), ids=MASKS.keys())
def test_masked_attention_matches_float64_within_fp32_rounding(case):
    shape, make = case
    q, k, v, grad = inputs(*shape, layout="split_heads")
    mask = make()
    got = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron"))
    close_to_float64(got, q, k, v, grad, attn_mask=mask if mask.dtype == torch.bool else mask.double())


def test_beyond_256_keys_a_mask_leaving_half_the_scores_runs_the_kernel():
    # From 257 to 512 keys the mask's values decide: a causal mask with padding leaves about half
    # of the scores (the kernel skips each row's masked tail), so the kernel runs.
    q, k, v, grad = inputs(2, 2, 300, 300, 16, layout="split_heads")
    mask = causal_and_padding(2, 2, 300, 300)
    got = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron"))
    close_to_float64(got, q, k, v, grad, attn_mask=mask)
    assert not any(torch.equal(a, b) for a, b in zip(got, attention("cpu", q, k, v, grad, attn_mask=mask)))


def test_beyond_256_keys_a_full_mask_keeps_cpus_kernel():
    # A mask that leaves more than 60 % of the scores (here 80 %, at random) is faster on CPU's
    # kernel: CPU's bits.
    q, k, v, grad = inputs(1, 2, 40, 300, 8)
    mask = rand(40, 300) > -0.84
    got, cpu = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), attention("cpu", q, k, v, grad, attn_mask=mask)
    for a, b in zip(got, cpu):
        assert torch.equal(a, b)


def test_a_mask_runs_the_kernel(cpu_kernel_only):
    # Disabled, a masked call gives CPU's bits; enabled, the kernel's (HF's padded batches).
    q, k, v, grad = inputs(2, 4, 64, 64, 32, layout="split_heads")
    mask = causal_and_padding(2, 4, 64, 64)
    cpu = attention("cpu", q, k, v, grad, attn_mask=mask)
    for a, b in zip(attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), cpu):
        assert torch.equal(a, b)
    _C._set_small_attention_enabled(True)
    for a, b in zip(attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), cpu):
        assert not torch.equal(a, b)


@pytest.mark.parametrize("heads", [(4, 2), (6, 1)], ids=["4_of_2", "6_of_1"])
def test_grouped_query_attention_with_a_per_head_mask(heads):
    # Each query head of a group reads its own mask rows; the group's first head decides which key
    # gradients its first tile writes.
    H, Hk = heads
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, H, 40, 16, generator=g)
    k, v = (torch.randn(2, Hk, 40, 16, generator=g) for _ in range(2))
    grad = torch.randn(2, H, 40, 16, generator=g)
    mask = torch.zeros(2, H, 40, 40)
    mask[:, 0, :, 20:] = float("-inf")  # the group's first head sees half the keys
    mask[:, 1:] = rand(2, H - 1, 40, 40)
    close_to_float64(attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron"), enable_gqa=True),
                     q, k, v, grad, attn_mask=mask.double(), enable_gqa=True)


def test_rows_whose_keys_are_all_masked_give_cpus_zeros():
    # CPU's flash kernel gives such a query a zero output row, logsumexp 0 and zero gradients
    # (not exp(-inf - -inf) = NaN); so does the kernel.
    q, k, v, grad = inputs(2, 2, 24, 30, 16)
    mask = rand(2, 1, 24, 30)
    mask[0, :, 3] = float("-inf")
    mask[1, :, 5:9] = float("-inf")
    mask[1, :, 10, 7:] = float("-inf")  # only a row's tail
    got = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron"))
    cpu = attention("cpu", q, k, v, grad, attn_mask=mask)
    for name, a, b in zip(("out", "grad_q", "grad_k", "grad_v"), got, cpu):
        assert not a.isnan().any(), name
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)
    assert not torch.equal(got[0], cpu[0])  # the kernel's, not CPU's
    assert (got[0][0, :, 3] == 0).all() and (got[0][1, :, 5:9] == 0).all() and (got[1][1, :, 5:9] == 0).all()
    args = [t.to("neuron") for t in (q, k, v)]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, False, attn_mask=mask.to("neuron"))
    assert (lse.cpu()[0, :, 3] == 0).all() and (lse.cpu()[1, :, 5:9] == 0).all()
    assert torch.isfinite(lse.cpu()).all()


def test_a_causal_op_with_a_mask_applies_both():
    # The op (unlike SDPA's front end) takes is_causal and a mask together: query i sees keys up
    # to i that the mask keeps.
    q, k, v, _ = inputs(2, 2, 40, 40, 16)
    mask = rand(2, 1, 40, 40)
    mask[1, :, :, 30:] = float("-inf")
    args = [t.float().to("neuron") for t in (q, k, v)]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*args, 0.0, True,
                                                                         attn_mask=mask.to("neuron"))
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0 + mask.double()
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(out.cpu().double(), s.softmax(-1) @ v.double(), rtol=4e-6, atol=4e-6)
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(s, -1), rtol=2e-6, atol=2e-6)


def test_masked_key_gradients_over_reused_device_memory():
    # The first query tile (64 rows) sees keys below 20 only, the second tile all 40: key
    # gradients 20-39 are zeroed before the second tile adds to them, even in pooled blocks that
    # held NaNs.
    q, k, v, grad = inputs(2, 2, 80, 40, 16)
    mask = torch.zeros(80, 40)
    mask[:64, 20:] = float("-inf")
    junk = [torch.full((2, 2, 40, 16), float("nan"), device="neuron") for _ in range(16)]
    torch.neuron.synchronize()
    del junk
    close_to_float64(attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), q, k, v, grad,
                     attn_mask=mask.double())


def test_a_nan_in_the_mask_reaches_the_output():
    # A row's last key NaN, the rest finite: the kernel's key limit counts the NaN (it is not
    # -inf), so the row's output is NaN as CPU's is.
    q, k, v, grad = inputs(1, 2, 20, 20, 8)
    mask = rand(20, 20)
    mask[:, 15:] = float("-inf")
    mask[4, 19] = float("nan")
    out = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron"))[0]
    assert torch.equal(out.isnan(), attention("cpu", q, k, v, grad, attn_mask=mask)[0].isnan())
    assert out[0, :, 4].isnan().all() and not out[0, :, 5:].isnan().any()


def test_the_op_with_a_mask_broadcast_over_keys_keeps_cpus_kernel():
    # The flash op (unlike SDPA's front end, which expands it) takes a mask whose key dim is 1;
    # the kernel reads masks along the keys, so CPU's kernel runs.
    q, k, v, _ = inputs(1, 2, 20, 20, 8)
    mask = rand(1, 1, 20, 1)
    got = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to("neuron"), k.to("neuron"), v.to("neuron"), 0.0, False, attn_mask=mask.to("neuron"))
    cpu = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, attn_mask=mask)
    for a, b in zip(got, cpu):
        assert torch.equal(a.cpu(), b)


MASKS_OUTSIDE = {  # CPU's flash kernel runs, CPU's bits
    "257_keys": ((1, 1, 20, 257, 8), lambda: rand(20, 257)),
    "broadcast_keys": ((1, 2, 20, 20, 8), lambda: rand(1, 1, 20, 1)),
    "15_queries": ((2, 2, 15, 15, 8), lambda: rand(15, 15)),
}


@pytest.mark.parametrize("case", MASKS_OUTSIDE.values(), ids=MASKS_OUTSIDE.keys())
def test_a_mask_outside_its_domain_keeps_cpus_kernel(case):
    shape, make = case
    q, k, v, grad = inputs(*shape)
    mask = make()
    got, cpu = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), attention("cpu", q, k, v, grad, attn_mask=mask)
    for a, b in zip(got, cpu):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["masked", "causal"])
def test_results_do_not_depend_on_the_thread_count(causal):
    q, k, v, grad = inputs(2, 3, 150, 150, 32, layout="split_heads")
    kw = {"is_causal": True} if causal else {"attn_mask": causal_and_padding(2, 3, 150, 150).to("neuron")}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention("neuron", q, k, v, grad, **kw)
        torch.set_num_threads(2)
        two = attention("neuron", q, k, v, grad, **kw)
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


def test_an_expanded_output_gradient():
    # out.sum().backward() hands the backward a stride-0 gradient.
    q, k, v, _ = inputs(2, 2, 24, 24, 16)
    leaves = [t.to("neuron").requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*leaves, is_causal=True).sum().backward()
    ones = torch.ones(2, 2, 24, 16)
    close_to_float64([F.scaled_dot_product_attention(q, k, v, is_causal=True)] + [t.grad.cpu() for t in leaves],
                     q, k, v, ones, is_causal=True)


def test_the_logsumexp_is_the_rows_log_sum_exp():
    q, k, v, _ = inputs(2, 2, 40, 40, 16, layout="split_heads")
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.to("neuron"), k.to("neuron"), v.to("neuron"), 0.0, True)
    s = (q.double() @ k.double().transpose(-1, -2)) / 4.0
    s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(lse.cpu().double(), torch.logsumexp(s, -1), rtol=2e-6, atol=2e-6)
    cpu_out, cpu_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    assert out.stride() == cpu_out.stride() and lse.stride() == cpu_lse.stride()


def test_a_given_scale_is_used():
    q, k, v, grad = inputs(2, 2, 32, 32, 16)
    close_to_float64(attention("neuron", q, k, v, grad, is_causal=True, scale=0.7), q, k, v, grad,
                     is_causal=True, scale=0.7)
    close_to_float64(attention("neuron", q, k, v, grad, scale=-0.3), q, k, v, grad, scale=-0.3)


def test_nans_reach_the_outputs_cpus_do():
    # Outputs: NaN exactly where CPU's are. Gradients: NaN where the NaN inputs are read (CPU's
    # kernel also multiplies masked-out zeros by them, spreading NaNs further; so do others).
    q, k, v, grad = inputs(1, 2, 32, 32, 8)
    q[0, 0, 5, 2] = float("nan")  # one query row
    k[0, 1, 9, 0] = float("nan")  # one key: every query that sees it
    out, gq, gk, gv = attention("neuron", q, k, v, grad, is_causal=True)
    assert torch.equal(out.isnan(), attention("cpu", q, k, v, grad, is_causal=True)[0].isnan())
    assert out[0, 0, 5].isnan().all() and not out[0, 0, 6:].isnan().any()
    assert out[0, 1, 9:].isnan().all() and not out[0, 1, :9].isnan().any()
    assert gq[0, 0, 5].isnan().all() and gq[0, 1, 9:].isnan().all()
    assert gk[0, 1, 9].isnan().all()


def test_fp16_reaches_it_through_exact_fp32_copies():
    q, k, v, grad = inputs(2, 4, 64, 64, 32, layout="split_heads", dtype=torch.float16)
    got = attention("neuron", q, k, v, grad, is_causal=True)
    assert all(t.dtype == torch.float16 for t in got)
    # The output is the fp32 kernel's rounded once; the gradients read that rounded output.
    want = attention("neuron", q.float(), k.float(), v.float(), grad.float(), is_causal=True)
    assert torch.equal(got[0], want[0].half())
    exact = attention("cpu", q.double(), k.double(), v.double(), grad.double(), is_causal=True)
    for a, b in zip(got[1:], exact[1:]):
        torch.testing.assert_close(a.double(), b, rtol=2e-3, atol=2e-3 * b.abs().max().item())
