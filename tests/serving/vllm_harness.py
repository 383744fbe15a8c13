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

    # logprobs=1: the chosen token's log-probability comes back with each token
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1)


def _ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def _logprobs(outputs) -> list[list[float]]:
    """Log-probability of each generated token (raw model logits, as HF's)."""
    return [[step[t].logprob for t, step in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
            for o in outputs]


def _greedy_runs(llm, res: dict) -> None:
    """The greedy checks every engine does: a batch of prompts of different lengths, a
    191-token prompt (prefilled in chunks), then the same prompt extended (a prefix-cache hit)."""
    outs = llm.generate(PROMPTS, _greedy())
    res["greedy"], res["greedy_logprobs"] = _ids(outs), _logprobs(outs)
    long = long_prompt()
    outs = llm.generate([long], _greedy())
    res["long"], res["long_logprobs"] = _ids(outs)[0], _logprobs(outs)[0]
    outs = llm.generate([long + PREFIX_SUFFIX], _greedy())
    res["prefix"], res["prefix_logprobs"] = _ids(outs)[0], _logprobs(outs)[0]
    res["prefix_cached_tokens"] = outs[0].num_cached_tokens


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
    from torchneuron.vllm import attention

    before = attention.calls()
    _greedy_runs(llm, res)
    after = attention.calls()
    res["attention_calls_greedy"] = {k: after[k] - before[k] for k in after}
    res["greedy_single"] = [_ids(llm.generate([p], _greedy()))[0] for p in PROMPTS[:2]]

    def sample(seed):
        sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=MAX_TOKENS, seed=seed,
                            ignore_eos=True)
        # the seeded request shares its batch with an unseeded one each time
        other = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        return _ids(llm.generate([PROMPTS[0], PROMPTS[1]], [sp, other]))[0]

    res["seeded"] = [sample(1234), sample(1234), sample(4321)]

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
    res["neuron_kernels"] = _neuron_kernels()
    _shutdown(llm)
    return res


def _neuron_kernels() -> dict:
    """Calls of torchneuron's own vLLM kernels (``torchneuron::*``) in this process so far."""
    import torchneuron

    return {k: v for k, v in torchneuron.get_executed_ops().items() if k.startswith("torchneuron::")}


def scenario_greedy(model: str, engine_args: dict) -> dict:
    """The greedy checks and the worker's state (other backends, compiled mode, TP)."""
    from vllm import LLM

    llm = LLM(model=model, **engine_args)
    res: dict = {}
    _greedy_runs(llm, res)
    if engine_args.get("speculative_config"):  # (needs disable_log_stats=False)
        res["spec_decode"] = {m.name.removeprefix("vllm:spec_decode_"): m.value for m in llm.get_metrics()
                              if m.name.startswith("vllm:spec_decode_num") and hasattr(m, "value")}
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        from torchneuron.vllm import attention

        states = llm.collective_rpc(_worker_state)
        res.update(states[0])
        res["rank_devices"] = [st["worker_device"] for st in states]
        res["rank_param_devices"] = [st["param_devices"] for st in states]
        res["rank_tp_backends"] = [st["tp_backend"] for st in states]
        res["attention_calls"] = attention.calls()
        res["neuron_kernels"] = _neuron_kernels()
    res["num_gpu_blocks"] = llm.llm_engine.vllm_config.cache_config.num_gpu_blocks
    _shutdown(llm)
    return res


def scenario_lora(model: str, engine_args: dict) -> dict:
    """Multi-LoRA serving: the prompts through the adapter (``engine_args["lora_path"]``),
    without it, and mixed in one batch; the compilation and graph modes the platform chose."""
    from vllm import LLM
    from vllm.lora.request import LoRARequest

    args = dict(engine_args)
    adapter = LoRARequest("adapter", 1, args.pop("lora_path"))
    llm = LLM(model=model, enable_lora=True, max_lora_rank=8, max_loras=2, **args)
    res = {"lora": _ids(llm.generate(PROMPTS, _greedy(), lora_request=adapter)),
           "base": _ids(llm.generate(PROMPTS, _greedy())),
           "mixed": _ids(llm.generate(PROMPTS, _greedy(), lora_request=[adapter, None, adapter]))}
    cc = llm.llm_engine.vllm_config.compilation_config
    res["compilation_mode"], res["cudagraph_mode"] = cc.mode.name, cc.cudagraph_mode.name
    _shutdown(llm)
    return res


_FP8_CAPTURE: list[dict] = []


def _capture_fp8_layers(model) -> None:
    """Runs inside the worker (apply_model): a forward hook on every FP8 linear layer keeps
    its first call's input, output, weight codes and weight scale (CPU copies)."""
    import torch

    captured: dict = {}
    for name, mod in model.named_modules():
        weight = getattr(mod, "weight", None)
        scale = getattr(mod, "weight_scale_inv", None)  # block scales' name
        scale = getattr(mod, "weight_scale", None) if scale is None else scale
        if weight is None or weight.dtype != torch.float8_e4m3fn or scale is None:
            continue

        def hook(mod, inputs, output, name=name, scale=scale):
            if name not in captured:
                y = output[0] if isinstance(output, tuple) else output
                captured[name] = [t.detach().cpu().clone() for t in (inputs[0], y, mod.weight, scale)]
        mod.register_forward_hook(hook)
    _FP8_CAPTURE.append(captured)


