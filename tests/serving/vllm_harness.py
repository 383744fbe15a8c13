"""Runs vLLM engines on neuron in a fresh process and prints what the tests check as JSON.

``python vllm_harness.py JSON_RUNS``: a list of ``{"key", "scenario", "model", "args", "env"}``;
the engines start one after the other in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
the engine core and, for TP=1, the worker run here; vLLM's distributed state is torn down
between engines), so vLLM and torch are imported once and the harness can look at the
worker's state: parameter and KV-cache devices, memory figures, the attention paths taken,
the compile counters. ``env`` entries are set for one engine (e.g. TORCHNEURON_NKI_SDPA, read
when the attention layers are built). The tests compare the outputs with Hugging Face on CPU
(the oracle); nothing is judged here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

PROMPTS = ["Hello, my name is", "The neuron device runs PyTorch on Trainium and", "A tiny model"]
MAX_TOKENS = 16


def long_prompt() -> str:
    from tiny_models import CORPUS

    return " ".join(CORPUS[:8])  # 191 tokens: several 32-token blocks, > max_num_batched_tokens


PREFIX_SUFFIX = " Prefix caching reuses keys."


def _greedy(max_tokens: int = MAX_TOKENS):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _worker_state(worker) -> dict:
    """Runs inside the worker (collective_rpc): what the model and the KV cache sit on."""
    import torch

    runner = worker.model_runner
    model = runner.get_model()
    attn = {type(layer.impl).__name__
            for layer in runner.compilation_config.static_forward_context.values()
            if hasattr(layer, "impl")}
    kv = runner.kv_caches
    props = torch.neuron.get_device_properties(worker.device)
    import torch.distributed as dist
    from vllm.distributed.parallel_state import get_tp_group

    return {
        "tp_backend": dist.get_backend(get_tp_group().device_group),
        "tp_communicator": type(get_tp_group().device_communicator).__name__,
        "worker_device": str(worker.device),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "kv_devices": sorted({str(t.device) for t in kv}),
        "kv_bytes": int(sum(t.untyped_storage().nbytes() for t in
                            {id(t.untyped_storage()): t for t in kv}.values())),
        "attention_impls": sorted(attn),
        "device_total_memory": int(props.total_memory),
        "device_allocated": int(torch.neuron.memory_allocated(worker.device)),
        "weights_bytes": int(sum(p.numel() * p.element_size() for p in model.parameters())),
    }


def _shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def scenario_llm(model: str, engine_args: dict) -> dict:
    """Greedy batch, seeded sampling, chunked prefill, prefix caching, an oversized request."""
    import torch

    accel_sync, accel_empty = torch.accelerator.synchronize, torch.accelerator.empty_cache
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, **engine_args)
    res: dict = {}
    res["greedy"] = _ids(llm.generate(PROMPTS, _greedy()))
    res["greedy_single"] = [_ids(llm.generate([p], _greedy()))[0] for p in PROMPTS[:2]]

    def sample(seed):
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=seed,
                            ignore_eos=True)
        # the seeded request shares its batch with an unseeded one each time
        other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return _ids(llm.generate([PROMPTS[0], PROMPTS[1]], [sp, other]))[0]

    res["seeded"] = [sample(1234), sample(1234), sample(4321)]

    from torchneuron.vllm import attention

    before = attention.calls()
    long = long_prompt()
    out = llm.generate([long], _greedy())[0]
    res["long"] = list(out.outputs[0].token_ids)
    out = llm.generate([long + PREFIX_SUFFIX], _greedy())[0]
    res["prefix"] = list(out.outputs[0].token_ids)
    res["prefix_cached_tokens"] = out.num_cached_tokens
    after = attention.calls()
    res["attention_calls_long"] = {k: after[k] - before[k] for k in after}

    try:
        llm.generate(["word " * 400], _greedy())
        res["too_long_error"] = None
    except Exception as e:  # noqa: BLE001  (reported to the test, which checks type and text)
        res["too_long_error"] = f"{type(e).__name__}: {e}"

    res.update(llm.collective_rpc(_worker_state)[0])
    cfg = llm.llm_engine.vllm_config
    res["num_gpu_blocks"] = cfg.cache_config.num_gpu_blocks
    res["block_size"] = cfg.cache_config.block_size
    res["gpu_memory_utilization"] = cfg.cache_config.gpu_memory_utilization
    res["accelerator_untouched"] = (torch.accelerator.synchronize is accel_sync
                                    and torch.accelerator.empty_cache is accel_empty)
    res["platform"] = type(__import__("vllm.platforms", fromlist=["x"]).current_platform).__name__
    res["attention_calls"] = attention.calls()
    res["compile_metrics"] = torch.neuron.get_dynamo_metrics()
    _shutdown(llm)
    return res


def scenario_greedy(model: str, engine_args: dict) -> dict:
    """Greedy batch and a long prompt only (other backends, compiled mode, TP)."""
    from vllm import LLM

    llm = LLM(model=model, **engine_args)
    res = {"greedy": _ids(llm.generate(PROMPTS, _greedy()))}
    long = long_prompt()
    res["long"] = _ids(llm.generate([long], _greedy()))[0]
    out = llm.generate([long + PREFIX_SUFFIX], _greedy())[0]
    res["prefix"] = list(out.outputs[0].token_ids)
    res["prefix_cached_tokens"] = out.num_cached_tokens
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        import torch

        from torchneuron.vllm import attention

        states = llm.collective_rpc(_worker_state)
        res.update(states[0])
        res["rank_devices"] = [st["worker_device"] for st in states]
        res["rank_param_devices"] = [st["param_devices"] for st in states]
        res["rank_tp_backends"] = [st["tp_backend"] for st in states]
        res["attention_calls"] = attention.calls()
        res["compile_metrics"] = torch.neuron.get_dynamo_metrics()
    _shutdown(llm)
    return res


def scenario_init_error(model: str, engine_args: dict) -> dict:
    """Engine start that is expected to fail: the exception's type and text."""
    from vllm import LLM

    try:
        LLM(model=model, **engine_args)
    except Exception as e:  # noqa: BLE001  (reported to the test)
        return {"error": f"{type(e).__name__}: {e}"}
    return {"error": None}


SCENARIOS = {"llm": scenario_llm, "greedy": scenario_greedy, "init_error": scenario_init_error}

def _cleanup() -> None:
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    cleanup_dist_env_and_memory()


def main(runs: list[dict]) -> dict:
    results = {}
    for run in runs:
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        t0 = time.perf_counter()
        try:
            results[run["key"]] = SCENARIOS[run["scenario"]](run["model"], run.get("args", {}))
            results[run["key"]]["seconds"] = round(time.perf_counter() - t0, 2)
        except Exception:  # noqa: BLE001  (the test prints it)
            results[run["key"]] = {"harness_error": traceback.format_exc()}
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _cleanup()
    return results


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    print("HARNESS_RESULT " + json.dumps(out), flush=True)
