"""Hugging Face training steps on neuron, synchronous kernels against the execution engine, each
as a ratio to CPU eager measured in the same run (interleaved rounds).

Tiny configs built locally (2 layers, hidden 128; nothing downloaded), fp32, AdamW (foreach),
4 x 64 tokens. "sync": every kernel at its op (the engine off, as `NEURON_LAUNCH_BLOCKING=1`);
"engine": asynchronous execution (the default; Adaptive Eager off). The measurement behind
turning the engine on by default (docs/benchmarks.md, twenty-second session). Reported, no target.

Usage: python bench/hf_steps.py [llama,gpt2,mixtral,t5]
"""

from __future__ import annotations

import os
import sys

import torch
import transformers

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, ratios  # noqa: E402

engine = torch.neuron.engine


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=256, max_position_embeddings=128)
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, **common))
    if kind == "mixtral":
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common))
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=256, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4, dropout_rate=0.0,
            decoder_start_token_id=0))
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=256, n_embd=128, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0, embd_pdrop=0,
            attn_pdrop=0))
    raise ValueError(f"unknown model {kind!r}: llama, gpt2, mixtral or t5")


def step_fn(kind: str, device: str):
    model = build(kind).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(0)).to(device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


def measure(kind: str, rounds: int = 7, inner: int = 5) -> dict:
    import time

    fns = {"cpu": step_fn(kind, "cpu"), "sync": step_fn(kind, "neuron"), "engine": step_fn(kind, "neuron")}
    samples = {m: [] for m in fns}
    for r in range(rounds):
        for mode, fn in fns.items():
            engine.set_enabled(mode == "engine")
            for _ in range(2 if r == 0 else 1):  # warm-up (the first round also builds state)
                fn()
            torch.neuron.synchronize()
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            torch.neuron.synchronize()
            samples[mode].append((time.perf_counter() - start) / inner)
    return samples


def main() -> None:
    kinds = sys.argv[1].split(",") if len(sys.argv) > 1 else ["llama", "gpt2", "mixtral", "t5"]
    was = engine.is_enabled()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
          "median [min-max] over 7 interleaved rounds of 5 steps")
    print(f"{'step':<10}{'cpu':>24}{'sync / cpu':>20}{'engine / cpu':>20}")
    try:
        for kind in kinds:
            t = measure(kind)
            print(f"{kind:<10}{fmt(t['cpu']):>24}{fmt_ratio(ratios(t['sync'], t['cpu'])):>20}"
                  f"{fmt_ratio(ratios(t['engine'], t['cpu'])):>20}")
    finally:
        engine.set_enabled(was)


if __name__ == "__main__":
    main()
