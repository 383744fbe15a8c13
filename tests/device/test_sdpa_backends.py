"""scaled_dot_product_attention under ``sdpa_kernel``: every backend CUDA code may select works.

CPU has flash (without dropout) and math kernels only, so ``sdpa_kernel(EFFICIENT_ATTENTION)``
or ``(CUDNN_ATTENTION)`` alone, or flash/efficient with dropout, find no CPU kernel ("No viable
backend"); on CUDA they run. Neuron runs them with its efficient-attention op. Oracles: CPU float64 math attention
without dropout; with dropout, neuron's math path from the same seed, which draws the same keep
mask (one Bernoulli word per [B, H, L, S] element at the same generator offset).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

DEV = "neuron"
BACKENDS = {
    "efficient": [SDPBackend.EFFICIENT_ATTENTION],
    "flash": [SDPBackend.FLASH_ATTENTION],
    "flash_or_efficient": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION],
    "cudnn": [SDPBackend.CUDNN_ATTENTION],
}


def _inputs(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 10, 8, generator=g, dtype=dtype)
    k = torch.randn(2, 3, 12, 8, generator=g, dtype=dtype)
    v = torch.randn(2, 3, 12, 8, generator=g, dtype=dtype)
    return q, k, v


def _masks(case):
    g = torch.Generator().manual_seed(1)
    return {"plain": {}, "causal": {"is_causal": True},
            "float_mask": {"attn_mask": torch.randn(10, 12, generator=g)},
            "bool_mask": {"attn_mask": torch.rand(2, 1, 10, 12, generator=g) > 0.3}}[case]


def _run(device, backends, q, k, v, kwargs, dropout_p=0.0, seed=None):
    q, k, v = (t.to(device).requires_grad_() for t in (q, k, v))
    kwargs = {n: (t.to(device) if isinstance(t, torch.Tensor) else t) for n, t in kwargs.items()}
    if seed is not None:
        torch.neuron.manual_seed(seed)
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, **kwargs)
    out.backward(torch.linspace(-1, 1, out.numel(), device=device).view_as(out))
    return [t.detach().cpu() for t in (out, q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("case", ["plain", "causal", "float_mask", "bool_mask"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_selected_backend_without_dropout_matches_cpu_float64_attention(backend, case):
    q, k, v = _inputs()
    got = _run(DEV, BACKENDS[backend], q, k, v, _masks(case))
    want = _run("cpu", [SDPBackend.MATH], q.double(), k.double(), v.double(), _masks(case))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.float(), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("case", ["plain", "causal", "float_mask"])
@pytest.mark.parametrize("backend", ["efficient", "flash", "cudnn"])
def test_a_selected_backend_with_dropout_draws_the_math_paths_mask(backend, case):
    q, k, v = _inputs()
    got = _run(DEV, BACKENDS[backend], q, k, v, _masks(case), dropout_p=0.3, seed=4)
    state = torch.neuron.get_rng_state()
    want = _run(DEV, [SDPBackend.MATH], q, k, v, _masks(case), dropout_p=0.3, seed=4)
    assert torch.equal(state, torch.neuron.get_rng_state())  # the same draw from the generator
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=2e-6)
    dropped = _run(DEV, BACKENDS[backend], q, k, v, _masks(case), dropout_p=0.3, seed=5)
    assert not torch.equal(dropped[0], got[0])  # another seed, another mask


def test_dropout_in_bfloat16_is_rounded_once_from_float32():
    q, k, v = _inputs(torch.bfloat16)
    got = _run(DEV, BACKENDS["efficient"], q, k, v, {}, dropout_p=0.2, seed=9)
    want = _run(DEV, [SDPBackend.MATH], q.float(), k.float(), v.float(), {}, dropout_p=0.2, seed=9)
    torch.testing.assert_close(got[0].float(), want[0], atol=2e-2, rtol=2e-2)


def test_efficient_attention_alone_refuses_different_head_counts_as_cuda():
    q, k, v = _inputs()
    with pytest.raises(RuntimeError, match="viable backend|No available kernel"):
        _run(DEV, BACKENDS["efficient"], q, k[:, :1], v[:, :1], {})


def test_float64_attention_with_a_float32_mask_adds_the_mask():
    # CPU's flash kernel reads a float32 mask of float64 attention as float64 data (torch 2.13:
    # outputs off by O(1), silently); neuron takes the math path there, which promotes the mask.
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 3, 32, 8, generator=g, dtype=torch.float64)  # from 32 queries CPU's kernel errs
    k, v = (torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.randn(2, 1, 32, 40, generator=g)
    got = F.scaled_dot_product_attention(*(t.to(DEV) for t in (q, k, v)), attn_mask=mask.to(DEV))
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.double())
    torch.testing.assert_close(got.cpu(), want)
