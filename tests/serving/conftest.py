"""Fixtures of the vLLM serving tests: tiny models built offline, the HF oracle, the harness."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tiny_models  # noqa: E402
from serving_support import ENGINE, HARNESS_TIMEOUT, run_engines  # noqa: E402
from vllm_harness import MAX_TOKENS, PREFIX_SUFFIX, PROMPTS, long_prompt  # noqa: E402


# Session fixtures that start a harness process (its engines one after the other).
_HARNESSES = frozenset({"engines", "quant_engines"})


def pytest_collection_modifyitems(config, items):
    """pytest-timeout counts a fixture's set-up in the first test that asks for it: a test that
    may start a harness may take the harness's own limit, and a little more to read its result."""
    for item in items:
        if _HARNESSES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.timeout(HARNESS_TIMEOUT + 60))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return tiny_models.build_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def qwen_moe_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen2_moe(str(tmp_path_factory.mktemp("tiny-qwen2-moe")))


def _oracle(path: str, **kwargs) -> dict:
    long = long_prompt()
    ids, lps = tiny_models.hf_greedy(path, PROMPTS + [long, long + PREFIX_SUFFIX], MAX_TOKENS,
                                     with_logprobs=True, **kwargs)
    n = len(PROMPTS)
    return {"greedy": ids[:n], "long": ids[n], "prefix": ids[n + 1],
            "greedy_logprobs": lps[:n], "long_logprobs": lps[n], "prefix_logprobs": lps[n + 1]}


@pytest.fixture(scope="session")
def llama_hf(llama_dir) -> dict:
    """Hugging Face greedy tokens on CPU in fp32: the oracle."""
    return _oracle(llama_dir)


@pytest.fixture(scope="session")
def llama_kv_fp8_hf(llama_dir) -> dict:
    """The oracle of an FP8 KV cache: HF with its cached keys and values rounded to e4m3."""
    return _oracle(llama_dir, kv_fp8=True)


@pytest.fixture(scope="session")
def qwen_moe_hf(qwen_moe_dir) -> dict:
    return _oracle(qwen_moe_dir)


@pytest.fixture(scope="session")
def lora_dir(llama_dir, tmp_path_factory) -> str:
    """A LoRA adapter (PEFT, random B matrices) for the tiny Llama."""
    return tiny_models.build_lora(llama_dir, str(tmp_path_factory.mktemp("tiny-lora")))


@pytest.fixture(scope="session")
def lora_hf(llama_dir, lora_dir) -> list:
    """Hugging Face greedy tokens through the adapter merged into the model (the oracle)."""
    return tiny_models.hf_greedy(llama_dir, PROMPTS, MAX_TOKENS, adapter=lora_dir)


@pytest.fixture(scope="session")
def fp8_checkpoint_dir(tmp_path_factory) -> str:
    """A serialized block-FP8 checkpoint of a hidden-256 Llama."""
    return tiny_models.build_fp8_block_checkpoint(str(tmp_path_factory.mktemp("tiny-fp8-block")))


