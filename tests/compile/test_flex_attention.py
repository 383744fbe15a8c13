"""FlexAttention on neuron, eager and compiled, forward and backward, vs explicit math."""

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from compile_models import DEV, assert_close, attention_reference
from support import run_python

B, H, L, D = 2, 4, 128, 16
WINDOW = 24
_doc_cpu = torch.arange(L) // 40  # three documents: 40, 40, 48 tokens
_doc = _doc_cpu.to(DEV)


def causal(b, h, q, kv):
    return q >= kv


def sliding_window(b, h, q, kv):
    return (q >= kv) & (q - kv <= WINDOW)


def document(b, h, q, kv):
    return (_doc[q] == _doc[kv]) & (q >= kv)


def _dense(mask_mod):
    q = torch.arange(L).view(L, 1)
    kv = torch.arange(L).view(1, L)
    if mask_mod is document:
        return (_doc_cpu[q] == _doc_cpu[kv]) & (q >= kv)
    return mask_mod(None, None, q, kv)


def alibi(score, b, h, q, kv):
    return score - (h + 1) * 0.05 * (q - kv).abs()


MASKS = {"causal": causal, "sliding_window": sliding_window, "document": document}


def _qkv(seed, requires_grad, kv_heads=H):
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, L, D), (B, kv_heads, L, D), (B, kv_heads, L, D)]
    cpu = [torch.randn(s, generator=g) for s in shapes]
    dev = [t.to(DEV).requires_grad_(requires_grad) for t in cpu]
    return cpu, dev


def _reference_grads(cpu, mask=None, score_mod=None, grad_out=None):
    leaves = [t.double().requires_grad_() for t in cpu]
    out = attention_reference(*leaves, mask=mask, score_mod=score_mod)
    out.backward(grad_out.double())
    return out, [t.grad for t in leaves]


@pytest.fixture(scope="module")
def block_masks():
    return {name: create_block_mask(fn, B=None, H=None, Q_LEN=L, KV_LEN=L, device=DEV)
            for name, fn in MASKS.items()}


@pytest.fixture(scope="module")
def compiled_flex():
    return torch.compile(flex_attention, backend="neuron")


def test_eager_causal_matches_sdpa(block_masks):
    cpu, dev = _qkv(0, False)
    out = flex_attention(*dev, block_mask=block_masks["causal"])
    ref = torch.nn.functional.scaled_dot_product_attention(*cpu, is_causal=True)
    assert out.device == DEV
    assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_eager_backward_with_score_mod_matches_reference(block_masks):
    cpu, dev = _qkv(1, True)
    out = flex_attention(*dev, score_mod=alibi, block_mask=block_masks["causal"])
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref, ref_grads = _reference_grads(cpu, _dense(causal), alibi, grad_out)
    assert_close(out, ref.float())
    for t, g in zip(dev, ref_grads):
        assert_close(t.grad, g.float(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_compiled_inference_matches_reference(mask_name, block_masks, compiled_flex):
    cpu, dev = _qkv(2, False)
    with torch.no_grad():
        out = compiled_flex(*dev, score_mod=alibi, block_mask=block_masks[mask_name])
    ref = attention_reference(*cpu, mask=_dense(MASKS[mask_name]), score_mod=alibi)
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)


def test_compiled_inference_uses_fused_cpp_flex_template(block_masks):
    torch._dynamo.reset()
    _, dev = _qkv(3, False)
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(flex_attention, backend="neuron"), *dev,
                                    block_mask=block_masks["causal"])
    code = "\n".join(codes)
    # The C++ FlexAttention template (online softmax over KV blocks), not a dense decomposition.
    assert "cpp_fused_flex_attention" in code
    assert "kernel_exp_reduce_sum_fusion_kernel" in code


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_compiled_training_forward_and_backward_match_reference(mask_name, block_masks,
                                                                compiled_flex, metrics):
    cpu, dev = _qkv(4, True)
    out = compiled_flex(*dev, score_mod=alibi, block_mask=block_masks[mask_name])
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref, ref_grads = _reference_grads(cpu, _dense(MASKS[mask_name]), alibi, grad_out)
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    for t, g in zip(dev, ref_grads):
        assert t.grad.device == DEV
        assert_close(t.grad, g.float(), atol=1e-4, rtol=1e-4)


def test_compiled_training_gqa_matches_reference(block_masks, compiled_flex):
    cpu, dev = _qkv(5, True, kv_heads=2)
    out = compiled_flex(*dev, block_mask=block_masks["causal"], enable_gqa=True)
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref, ref_grads = _reference_grads(cpu, _dense(causal), None, grad_out)
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    for t, g in zip(dev, ref_grads):
        assert_close(t.grad, g.float(), atol=1e-4, rtol=1e-4)


