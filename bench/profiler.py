"""Profiler benchmark: overhead on the demo GPT step, and estimated Trainium2 steps.

1. Overhead: the demo's training step (examples/train_gpt.py: GPT of examples/gpt.py, batch 16)
   on neuron with no profiler (before any session), while torch.profiler records CPU and
   neuron activities, and with no profiler again after sessions ran (hooks gone), each as a
   ratio to the first; the CPU step is the native baseline of the same run.
2. Estimated trn2 step time and MFU of the demo GPT (from a profiled step) and of a
   1B-parameter Llama-shaped model (Llama 3.2 1B shapes, bf16, sequence 2048, forward and
   backward), captured on the meta device (torchneuron.profiler.estimate_meta: no data, the
   host assumed to keep up; attention through the math decomposition the meta device picks).

Prints medians with [min, max] over rounds.
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

ROUNDS = int(os.environ.get("BENCH_ROUNDS", "5"))
STEPS = int(os.environ.get("BENCH_STEPS", "3"))
ACTS = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.PrivateUse1]


def make(device):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (16, cfg.block_size), generator=g).to(device)

    def step():
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss
    return step


def timed(step, n):
    t = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - t) / n


def stats(xs):
    return statistics.median(xs), min(xs), max(xs)


def fmt(name, xs, unit="ms", scale=1e3):
    m, lo, hi = stats(xs)
    return f"{name:<44} {m * scale:9.2f} {unit} [{lo * scale:.2f}, {hi * scale:.2f}]"


def main() -> None:
    cpu, neu = make("cpu"), make("neuron")
    for s in (cpu, neu):
        s()
        s()
    # Position control: the same three-slot round with no profiler in any slot, before any
    # session ever ran. Its third/first ratio is what slot order alone does (allocator and cache
    # warmth, clock drift), the figure the "after / before" ratio is read against.
    ctl_first, ctl_third = [], []
    for _ in range(ROUNDS):
        ctl_first.append(timed(neu, STEPS))
        timed(neu, STEPS)
        ctl_third.append(timed(neu, STEPS))
    cpu_t, off_before, rec, off_after = [], [], [], []
    for _ in range(ROUNDS):
        cpu_t.append(timed(cpu, STEPS))
        off_before.append(timed(neu, STEPS))
        with torch.profiler.profile(activities=ACTS):
            rec.append(timed(neu, STEPS))
        off_after.append(timed(neu, STEPS))
    print(f"profiler overhead on the demo GPT step ({ROUNDS} rounds x {STEPS} steps; median [min, max])")
    print(fmt("CPU step (native baseline)", cpu_t))
    print(fmt("neuron step, no profiler", off_before))
    print(fmt("neuron step, recording CPU + neuron", rec))
    print(fmt("neuron step, no profiler after sessions", off_after))
    r_rec = [a / b for a, b in zip(rec, off_before)]
    r_off = [a / b for a, b in zip(off_after, off_before)]
    r_cpu = [a / b for a, b in zip(off_before, cpu_t)]
    print(fmt("ratio neuron/CPU, no profiler", r_cpu, "x", 1))
    print(fmt("ratio recording / no profiler (target <= 1.3)", r_rec, "x", 1))
    print(fmt("ratio no profiler after / before (target 1.0)", r_off, "x", 1))
    print(fmt("  position control: 3rd / 1st slot, never profiled", [a / b for a, b in zip(ctl_third, ctl_first)], "x", 1))

    # Estimated trn2 step of the demo GPT, from a profiled step.
    import tempfile

    from torchneuron.profiler.analysis import analyze_trace, load_trace

    with torch.profiler.profile(activities=ACTS, schedule=torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)) as p:
        for _ in range(3):
            neu()
            p.step()
    with tempfile.TemporaryDirectory() as d:
        p.export_chrome_trace(os.path.join(d, "t.json"))
        s = analyze_trace(load_trace(os.path.join(d, "t.json"))).summary
    print(f"demo GPT, estimated {s['platform']} (LNC={s['lnc']}) eager step: {s['est_step_ns'] / 1e3:.1f} us, "
          f"MFU {100 * s['est_mfu']:.2f}%, host-bound {100 * s['host_bound_fraction']:.1f}% "
          f"(measured emulator step {s['measured_step_ns'] / 1e6:.1f} ms)")

    # 1B Llama-shaped model at sequence 2048 on the meta device.
    try:
        import transformers
    except ImportError:  # pragma: no cover
        print("1B Llama estimate skipped: transformers not installed")
        return
    from torchneuron.profiler.estimate_meta import estimate_meta_step

    cfg = transformers.LlamaConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                                   num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    ids = torch.zeros(1, 2048, dtype=torch.long, device="meta")
    r = estimate_meta_step(lambda: model(input_ids=ids, labels=ids).loss.backward())
    print(f"Llama-shaped {n / 1e9:.2f}B params, bf16, seq 2048, fwd+bwd (meta shapes): estimated "
          f"{r['est_ns'] / 1e6:.1f} ms per step on one trn2 logical core (LNC=2), MFU {100 * r['mfu']:.1f}%, "
          f"MBU {100 * r['mbu']:.1f}%, {r['kernels']} kernels, {r['flops'] / 1e12:.2f} TFLOP "
          f"(6ND = {6 * n * 2048 / 1e12:.2f})")


if __name__ == "__main__":
    main()
