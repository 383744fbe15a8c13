"""Helpers of the vLLM serving tests (engine settings, the harness runner, HF comparisons).

A module of its own, not conftest.py: ``from conftest import ...`` would resolve to whichever
conftest.py is first on sys.path when several test directories are collected together."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support import vllm_cache_root

HERE = os.path.dirname(os.path.abspath(__file__))

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


# A harness process's time limit. Its ~17 engines take 2-4 minutes on a quiet 2-core host and
# twice that on a busy one; the tests that wait for it get this plus a margin (conftest.py).
HARNESS_TIMEOUT = 900


def run_engines(runs: list[dict], tmp_path, timeout: int = HARNESS_TIMEOUT) -> dict:
    """Run harness scenarios (engines one after the other) in one fresh process.

    ``runs``: ``{"key", "scenario", "model", "args", "env"}`` each; returns ``{key: result}``.
    A run that raised carries ``harness_error`` (checked by :func:`result_of`)."""
    env = serving_env(VLLM_CACHE_ROOT=vllm_cache_root(tmp_path), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "vllm_harness.py"),
                               json.dumps(runs)], env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=str(tmp_path))
    except subprocess.TimeoutExpired as e:
        # the harness prints "harness: KEY SECONDS" after each engine: name the one it was in
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
        done = [ln for ln in err.splitlines() if ln.startswith("harness: ")]
        raise AssertionError(f"the vLLM harness outlasted {timeout} s; engines finished: {done}; "
                             f"its stderr ends:\n{err[-4000:]}") from None
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


# fp32 on both sides; different summation orders (SDPA vs HF's eager attention, paged gathers)
LOGPROB_ATOL = 1e-4


def assert_matches_hf(run: dict, hf: dict, keys=("greedy", "long", "prefix"), atol: float = LOGPROB_ATOL) -> None:
    """Same greedy tokens as HF, and the same log-probabilities for them (fp32)."""
    import numpy as np

    for key in keys:
        assert run[key] == hf[key], key
        got, want = np.array(run[key + "_logprobs"]), np.array(hf[key + "_logprobs"])
        np.testing.assert_allclose(got, want, rtol=0, atol=atol, err_msg=key)