def test_compiled_training_learnable_score_mod_bias_gets_gradient(block_masks, compiled_flex):
    cpu, dev = _qkv(6, True)
    bias_cpu = torch.randn(H)
    bias = bias_cpu.to(DEV).requires_grad_()

    def head_bias(score, b, h, q, kv):
        return score + bias[h]

    out = compiled_flex(*dev, score_mod=head_bias, block_mask=block_masks["causal"])
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))

    bias_ref = bias_cpu.double().requires_grad_()
    leaves = [t.double().requires_grad_() for t in cpu]
    ref = attention_reference(*leaves, mask=_dense(causal),
                              score_mod=lambda s, b, h, q, kv: s + bias_ref[h])
    ref.backward(grad_out.double())
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    assert_close(bias.grad, bias_ref.grad.float(), atol=1e-3, rtol=1e-4)
    assert_close(dev[0].grad, leaves[0].grad.float(), atol=1e-4, rtol=1e-4)


# ---- memory-bounded training path (flex_chunked) ------------------------------------------

@pytest.fixture
def chunked(monkeypatch):
    """Every training call takes the chunked path (threshold 0), compiled afresh."""
    monkeypatch.setenv("TORCHNEURON_FLEX_CHUNK_BYTES", "0")
    torch._dynamo.reset()
    yield torch.compile(flex_attention, backend="neuron")
    torch._dynamo.reset()


@pytest.mark.parametrize("mask_name", list(MASKS))
def test_chunked_training_matches_reference(mask_name, block_masks, chunked):
    cpu, dev = _qkv(7, True)
    out = chunked(*dev, score_mod=alibi, block_mask=block_masks[mask_name])
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref, ref_grads = _reference_grads(cpu, _dense(MASKS[mask_name]), alibi, grad_out)
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    for t, g in zip(dev, ref_grads):
        assert_close(t.grad, g.float(), atol=1e-4, rtol=1e-4)


def test_chunked_training_gqa_matches_reference(block_masks, chunked):
    cpu, dev = _qkv(8, True, kv_heads=2)
    out = chunked(*dev, block_mask=block_masks["causal"], enable_gqa=True)
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref, ref_grads = _reference_grads(cpu, _dense(causal), None, grad_out)
    for t, g in zip(dev, ref_grads):
        assert_close(t.grad, g.float(), atol=1e-4, rtol=1e-4)


def test_chunked_training_learnable_alibi_slopes_get_gradient(block_masks, chunked):
    # A per-head bias would cancel in the softmax (zero gradient); slopes on the distance do not.
    cpu, dev = _qkv(9, True)
    slopes_cpu = torch.rand(H) * 0.1
    slopes = slopes_cpu.to(DEV).requires_grad_()

    def learned_alibi(score, b, h, q, kv):
        return score - slopes[h] * (q - kv)

    out = chunked(*dev, score_mod=learned_alibi, block_mask=block_masks["causal"])
    grad_out = torch.randn(B, H, L, D)
    out.backward(grad_out.to(DEV))
    ref_slopes = slopes_cpu.double().requires_grad_()
    leaves = [t.double().requires_grad_() for t in cpu]
    ref = attention_reference(*leaves, mask=_dense(causal),
                              score_mod=lambda s, b, h, q, kv: s - ref_slopes[h] * (q - kv))
    ref.backward(grad_out.double())
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    assert ref_slopes.grad.abs().max() > 1e-2  # the check below is not vacuous
    assert_close(slopes.grad, ref_slopes.grad.float(), atol=1e-3, rtol=1e-4)


def _peak_training_bytes(fn, n):
    g = torch.Generator().manual_seed(10)
    qkv = [torch.randn(1, 2, n, 16, generator=g).to(DEV).requires_grad_() for _ in range(3)]
    bm = create_block_mask(causal, B=None, H=None, Q_LEN=n, KV_LEN=n, device=DEV)
    fn(*qkv, block_mask=bm).sum().backward()  # compile outside the measurement
    base = torch.neuron.memory_allocated()
    torch.neuron.reset_peak_memory_stats()
    fn(*qkv, block_mask=bm).sum().backward()
    return torch.neuron.max_memory_allocated() - base


