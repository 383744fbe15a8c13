"""vLLM serving: neuron platform vs vLLM's own CPU platform, same tiny model, interleaved.

Two engines (``vllm.LLM``, fp32, prefix caching off) run in their own processes side by side:
one on the ``neuron`` platform (torchneuron's plugin), one on vLLM's CPU platform
(``VLLM_PLUGINS=""`` keeps the plugin out); per mode: both eager (``enforce_eager=True``), neuron's
decode graphs over eager model code against CPU eager (``graphs``), both compiled (neuron: with
decode graphs). Each round asks both, alternating which goes first:

* throughput: 16 prompts of different lengths, 64 generated tokens each -> output tokens/s;
* TTFT: one 191-token prompt, one output token, three times -> median latency.

Printed: medians and ranges over the rounds, and neuron/CPU ratios (target: throughput
>= 0.9 x CPU). Then the modelled trn2 decode latency per token of the same model (batch 1):
attention through the NKI performance model (``attention_cte`` with the cached context as
prefix KV), the linear layers at the HBM roofline of one logical NeuronCore (platform table).

``python bench/serving.py [--rounds N] [--quick]``. Needs ``make vllm``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "serving"))

NUM_PROMPTS, OUT_TOKENS = 16, 64
LAYERS, HIDDEN = 4, 256  # the bench model: 8 query heads, 4 KV heads of 32


def engine_main(platform: str, mode: str, model: str) -> None:
    """One engine process: 'tput' / 'ttft' commands on stdin, JSON results on stdout."""
    from tiny_models import CORPUS
    from vllm import LLM, SamplingParams

    kwargs = dict(enforce_eager=mode == "eager")
    if mode == "graphs":  # eager model code, decode steps replayed from graphs (neuron only)
        kwargs = (dict(enforce_eager=False, compilation_config={
            "mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}) if platform == "neuron"
            else dict(enforce_eager=True))
    llm = LLM(model=model, dtype="float32", max_model_len=512, max_num_seqs=NUM_PROMPTS,
              enable_prefix_caching=False, gpu_memory_utilization=0.5, seed=0, **kwargs)
    prompts = [" ".join(CORPUS[i % 8: i % 8 + 1 + i % 3]) for i in range(NUM_PROMPTS)]
    long = " ".join(CORPUS[:8])
    tput = SamplingParams(temperature=0.0, max_tokens=OUT_TOKENS, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate(prompts, tput, use_tqdm=False)  # warm-up
    llm.generate([long], first, use_tqdm=False)
    print(json.dumps({"ready": platform}), flush=True)
    for cmd in sys.stdin:
        cmd = cmd.strip()
        if cmd == "tput":
            t = time.perf_counter()
            outs = llm.generate(prompts, tput, use_tqdm=False)
            dt = time.perf_counter() - t
            n = sum(len(o.outputs[0].token_ids) for o in outs)
            print(json.dumps({"tokens_per_s": n / dt}), flush=True)
        elif cmd == "ttft":
            lat = []
            for _ in range(3):
                t = time.perf_counter()
                llm.generate([long], first, use_tqdm=False)
                lat.append(time.perf_counter() - t)
            print(json.dumps({"ttft_ms": statistics.median(lat) * 1e3}), flush=True)
        else:
            break
    llm.llm_engine.engine_core.shutdown()


class Engine:
    def __init__(self, platform: str, mode: str, model: str):
        # one host thread of compute each (vLLM's own serving policy for device workers; its
        # CPU thread binding off): on a shared machine a spinning second OpenMP thread costs
        # either side milliseconds per op, which would measure the scheduler, not the platform
        env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_LOGGING_LEVEL="WARNING",
                   VLLM_NO_USAGE_STATS="1", TORCHNEURON_DEVICE_MEMORY="2GiB",
                   VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="1",
                   VLLM_CPU_OMP_THREADS_BIND="nobind",
                   PYTHONPATH=os.path.join(ROOT, "tests", "serving"))
        env.pop("VLLM_TARGET_DEVICE", None)
        if platform == "cpu":
            env["VLLM_PLUGINS"] = ""  # no out-of-tree platform: vLLM picks its CPU platform
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine", platform, mode, model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env)
        self.platform = platform
        assert self._read().get("ready") == platform, f"{platform} engine did not start"

    def _read(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"{self.platform} engine exited ({self.proc.wait()})")
            if line.startswith("{"):
                return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(timeout=120)


def _fmt(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}]"


def modelled_trn2_decode(context: int = 256) -> str:
    """trn2 decode latency per token (batch 1): NKI-modelled attention + linear layers at the
    HBM roofline of one logical NeuronCore."""
    import numpy as np

    import torchneuron.nki as nki
    from torchneuron.nkilib.attention import attention_cte
    from torchneuron.platform import get_platform, topology

    plat, lnc = get_platform("trn2"), topology().lnc
    heads, kv_heads, d, inter, vocab = HIDDEN // 32, HIDDEN // 64, 32, 2 * HIDDEN, 384
    z = lambda *s: np.zeros(s, np.float32)  # noqa: E731
    r = nki.benchmark(attention_cte, platform="trn2", numerics=False)[lnc](
        z(heads, 1, d), z(kv_heads, 1, d), z(kv_heads, 1, d), scale=d ** -0.5, causal_mask=True,
        k_prior=z(kv_heads, context - 1, d), v_prior=z(kv_heads, context - 1, d),
        prior_used_len=context - 1, tp_q=True, tp_k=True)
    attn_us = r.latency_us
    per_layer_weights = 4 * (HIDDEN * (heads + 2 * kv_heads) * d + heads * d * HIDDEN
                             + 3 * HIDDEN * inter)
    head_weights = 4 * (vocab * HIDDEN + HIDDEN)
    bw = plat.hbm_bandwidth_per_chip / plat.physical_cores_per_chip * lnc
    linear_us = (LAYERS * per_layer_weights + head_weights) / bw * 1e6
    total = LAYERS * attn_us + linear_us
    return (f"modelled trn2 decode latency per token (batch 1, context {context}, LNC={lnc}): "
            f"{total:.2f} us = {LAYERS} x {attn_us:.2f} us attention (NKI perf model, "
            f"attention_cte with prefix KV) + {linear_us:.2f} us weights at the HBM roofline "
            f"({bw / 1e9:.0f} GB/s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--mode", choices=["eager", "graphs", "compiled", "all"], default="all",
                    help="enforce_eager=True; neuron's decode graphs over eager model code "
                         "against CPU eager; each platform's default compilation (neuron: "
                         "with decode graphs); or all three")
    ap.add_argument("--engine", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine_main(*args.engine)
        return
    import tiny_models

    rounds = 2 if args.quick else args.rounds
    modes = ["eager", "graphs", "compiled"] if args.mode == "all" else [args.mode]
    with tempfile.TemporaryDirectory() as d:
        tiny_models.build_llama(d, layers=LAYERS, hidden=HIDDEN)
        for mode in modes:
            run_mode(mode, d, rounds)
    print(modelled_trn2_decode(), flush=True)


def run_mode(mode: str, model: str, rounds: int) -> None:
    t = time.perf_counter()
    engines = {"neuron": Engine("neuron", mode, model), "cpu": Engine("cpu", mode, model)}
    compiled = {"compiled": "neuron: the `neuron` torch.compile backend and decode graphs, "
                            "cpu: vLLM's Inductor",
                "graphs": "neuron: eager model code, decode graphs (FULL_DECODE_ONLY); "
                          "cpu: enforce_eager=True",
                "eager": "enforce_eager=True"}[mode]
    print(f"\n# vLLM serving bench, {mode} ({compiled}): {LAYERS}-layer Llama, hidden "
          f"{HIDDEN}, fp32; {NUM_PROMPTS} prompts x {OUT_TOKENS} tokens; {rounds} rounds "
          f"(engines ready in {time.perf_counter() - t:.0f} s; load "
          f"{os.getloadavg()[0]:.1f})", flush=True)
    res = {p: {"tokens_per_s": [], "ttft_ms": []} for p in engines}
    ratios = {"tokens_per_s": [], "ttft_ms": []}
    for r in range(rounds):
        order = ["neuron", "cpu"] if r % 2 == 0 else ["cpu", "neuron"]
        for metric, cmd in (("tokens_per_s", "tput"), ("ttft_ms", "ttft")):
            got = {p: engines[p].ask(cmd)[metric] for p in order}
            for p in engines:
                res[p][metric].append(got[p])
            ratios[metric].append(got["neuron"] / got["cpu"])
    for e in engines.values():
        e.close()
    print("| metric | neuron | cpu | neuron / cpu |")
    print("|---|---|---|---|")
    for metric, label in (("tokens_per_s", "throughput (output tokens/s)"),
                          ("ttft_ms", "TTFT, 191-token prompt (ms)")):
        rr = ratios[metric]
        print(f"| {label} | {_fmt(res['neuron'][metric])} | {_fmt(res['cpu'][metric])} | "
              f"{statistics.median(rr):.2f} [{min(rr):.2f}-{max(rr):.2f}] |")
    print("(median [min-max] over rounds; throughput target: neuron/cpu >= 0.90; TTFT: lower "
          "is better, so a ratio < 1 favours neuron)", flush=True)


if __name__ == "__main__":
    main()
