"""Where a vLLM decode step spends its time, per component, on one platform (in-process).

``python bench/serving_breakdown.py neuron|cpu [--runs N]``: the bench model of
``bench/serving.py`` (4-layer Llama, hidden 256, fp32), 16 prompts x 64 greedy tokens, engine
core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one thread. Wrappers around vLLM's
layer and runner classes add up the CPU time of this thread (``time.thread_time``, inclusive:
nested components are also counted in their parents) and print it per decode step. CPU time,
not wall time, so that a shared machine inflates both platforms alike; run the two platforms
side by side (one per core) and compare columns. Needs ``make vllm``.
"""
import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "serving"))
_ap = argparse.ArgumentParser()
_ap.add_argument("platform", choices=["neuron", "cpu"])
_ap.add_argument("--runs", type=int, default=5)
ARGS = _ap.parse_args()
plat = ARGS.platform
os.environ.update(HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING", VLLM_NO_USAGE_STATS="1",
                  TORCHNEURON_DEVICE_MEMORY="2GiB", VLLM_CPU_KVCACHE_SPACE="1",
                  OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="nobind",
                  VLLM_ENABLE_V1_MULTIPROCESSING="0")
if plat == "cpu":
    os.environ["VLLM_PLUGINS"] = ""
ACC = {}
def wrap(cls, name, label):
    f = getattr(cls, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.thread_time_ns()
        try:
            return f(*a, **k)
        finally:
            e = ACC.setdefault(label, [0, 0]); e[0] += time.thread_time_ns() - t; e[1] += 1
    setattr(cls, name, g)
if __name__ == "__main__":
    import tiny_models
    from tiny_models import CORPUS
    d = tempfile.mkdtemp(prefix="serving-breakdown-")
    tiny_models.build_llama(d, layers=4, hidden=256)
    from vllm import LLM, SamplingParams
    from vllm.model_executor.layers import linear, layernorm, activation
    from vllm.model_executor.layers.attention import attention as attn
    from vllm.model_executor.layers.rotary_embedding import base as rope
    from vllm.model_executor.models import llama
    from vllm.v1.worker import gpu_model_runner as gmr
    from vllm.v1.sample import sampler
    from vllm.v1.core.sched import scheduler
    import torch
    wrap(linear.UnquantizedLinearMethod, "apply", "linear")
    wrap(attn.Attention, "forward", "attention layer")
    wrap(layernorm.RMSNorm, "forward", "rmsnorm")
    wrap(rope.RotaryEmbedding, "forward", "rotary")
    wrap(activation.SiluAndMul, "forward", "silu_and_mul")
    wrap(llama.LlamaModel, "forward", "model forward")
    wrap(llama.LlamaForCausalLM, "compute_logits", "logits")
    wrap(gmr.GPUModelRunner, "execute_model", "runner.execute_model")
    wrap(gmr.GPUModelRunner, "sample_tokens", "runner.sample_tokens")
    wrap(gmr.GPUModelRunner, "_prepare_inputs", "runner._prepare_inputs")
    wrap(gmr.GPUModelRunner, "_build_attention_metadata", "runner._build_attention_metadata")
    wrap(gmr.GPUModelRunner, "_update_states", "runner._update_states")
    wrap(sampler.Sampler, "forward", "sampler")
    wrap(scheduler.Scheduler, "schedule", "scheduler.schedule")
    wrap(scheduler.Scheduler, "update_from_output", "scheduler.update")
    llm = LLM(model=d, dtype="float32", max_model_len=512, max_num_seqs=16, enforce_eager=True,
              enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0)
    impl = type(llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.model.layers[0].self_attn.attn.impl)
    wrap(impl, "forward", "attn impl.forward")
    if hasattr(impl, "do_kv_cache_update"):
        wrap(impl, "do_kv_cache_update", "attn impl.kv_update")
    prompts = [" ".join(CORPUS[i % 8: i % 8 + 1 + i % 3]) for i in range(16)]
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate(prompts, sp, use_tqdm=False)
    ACC.clear()
    N = ARGS.runs
    ws, cs = [], []
    for _ in range(N):
        t = time.perf_counter(); c = time.thread_time()
        llm.generate(prompts, sp, use_tqdm=False)
        ws.append(time.perf_counter() - t); cs.append(time.thread_time() - c)
    steps = 64 * N
    print(f"{plat}: generate wall {statistics.median(ws)*1e3:.0f} ms, cpu {statistics.median(cs)*1e3:.0f} ms; per step cpu {sum(cs)/steps*1e3:.2f} ms")
    for k, (ns, n) in sorted(ACC.items(), key=lambda kv: -kv[1][0]):
        print(f"  {k:34s} {ns/steps/1e3:8.1f} us/step  ({n/steps:.1f} calls/step)")
