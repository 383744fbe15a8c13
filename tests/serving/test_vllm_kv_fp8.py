"""An FP8 KV cache on neuron (``kv_cache_dtype="fp8"``, NEURON_ATTN): keys and values stored as
e4m3 codes of ``x / scale`` (scale 1 without checkpoint scales), read back as ``code * scale``
by every attention path (batched decode kernel, prefills, chunked prefill, prefix-cache hits),
against Hugging Face with its cached keys (after rotary) and values rounded the same way."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from serving_support import assert_matches_hf, result_of  # noqa: E402


# A key or value whose fp32 value differs by an ulp between HF and vLLM (another summation
# order) can round to the neighbouring e4m3 code: measured log-probabilities up to 2.7e-4 apart
# (1e-6 without such a flip), tokens equal.
KV_FP8_LOGPROB_ATOL = 1e-3


@pytest.mark.parametrize("key", ["kv_fp8", "kv_fp8_graphs"])
def test_fp8_kv_cache_tokens_match_hugging_face_with_rounded_keys_and_values(quant_engines, llama_kv_fp8_hf, key):
    assert_matches_hf(result_of(quant_engines, key), llama_kv_fp8_hf, atol=KV_FP8_LOGPROB_ATOL)


def test_the_rounding_changes_the_oracle_by_more_than_the_tolerance(llama_hf, llama_kv_fp8_hf):
    # (the comparison above tells an FP8 cache from a full-precision one)
    moved = [abs(a - b) for key in ("greedy", "long", "prefix")
             for run_a, run_b in [(llama_hf[key + "_logprobs"], llama_kv_fp8_hf[key + "_logprobs"])]
             for a, b in zip(sum(run_a, []) if isinstance(run_a[0], list) else run_a,
                             sum(run_b, []) if isinstance(run_b[0], list) else run_b)]
    tokens_differ = any(llama_hf[k] != llama_kv_fp8_hf[k] for k in ("greedy", "long", "prefix"))
    assert tokens_differ or max(moved) > 10 * KV_FP8_LOGPROB_ATOL


def test_fp8_kv_cache_holds_four_times_the_fp32_caches_blocks(engines, quant_engines):
    fp32, fp8 = result_of(engines, "llama")["num_gpu_blocks"], result_of(quant_engines, "kv_fp8")["num_gpu_blocks"]
    assert 3.5 * fp32 <= fp8 <= 4.5 * fp32


def test_every_attention_path_reads_the_fp8_cache(quant_engines):
    r = result_of(quant_engines, "kv_fp8")
    assert r["attention_impls"] == ["NeuronAttentionImpl"]
    calls = r["attention_delta"]
    assert calls["decode_batch"] > 0 and calls["continuation"] > 0
    assert calls["prefill"] == 0  # (no plain prefill: it would read the unrounded keys)


def test_fp8_kv_decode_graphs_replay(quant_engines):
    assert result_of(quant_engines, "kv_fp8_graphs")["graph_replays"] > 0
