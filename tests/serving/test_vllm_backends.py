"""The neuron platform's other execution paths, each against Hugging Face greedy on CPU (fp32):
vLLM's CPU_ATTN fallback, the NKI-lib attention kernels, a Qwen2-MoE model, and compilation
through the ``neuron`` torch.compile backend, vLLM's full decode graphs (NeuronGraph), n-gram speculative
decoding. Every engine also prefills a 191-token prompt in
64-token chunks and then hits the prefix cache with it."""

import pytest
from serving_support import assert_matches_hf, result_of


def _check_against_hf(run, hf):
    assert run["prefix_cached_tokens"] >= 32
    assert_matches_hf(run, hf)


@pytest.mark.parametrize("key", ["cpu_attn", "nki", "compiled", "graphs"])
def test_llama_equals_hf(engines, llama_hf, key):
    _check_against_hf(result_of(engines, key), llama_hf)


@pytest.mark.parametrize("key", ["async", "cpu_attn"])
def test_llama_with_the_execution_engine_on_equals_hf(engines, llama_hf, key):
    # vLLM's host kernels (slot mapping; CPU_ATTN's attention and cache write) run after the
    # kernels queued for their inputs: before, every token after the first differed
    run = result_of(engines, key)
    assert run["engine_enqueued"] > 1000
    _check_against_hf(run, llama_hf)


def test_cpu_attn_fallback_is_selectable_by_name(engines):
    run = result_of(engines, "cpu_attn")
    assert run["attention_impls"] == ["CPUAttentionBackendImpl"]
    assert run["kv_devices"] == ["neuron:0"]


def test_nki_attention_kernels_serve_every_request(engines):
    run = result_of(engines, "nki")
    assert run["attention_impls"] == ["NeuronAttentionImpl"]
    calls = run["attention_calls"]
    assert calls["nki"] > 0
    # the NKI path handles decode and continuations itself: no SDPA decode batch ran for it
    assert calls["decode_batch"] == result_of(engines, "llama")["attention_calls"]["decode_batch"]


def test_qwen2_moe_equals_hf(engines, qwen_moe_hf):
    run = result_of(engines, "qwen2_moe")
    assert run["param_devices"] == ["neuron:0"]
    _check_against_hf(run, qwen_moe_hf)


def test_compiled_model_goes_through_the_neuron_backend(engines):
    compiled = result_of(engines, "compiled")["compile_delta"]
    assert compiled["vllm.num_models_seen"] == 1  # vLLM traced the model with Dynamo ...
    assert compiled["neuron.graphs_lowered"] >= 1  # ... and the neuron backend lowered it
    assert compiled["neuron.eager_fallbacks"] == 0
    # enforce_eager=True: the model is not compiled (only vLLM's small sampler helpers are)
    assert result_of(engines, "llama")["compile_delta"]["vllm.num_models_seen"] == 0


LLAMA_LAYERS = 2  # tiny_models.build_llama's default
CAPTURE_SIZES = 4  # vLLM's decode batch sizes up to max_num_seqs=8: 1, 2, 4, 8


def test_decode_batches_replay_captured_graphs(engines):
    run = result_of(engines, "graphs")
    assert run["compile_delta"]["vllm.num_cudagraph_captured"] == CAPTURE_SIZES
    # the attention layers' Python code ran for the warm-up and the capture of each size only;
    # every decode step the eager engine ran (same requests) was a replay here
    assert run["attention_delta"]["decode_batch"] == LLAMA_LAYERS * 2 * CAPTURE_SIZES
    eager_decode_steps = result_of(engines, "async")["attention_delta"]["decode_batch"]
    assert eager_decode_steps > 0
    assert run["graph_replays"] * LLAMA_LAYERS == eager_decode_steps


def test_qwen2_moe_under_decode_graphs_equals_hf(engines, qwen_moe_hf):
    run = result_of(engines, "qwen2_moe_graphs")
    assert run["graph_replays"] == result_of(engines, "graphs")["graph_replays"]
    _check_against_hf(run, qwen_moe_hf)


def test_compiled_model_decode_batches_replay_graphs_too(engines):
    run = result_of(engines, "compiled")
    assert run["compile_delta"]["vllm.num_cudagraph_captured"] == CAPTURE_SIZES
    assert run["graph_replays"] == result_of(engines, "graphs")["graph_replays"]


def test_eager_engines_capture_no_graphs(engines):
    run = result_of(engines, "async")
    assert run["compile_delta"]["vllm.num_cudagraph_captured"] == 0
    assert run["graph_replays"] == 0


def test_ngram_speculative_decoding_equals_hf(engines, llama_hf):
    # drafts from n-gram lookup, verified in multi-token decode steps by vLLM's rejection
    # sampler on neuron: greedy tokens are the model's own, however many drafts are accepted
    run = result_of(engines, "ngram_spec")
    assert run["spec_decode"]["num_drafts"] > 0 and run["spec_decode"]["num_draft_tokens"] > 0
    _check_against_hf(run, llama_hf)
