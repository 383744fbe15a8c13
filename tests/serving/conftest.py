"""Fixtures of the vLLM serving tests: tiny models built offline, the HF oracle, the harness."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import tiny_models  # noqa: E402
from vllm_harness import MAX_TOKENS, PREFIX_SUFFIX, PROMPTS, long_prompt  # noqa: E402

# Every engine of these tests: fp32 (exact comparison with HF), a small emulated device, a
# small step budget so that the 191-token prompt is prefilled in chunks.
ENGINE = dict(dtype="float32", max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64,
              gpu_memory_utilization=0.5, seed=0, enforce_eager=True)
DEVICE_MEMORY = "1GiB"


def serving_env(**extra: str) -> dict:
    """Environment of a vLLM process in these tests: offline, small device, fresh caches."""
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               TORCHNEURON_DEVICE_MEMORY=DEVICE_MEMORY, VLLM_LOGGING_LEVEL="WARNING",
               TOKENIZERS_PARALLELISM="false")
    env.pop("VLLM_TARGET_DEVICE", None)  # would skip out-of-tree platform plugins
    env.pop("TORCHNEURON_NKI_SDPA", None)
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_engines(runs: list[dict], tmp_path, timeout: int = 420) -> dict:
    """Run harness scenarios (engines one after the other) in one fresh process.

    ``runs``: ``{"key", "scenario", "model", "args", "env"}`` each; returns ``{key: result}``.
    A run that raised carries ``harness_error`` (checked by :func:`result_of`)."""
    env = serving_env(VLLM_CACHE_ROOT=str(tmp_path / "vllm-cache"),
                      VLLM_ENABLE_V1_MULTIPROCESSING="0")
    proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_harness.py"),
                           json.dumps(runs)], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=str(tmp_path))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HARNESS_RESULT ")]
    assert lines, f"harness printed no result (exit {proc.returncode}):\n{proc.stderr[-6000:]}"
    results = json.loads(lines[-1][len("HARNESS_RESULT "):])
    for r in results.values():
        r["_stderr"] = proc.stderr[-4000:]
    return results


def result_of(results: dict, key: str) -> dict:
    """One run's result; fails the calling test with the run's traceback if it raised."""
    r = results[key]
    assert "harness_error" not in r, r["harness_error"] + r["_stderr"]
    return r


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return tiny_models.build_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def qwen_moe_dir(tmp_path_factory) -> str:
    return tiny_models.build_qwen2_moe(str(tmp_path_factory.mktemp("tiny-qwen2-moe")))


def _oracle(path: str) -> dict:
    long = long_prompt()
    ids, lps = tiny_models.hf_greedy(path, PROMPTS + [long, long + PREFIX_SUFFIX], MAX_TOKENS,
                                     with_logprobs=True)
    n = len(PROMPTS)
    return {"greedy": ids[:n], "long": ids[n], "prefix": ids[n + 1],
            "greedy_logprobs": lps[:n], "long_logprobs": lps[n], "prefix_logprobs": lps[n + 1]}


# fp32 on both sides; different summation orders (SDPA vs HF's eager attention, paged gathers)
LOGPROB_ATOL = 1e-4


def assert_matches_hf(run: dict, hf: dict, keys=("greedy", "long", "prefix")) -> None:
    """Same greedy tokens as HF, and the same log-probabilities for them (fp32)."""
    import numpy as np

    for key in keys:
        assert run[key] == hf[key], key
        got, want = np.array(run[key + "_logprobs"]), np.array(hf[key + "_logprobs"])
        np.testing.assert_allclose(got, want, rtol=0, atol=LOGPROB_ATOL, err_msg=key)


@pytest.fixture(scope="session")
def llama_hf(llama_dir) -> dict:
    """Hugging Face greedy tokens on CPU in fp32: the oracle."""
    return _oracle(llama_dir)


@pytest.fixture(scope="session")
def qwen_moe_hf(qwen_moe_dir) -> dict:
    return _oracle(qwen_moe_dir)


@pytest.fixture(scope="session")
def engines(llama_dir, qwen_moe_dir, tmp_path_factory) -> dict:
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
        dict(key="cpu_attn", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, attention_backend="CPU_ATTN")),
        dict(key="nki", scenario="greedy", model=llama_dir, args=ENGINE,
             env={"TORCHNEURON_NKI_SDPA": "1"}),
        dict(key="qwen2_moe", scenario="greedy", model=qwen_moe_dir, args=ENGINE),
        dict(key="compiled", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, enforce_eager=False)),
        # two worker processes on neuron:0 and neuron:1, collectives over the neuron backend
        dict(key="tp2", scenario="greedy", model=llama_dir,
             args=dict(ENGINE, tensor_parallel_size=2)),
    ]
    return run_engines(runs, tmp_path_factory.mktemp("engines"))