def _fp8_layer_checks(model: str, scheme: str, captured: dict) -> dict:
    """Per captured layer: the engine's output against TensorE's FP8 matmul of its own
    operands (tiny_models.fp8_linear), and its weight codes and scale against the online
    quantization of the checkpoint's weights in the model dtype (tiny_models.fp8_weight)."""
    import torch
    from safetensors.torch import load_file

    import tiny_models

    ckpt = load_file(os.path.join(model, "model.safetensors"))
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    out = {}
    for name, (x, y, w, ws) in captured.items():
        # vLLM keeps a per-tensor or per-channel weight as [in, out] (a transposed [out, in]),
        # a block-scaled one as [out, in]
        codes = w if scheme == "fp8_per_block" else w.t()
        ref = tiny_models.fp8_linear(x, codes, ws.float(), scheme)
        # distance in units in the last place: adjacent bf16 values of one sign have adjacent
        # int16 patterns (a sign change counts as far apart unless both sides are zero)
        same_sign = (ref.float() * y.float() > 0) | ((ref == 0) & (y == 0))
        bits = (ref.view(torch.int16).int() - y.view(torch.int16).int()).abs()
        ulps = torch.where(same_sign, bits, torch.full_like(bits, 1 << 16)).max().item()
        prefix, leaf = name.rsplit(".", 1)
        keys = [f"{prefix}.{p}" for p in parts.get(leaf, (leaf,))]
        if ckpt[keys[0] + ".weight"].dtype == torch.float8_e4m3fn:  # a serialized FP8 checkpoint
            qw = torch.cat([ckpt[k + ".weight"] for k in keys])
            sw = torch.cat([ckpt[k + ".weight_scale_inv"] for k in keys])
        else:
            qw, sw = tiny_models.fp8_weight([ckpt[k + ".weight"].to(x.dtype) for k in keys], scheme)
        out[name] = {"tokens": int(x.reshape(-1, x.shape[-1]).shape[0]), "out_dtype": str(y.dtype),
                     "max_ulps": ulps,
                     "codes_equal": torch.equal(qw.view(torch.uint8), codes.contiguous().view(torch.uint8)),
                     "scales_equal": torch.equal(sw.reshape(-1), ws.float().reshape(-1))}
    return out


def scenario_fp8(model: str, engine_args: dict) -> dict:
    """An FP8 engine (``engine_args["quantization"]``, or an FP8 checkpoint whose scheme
    ``engine_args["fp8_scheme"]`` names): greedy tokens, the ``_scaled_mm`` calls made, the
    graph mode; eagerly also each quantized layer's checks (_fp8_layer_checks)."""
    from vllm import LLM

    import torchneuron

    args = dict(engine_args)
    scheme = args.pop("fp8_scheme", args.get("quantization"))  # a checkpoint's: named by the run
    llm = LLM(model=model, **args)
    eager = args.get("enforce_eager", False)
    if eager:
        llm.apply_model(_capture_fp8_layers)
    def scaled_mm_calls():  # compiled graphs call the out= overload
        ops = torchneuron.get_executed_ops()
        return ops.get("aten::_scaled_mm", 0) + ops.get("aten::_scaled_mm.out", 0)

    before = scaled_mm_calls()
    res = {"greedy": _ids(llm.generate(PROMPTS, _greedy()))}
    res["scaled_mm_calls"] = scaled_mm_calls() - before
    if eager:
        res["fp8_layers"] = _fp8_layer_checks(model, scheme, _FP8_CAPTURE[-1])
    cc = llm.llm_engine.vllm_config.compilation_config
    res["compilation_mode"], res["cudagraph_mode"] = cc.mode.name, cc.cudagraph_mode.name
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


def _free_memory(worker) -> int:
    import torch

    torch.neuron.synchronize(worker.device)
    return int(torch.neuron.mem_get_info(worker.device)[0])


def _pointers(worker) -> list:
    """Data pointers of the model's parameters and of the KV cache."""
    runner = worker.model_runner
    return ([p.data_ptr() for p in runner.get_model().parameters()]
            + [t.data_ptr() for t in runner.kv_caches])