def test_large_training_call_does_not_materialise_the_score_matrix(monkeypatch):
    n = 2048
    scores = 2 * n * n * 4  # one fp32 score matrix: 32 MiB
    monkeypatch.setenv("TORCHNEURON_FLEX_CHUNK_BYTES", str(scores // 2))
    torch._dynamo.reset()
    chunked_peak = _peak_training_bytes(torch.compile(flex_attention, backend="neuron"), n)
    monkeypatch.setenv("TORCHNEURON_FLEX_CHUNK_BYTES", str(scores * 2))
    torch._dynamo.reset()
    math_peak = _peak_training_bytes(torch.compile(flex_attention, backend="neuron"), n)
    torch._dynamo.reset()
    assert math_peak > scores  # the fused math path keeps at least one score matrix
    assert chunked_peak < scores * 0.75, (chunked_peak, math_peak)
    assert chunked_peak < math_peak / 3, (chunked_peak, math_peak)


_CHUNKED_PROGRAM = r"""
import torch, torchneuron
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
torch.neuron.reset_dynamo_metrics()
g = torch.Generator().manual_seed(0)
q, k, v = [torch.randn(1, 2, 64, 16, generator=g).to("neuron").requires_grad_() for _ in range(3)]
bm = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, device="neuron")
out = torch.compile(flex_attention, backend="neuron")(q, k, v, block_mask=bm,
                                                     score_mod=lambda s, b, h, i, j: s - 0.1 * (i - j))
out.sum().backward()
m = torch.neuron.get_dynamo_metrics()
print(m["cache_hits"], float(out.sum()), float(q.grad.abs().sum()))
"""


def test_chunked_path_loads_from_the_compile_cache_in_a_new_process(tmp_path):
    # The compiled graph refers to score_mod/mask_mod by key: a cache hit, which skips
    # tracing, must still find them.
    env = {"TORCHNEURON_COMPILE_CACHE_DIR": str(tmp_path), "TORCHNEURON_FLEX_CHUNK_BYTES": "0"}
    first = run_python(_CHUNKED_PROGRAM, env=env, timeout=240)
    assert first.returncode == 0, first.stderr[-3000:]
    second = run_python(_CHUNKED_PROGRAM, env=env, timeout=240)
    assert second.returncode == 0, second.stderr[-3000:]
    hits, *values = second.stdout.split()
    assert int(hits) >= 1
    assert values == first.stdout.split()[1:]


@pytest.mark.parametrize("kind", ["causal", "sliding_window", "document"])
def test_chunked_training_skips_masked_key_blocks_exactly(kind, monkeypatch):
    # 512 tokens in 128-blocks: chunks of 128 query rows skip the key blocks the BlockMask
    # rules out (all but the diagonal ones for a 24-token window), which must not change results.
    n, window = 512, 24
    docs_cpu = torch.arange(n) // 100
    docs = docs_cpu.to(DEV)
    mods = {"causal": lambda b, h, q, kv: q >= kv,
            "sliding_window": lambda b, h, q, kv: (q >= kv) & (q - kv <= window),
            "document": lambda b, h, q, kv: (docs[q] == docs[kv]) & (q >= kv)}
    qi, ki = torch.arange(n).view(n, 1), torch.arange(n).view(1, n)
    dense = {"causal": qi >= ki, "sliding_window": (qi >= ki) & (qi - ki <= window),
             "document": (docs_cpu[qi] == docs_cpu[ki]) & (qi >= ki)}[kind]
    monkeypatch.setenv("TORCHNEURON_FLEX_CHUNK_BYTES", "0")
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(11)
    cpu = [torch.randn(1, 2, n, 16, generator=g) for _ in range(3)]
    dev = [t.to(DEV).requires_grad_() for t in cpu]
    bm = create_block_mask(mods[kind], B=None, H=None, Q_LEN=n, KV_LEN=n, device=DEV)
    out = torch.compile(flex_attention, backend="neuron")(*dev, score_mod=alibi, block_mask=bm)
    grad_out = torch.randn(1, 2, n, 16, generator=g)
    out.backward(grad_out.to(DEV))
    torch._dynamo.reset()
    leaves = [t.double().requires_grad_() for t in cpu]
    ref = attention_reference(*leaves, mask=dense, score_mod=alibi)
    ref.backward(grad_out.double())
    assert_close(out, ref.float(), atol=1e-4, rtol=1e-4)
    for t, r in zip(dev, leaves):
        assert_close(t.grad, r.grad.float(), atol=1e-4, rtol=1e-4)


def test_chunked_key_ranges_follow_the_block_mask():
    from torchneuron.compile.flex_chunked import _key_ranges

    n = 512
    bm = create_block_mask(lambda b, h, q, kv: (q >= kv) & (q - kv <= 24), B=None, H=None,
                           Q_LEN=n, KV_LEN=n, device="cpu")
    t = bm.as_tuple()
    ranges = _key_ranges(n, n, 128, [x for x in t[2:6] if x is not None], t[-3], t[-2])
    # query block i needs key blocks i-1 and i (window 24 < 128), nothing else
    assert ranges == [(0, 128, 0, 128), (128, 256, 0, 256), (256, 384, 128, 384),
                      (384, 512, 256, 512)]
