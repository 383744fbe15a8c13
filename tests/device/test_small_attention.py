"""fp32 attention of short sequences runs small_attention.cpp's kernel (sdpa.cpp routes it: at
least 16 queries, up to 512 keys causal or 256 without a mask, head size up to 128, no mask, one
head count, an AVX-512 host), forward and backward, eager, queued and synchronous; fp16 reaches it
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


def test_a_mask_keeps_cpus_kernel():
    q, k, v, grad = inputs(2, 2, 32, 32, 8)
    mask = torch.rand(32, 32, generator=torch.Generator().manual_seed(3)) > 0.3
    mask[:, 0] = True
    got, cpu = attention("neuron", q, k, v, grad, attn_mask=mask.to("neuron")), attention("cpu", q, k, v, grad, attn_mask=mask)
    for a, b in zip(got, cpu):
        assert torch.equal(a, b)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_results_do_not_depend_on_the_thread_count(causal):
    q, k, v, grad = inputs(2, 3, 150, 150, 32, layout="split_heads")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = attention("neuron", q, k, v, grad, is_causal=causal)
        torch.set_num_threads(2)
        two = attention("neuron", q, k, v, grad, is_causal=causal)
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
