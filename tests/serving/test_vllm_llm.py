"""vllm.LLM on the neuron platform (one eager engine, TP=1): outputs against Hugging Face on CPU.

One engine serves every test of this module (see vllm_harness.scenario_llm): greedy batches of
prompts of different lengths, seeded sampling, a 191-token prompt prefilled in 64-token chunks,
the same prompt extended (a prefix-cache hit), an over-long request, and the worker's state.
"""

import pytest
from serving_support import DEVICE_MEMORY, assert_matches_hf, result_of

MiB = 1 << 20


@pytest.fixture(scope="module")
def llm_run(engines):
    return result_of(engines, "llama")


def test_neuron_platform_is_selected_by_the_plugin(llm_run):
    assert llm_run["platform"] == "NeuronPlatform"


def test_weights_and_kv_cache_are_on_the_neuron_device(llm_run):
    assert llm_run["worker_device"] == "neuron:0"
    assert llm_run["param_devices"] == ["neuron:0"]
    assert llm_run["kv_devices"] == ["neuron:0"]


def test_greedy_batch_of_different_lengths_equals_hf(llm_run, llama_hf):
    assert_matches_hf(llm_run, llama_hf, keys=["greedy"])


def test_batching_does_not_change_greedy_tokens(llm_run):
    assert llm_run["greedy_single"] == llm_run["greedy"][:2]


def test_seeded_sampling_is_reproducible_and_seed_dependent(llm_run):
    first, again, other_seed = llm_run["seeded"]
    assert first == again
    assert first != other_seed


def test_chunked_prefill_equals_hf(llm_run, llama_hf):
    # 191 prompt tokens with max_num_batched_tokens=64: later chunks attend to cached ones
    assert llm_run["attention_calls_greedy"]["continuation"] > 0
    assert_matches_hf(llm_run, llama_hf, keys=["long"])


def test_prefix_cache_hit_equals_hf(llm_run, llama_hf):
    assert llm_run["prefix_cached_tokens"] >= llm_run["block_size"]
    assert_matches_hf(llm_run, llama_hf, keys=["prefix"])


def test_neuron_attention_backend_runs_prefill_and_decode(llm_run):
    assert llm_run["attention_impls"] == ["NeuronAttentionImpl"]
    calls = llm_run["attention_calls"]
    assert calls["prefill"] > 0 and calls["decode_batch"] > 0 and calls["nki"] == 0


def test_rmsnorm_layers_run_the_neuron_kernels(llm_run):
    # vLLM IR provider "torchneuron" first in the platform's priority: one kernel per norm
    kernels = llm_run["neuron_kernels"]
    assert kernels.get("torchneuron::rms_norm", 0) > 0  # the final norm (no residual)
    assert kernels.get("torchneuron::fused_add_rms_norm_", 0) > 0  # every other norm


def test_kv_cache_is_sized_from_emulated_device_memory(llm_run):
    total = llm_run["device_total_memory"]
    assert total == 1 << 30  # TORCHNEURON_DEVICE_MEMORY, not host RAM
    assert DEVICE_MEMORY == "1GiB"
    budget = llm_run["gpu_memory_utilization"] * total
    kv = llm_run["kv_bytes"]
    # the KV cache takes the budget minus weights and the profiled activation peak
    assert budget - llm_run["weights_bytes"] - 64 * MiB < kv <= budget
    assert llm_run["device_allocated"] >= kv + llm_run["weights_bytes"]


def test_request_longer_than_the_context_gets_vllms_error(llm_run):
    err = llm_run["too_long_error"]
    assert err is not None and err.startswith("VLLMValidationError")
    assert "maximum context length is 256 tokens" in err


def test_torch_accelerator_is_not_patched_into_noops(llm_run):
    assert llm_run["accelerator_untouched"]


def test_kv_cache_smaller_than_one_request_is_refused_at_start(engines):
    err = result_of(engines, "kv_too_small")["error"]
    assert err is not None and err.startswith("ValueError"), err
    assert "KV cache" in err and "max seq len (256)" in err, err


def test_kv_cache_larger_than_host_memory_is_refused_with_the_fix(engines):
    err = result_of(engines, "kv_over_host")["error"]
    assert err is not None and err.startswith("RuntimeError"), err
    assert "host memory" in err and "TORCHNEURON_DEVICE_MEMORY" in err, err


def test_unavailable_attention_backend_is_refused_by_name(engines):
    err = result_of(engines, "bad_backend")["error"]
    assert err is not None and "'FLASH_ATTN' is not available on the neuron platform" in err, err
    assert "NEURON_ATTN" in err and "CPU_ATTN" in err, err


# ---- sleep mode (enable_sleep_mode=True): remappable memory pools, vLLM's tags ----------------

@pytest.fixture(scope="module", params=["sleep", "sleep_graphs"])
def sleep_run(engines, request):
    run = result_of(engines, request.param)
    if request.param == "sleep_graphs":  # the woken engine's decode steps replay its graphs
        assert run["graph_replays"] > 0
    return run


def test_sleep_level_1_gives_weights_and_kv_cache_back_to_the_device(sleep_run):
    # every tagged pool's pages: the weights (kept in host memory) and the KV cache
    assert sleep_run["sleeping"]
    assert sleep_run["freed_level1"] >= sleep_run["weights_bytes"] + sleep_run["kv_bytes"]


def test_wake_up_restores_memory_addresses_and_tokens(sleep_run):
    assert sleep_run["woken_free_delta"] == 0
    assert sleep_run["pointers_after"] == sleep_run["pointers"]  # tensors never moved
    assert sleep_run["after_level1"] == sleep_run["before"]


def test_sleep_level_2_discards_the_weights_until_they_are_reloaded(sleep_run):
    assert sleep_run["freed_level2"] >= sleep_run["weights_bytes"] + sleep_run["kv_bytes"]
    assert sleep_run["weights_discarded"] == 0.0  # woken pages of discarded memory read as zeros
    assert sleep_run["after_level2"] == sleep_run["before"]  # after reload_weights


def test_an_engine_in_sleep_mode_gives_its_memory_back_at_shutdown(sleep_run):
    # the tags' pools are released with the worker: a later engine of the process gets it all
    assert sleep_run["device_used_after_shutdown"] < 16 * MiB