@pytest.fixture(scope="session")
def engines(llama_dir, qwen_moe_dir, lora_dir, tmp_path_factory) -> dict:
    """Every in-process engine of the serving tests, started once, one after the other."""
    runs = [
        # 3 blocks of 32 tokens (2 layers x 2 KV heads x 32 x fp32 x K,V = 32 KiB per block)
        dict(key="kv_too_small", scenario="init_error", model=llama_dir,
             args=dict(ENGINE, kv_cache_memory_bytes=3 * 32768)),
        # a KV cache the emulated device could hold but the host could not
        dict(key="kv_over_host", scenario="init_error", model=llama_dir,
             args=dict(ENGINE, kv_cache_memory_bytes=1 << 40)),
        dict(key="bad_backend", scenario="init_error", model=llama_dir,
             args=dict(ENGINE, attention_backend="FLASH_ATTN")),
        dict(key="llama", scenario="llm", model=llama_dir, args=ENGINE),
        # the execution engine on (the default; set here whatever the environment says): vLLM's
        # host kernels (slot mapping, CPU_ATTN's attention) run after the kernels queued before
        dict(key="cpu_attn", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, attention_backend="CPU_ATTN"), env={"TORCHNEURON_ASYNC_EXECUTION": "1"}),
        dict(key="nki", scenario="greedy", model=llama_dir, args=ENGINE,
             env={"TORCHNEURON_NKI_SDPA": "1"}),
        dict(key="qwen2_moe", scenario="greedy", model=qwen_moe_dir, args=ENGINE),
        # ... and with the default attention backend
        dict(key="async", scenario="greedy", model=llama_dir, args=ENGINE,
             env={"TORCHNEURON_ASYNC_EXECUTION": "1"}),
        dict(key="compiled", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False)),
        # vLLM's full decode graphs (eager model code): decode steps replay NeuronGraphs
        dict(key="graphs", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False,
                       compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})),
        # the MoE layers under decode graphs take their routing-independent formulation
        dict(key="qwen2_moe_graphs", scenario="greedy", model=qwen_moe_dir,
             args=dict(ENGINE, enforce_eager=False,
                       compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})),
        # multi-LoRA serving (vLLM's PyTorch-native punica ops); compilation and graphs asked
        # for, the platform runs it eagerly
        dict(key="lora", scenario="lora", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False, lora_path=lora_dir)),
        # speculative decoding with n-gram drafts (vLLM's proposer on the host, its rejection
        # sampler on neuron), compiled (vLLM turns the decode graphs off: NEURON_ATTN's hold
        # single-token decodes)
        dict(key="ngram_spec", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False, disable_log_stats=False, speculative_config={
                 "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                 "prompt_lookup_max": 3})),
        # two worker processes on neuron:0 and neuron:1, collectives over the neuron backend
        dict(key="tp2", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, tensor_parallel_size=2)),
        # sleep mode (last: attention call counters are the process's, compared across runs)
        dict(key="sleep", scenario="sleep", model=llama_dir, args=ENGINE),
        # ... and with decode graphs: replays after waking read the same addresses
        dict(key="sleep_graphs", scenario="sleep", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False,
                       compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})),
    ]
    return run_engines(runs, tmp_path_factory.mktemp("engines"))


@pytest.fixture(scope="session")
def quant_engines(llama_dir, fp8_checkpoint_dir, tmp_path_factory) -> dict:
    """The quantized engines (FP8 weights, an FP8 KV cache), in a harness of their own: with the
    others in one, the fixture's start-up outlasted a test's time limit."""
    runs = [
        # FP8 W8A8 through torch._scaled_mm (vLLM's online methods: per-tensor, per-channel and
        # 128x128-block scales; bf16 models: vLLM's FP8 methods take no fp32 model), eagerly with
        # every quantized layer checked, then compiled with and without decode graphs
        dict(key="fp8_tensor", scenario="fp8", model=llama_dir,
             args=dict(ENGINE, dtype="bfloat16", quantization="fp8_per_tensor")),
        dict(key="fp8_channel", scenario="fp8", model=llama_dir,
             args=dict(ENGINE, dtype="bfloat16", quantization="fp8_per_channel")),
        dict(key="fp8_block", scenario="fp8", model=llama_dir,
             args=dict(ENGINE, dtype="bfloat16", quantization="fp8_per_block")),
        # an FP8 KV cache (fp32 model): every attention path reads dequantized codes
        dict(key="kv_fp8", scenario="greedy", model=llama_dir, args=dict(ENGINE, kv_cache_dtype="fp8")),
        dict(key="kv_fp8_graphs", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, kv_cache_dtype="fp8", enforce_eager=False,
                       compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"})),
        dict(key="fp8_checkpoint", scenario="fp8", model=fp8_checkpoint_dir,
             args=dict(ENGINE, dtype="bfloat16", fp8_scheme="fp8_per_block")),
        dict(key="fp8_graphs", scenario="fp8", model=llama_dir,
             args=dict(ENGINE, dtype="bfloat16", quantization="fp8_per_channel", enforce_eager=False)),
        dict(key="fp8_compiled", scenario="fp8", model=llama_dir,
             args=dict(ENGINE, dtype="bfloat16", quantization="fp8_per_channel", enforce_eager=False,
                       compilation_config={"cudagraph_mode": "NONE"})),
    ]
    return run_engines(runs, tmp_path_factory.mktemp("quant-engines"))