def scenario_sleep(model: str, engine_args: dict) -> dict:
    """Sleep mode: level 1 and back, level 2 with the weights reloaded, greedy tokens each time."""
    from vllm import LLM

    llm = LLM(model=model, enable_sleep_mode=True, **engine_args)
    res: dict = {}
    greedy = lambda: _ids(llm.generate(PROMPTS[:3], _greedy()))  # noqa: E731
    res["before"] = greedy()
    res["pointers"] = llm.collective_rpc(_pointers)[0]
    awake = llm.collective_rpc(_free_memory)[0]
    llm.sleep(level=1)
    res["freed_level1"] = llm.collective_rpc(_free_memory)[0] - awake
    res["sleeping"] = llm.llm_engine.is_sleeping()
    llm.wake_up()
    res["after_level1"] = greedy()
    res["woken_free_delta"] = llm.collective_rpc(_free_memory)[0] - awake
    res["pointers_after"] = llm.collective_rpc(_pointers)[0]
    llm.sleep(level=2)
    res["freed_level2"] = llm.collective_rpc(_free_memory)[0] - awake
    llm.wake_up(tags=["weights"])
    res["weights_discarded"] = llm.collective_rpc(
        lambda w: float(sum(p.abs().sum().item() for p in w.model_runner.get_model().parameters())))[0]
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    res["after_level2"] = greedy()
    res.update(llm.collective_rpc(_worker_state)[0])
    _shutdown(llm)
    del llm
    _cleanup()
    import torch

    torch.neuron.empty_cache()
    free, total = torch.neuron.mem_get_info(0)
    res["device_used_after_shutdown"] = int(total - free)
    return res


SCENARIOS = {"llm": scenario_llm, "greedy": scenario_greedy, "lora": scenario_lora, "fp8": scenario_fp8,
             "init_error": scenario_init_error,
             "sleep": scenario_sleep}


def _freeze_heap() -> None:
    """Keep what is alive now (torch, vLLM and transformers' modules: millions of objects) out of
    the collector's sight. vLLM calls gc.collect about seven times while an engine starts, each
    then costs ~0.05 s instead of ~0.8 s. vLLM's engine core does the same after start-up and
    undoes it at shutdown (gc.unfreeze), so nothing frozen here outlives the next engine."""
    import gc

    gc.collect()
    gc.freeze()


def _cleanup() -> None:
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    gc.collect()
    # vLLM's teardown ends with gc.unfreeze() and a full collection: what survived it is frozen
    # as _freeze_heap would (without a second full collection, ~0.8 s an engine)
    cleanup_dist_env_and_memory()
    gc.freeze()


def _compile_counts() -> dict:
    """torchneuron's compile counters and vLLM's own compilation counter, flattened."""
    import dataclasses

    import torch
    from vllm.compilation.counter import compilation_counter

    out = {f"neuron.{k}": v for k, v in torch.neuron.get_dynamo_metrics().items()
           if isinstance(v, int)}
    out.update({f"vllm.{k}": v for k, v in dataclasses.asdict(compilation_counter).items()})
    return out


def _enqueued() -> int:
    """Kernels the execution engine has queued in this process so far."""
    import torch

    return torch.neuron.engine.stats()["enqueued"]


def _set_engine(value) -> bool | None:
    """Turn the execution engine on ("1") or off (other text); None leaves it. Returns the
    setting before, for the caller to restore (None: nothing was changed)."""
    if value is None:
        return None
    import torch

    was = torch.neuron.engine.is_enabled()
    torch.neuron.engine.set_enabled(value in ("1", True))
    return was


_REPLAYS = [0]


def _count_graph_replays() -> None:
    """Count NeuronGraph replays in this process (vLLM replays its decode graphs through
    ``entry.cudagraph.replay()``)."""
    import torch

    replay = torch.neuron.NeuronGraph.replay

    def counted(self, *args, **kwargs):
        _REPLAYS[0] += 1
        return replay(self, *args, **kwargs)

    torch.neuron.NeuronGraph.replay = counted


def main(runs: list[dict]) -> dict:
    import vllm.entrypoints.llm  # noqa: F401  (the engine's modules, imported before the freeze)
    from torchneuron.vllm import attention

    _count_graph_replays()
    _freeze_heap()
    results = {}
    for run in runs:
        before = _compile_counts()
        calls, replays = attention.calls(), _REPLAYS[0]
        saved = {k: os.environ.get(k) for k in run.get("env", {})}
        os.environ.update(run.get("env", {}))
        # The execution engine's variable is read when torchneuron loads: in this process it is
        # switched at run time (worker processes read the variable).
        engine_was = _set_engine(run.get("env", {}).get("TORCHNEURON_ASYNC_EXECUTION"))
        t0 = time.perf_counter()
        enqueued = _enqueued()
        try:
            results[run["key"]] = SCENARIOS[run["scenario"]](run["model"], run.get("args", {}))
            results[run["key"]]["seconds"] = round(time.perf_counter() - t0, 2)
            results[run["key"]]["engine_enqueued"] = _enqueued() - enqueued
            after = _compile_counts()
            results[run["key"]]["compile_delta"] = {k: after[k] - before[k] for k in after}
            now = attention.calls()
            results[run["key"]]["attention_delta"] = {k: now[k] - calls[k] for k in now}
            results[run["key"]]["graph_replays"] = _REPLAYS[0] - replays
        except Exception:  # noqa: BLE001  (the test prints it)
            results[run["key"]] = {"harness_error": traceback.format_exc()}
        finally:
            _set_engine(engine_was)
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
            _cleanup()
            # progress on stderr: a harness that outlasts its time limit names the engine it was in
            print(f"harness: {run['key']} {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return results


if __name__ == "__main__":
    out = main(json.loads(sys.argv[1]))
    print("HARNESS_RESULT " + json.dumps(out), flush=True)
