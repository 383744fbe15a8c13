"""torch.compile benchmark for the neuron backend (not a test; prints a table).

Compares, in one run:
  * neuron compiled (backend="neuron") vs neuron eager,
  * neuron compiled vs torch.compile(backend="inductor") on CPU,
on (a) a chain of 10 pointwise ops over 4M elements (four of them transcendental, so the fused
kernel is compute-bound; (a') is a memory-bound chain of cheap ops), (b) a training step of the small GPT from
examples/gpt.py (forward, backward, AdamW step; model and optimizer step compiled), (c)
FlexAttention causal forward+backward (CPU Inductor has no FlexAttention backward: n/a), (d) the
GPT's batch-1 forward (a decoding step's shape, host-bound), (e) a batch-1 training step with dropout,
and (b) again, compiled with
mode="reduce-overhead" (compiled graphs replayed from neuron graphs) against mode="default" and
CPU eager.

Timings: --repeat rounds after --warmup calls (compile happens in warm-up); in each round the
variants of a workload are timed once each, round-robin, so background load hits them alike.
Printed: median [min-max] per variant, and the per-round ratios' median [min-max].
Usage: python bench/compile.py [--repeat 30] [--warmup 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))

import torchneuron.compile as tnc  # noqa: E402
from _stats import fmt, fmt_ratio, ratios  # noqa: E402

tnc.register()
tnc.install_import_hooks()

NEURON = torch.device("neuron:0")


def _sync(device):
    if device.type == "neuron":
        torch.neuron.synchronize()


def timeit(fns, warmup, repeat):
    """Seconds per call of each ``{name: (fn, device)}``, one sample per round. Calls are
    interleaved round-robin so that every variant sees the same background load."""
    for fn, dev in fns.values():
        for _ in range(warmup):  # compiles
            fn()
        _sync(dev)
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, (fn, dev) in fns.items():
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            times[name].append(time.perf_counter() - t0)
    return times


# (a) pointwise chain ---------------------------------------------------------------------------

def pointwise_chain(x):
    x = x * 1.5
    x = x + 0.25
    x = torch.sin(x)
    x = x * x
    x = torch.exp(-x)
    x = x - 0.5
    x = torch.tanh(x)
    x = torch.relu(x)
    x = x * 3.0
    return torch.sigmoid(x)


def pointwise_chain_arith(x):
    """Memory-bound variant: nine cheap arithmetic/clamp ops and one tanh."""
    x = x * 1.5
    x = x + 0.25
    x = torch.relu(x)
    x = x * x
    x = x - 0.5
    x = torch.abs(x)
    x = torch.clamp(x, max=3.0)
    x = x * 2.0
    x = torch.tanh(x)
    return x + 1.0


def bench_pointwise(args, chain=pointwise_chain):
    pointwise_chain = chain
    n = 4 * 1024 * 1024
    x_cpu = torch.randn(n)
    x_dev = x_cpu.to(NEURON)
    eager = lambda: pointwise_chain(x_dev)
    comp_dev = torch.compile(pointwise_chain, backend="neuron")
    comp_cpu = torch.compile(pointwise_chain, backend="inductor")
    torch.testing.assert_close(comp_dev(x_dev).cpu(), pointwise_chain(x_cpu), atol=1e-5, rtol=1e-5)
    return timeit({"neuron eager": (eager, NEURON),
                   "neuron compiled": (lambda: comp_dev(x_dev), NEURON),
                   "cpu inductor": (lambda: comp_cpu(x_cpu), torch.device("cpu"))},
                  args.warmup, args.repeat)


# (b) GPT training step -------------------------------------------------------------------------

def _gpt_step_fn(device, compiled, backend, mode=None, batch=16, dropout=0.0):
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=dropout)
    model = GPT(cfg).to(device)
    # the step counts on the device, so that a replayed optimizer step advances them (as on CUDA)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=mode is not None)
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
    tgt = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g).to(device)
    fwd = torch.compile(model, backend=backend, mode=mode) if compiled else model
    opt_step = torch.compile(opt.step, backend=backend, mode=mode) if compiled else opt.step

    def step():
        opt.zero_grad(set_to_none=True)
        _, loss = fwd(idx, tgt)
        loss.backward()
        opt_step()
        return loss

    return step


def bench_gpt(args):
    cpu = torch.device("cpu")
    return timeit({"neuron eager": (_gpt_step_fn(NEURON, False, None), NEURON),
                   "neuron compiled": (_gpt_step_fn(NEURON, True, "neuron"), NEURON),
                   "cpu inductor": (_gpt_step_fn(cpu, True, "inductor"), cpu)},
                  args.warmup, args.repeat)


def bench_gpt_replay(args):
    """(b) with mode="reduce-overhead" against the default mode (both with a capturable AdamW)
    and CPU eager."""
    torch._dynamo.reset()
    return timeit({"neuron default": (_gpt_step_fn(NEURON, True, "neuron", "default"), NEURON),
                   "neuron reduce-overhead": (_gpt_step_fn(NEURON, True, "neuron", "reduce-overhead"), NEURON),
                   "cpu eager": (_gpt_step_fn(torch.device("cpu"), False, None), torch.device("cpu"))},
                  args.warmup, args.repeat)


def bench_gpt_dropout_replay(args):
    """(e) a host-bound training step with dropout (batch 1): random numbers are recorded too, so
    reduce-overhead replays the whole step (before, the dropout graphs could not be recorded)."""
    torch._dynamo.reset()
    cpu = torch.device("cpu")
    return timeit({"neuron default": (_gpt_step_fn(NEURON, True, "neuron", "default", 1, 0.1), NEURON),
                   "neuron reduce-overhead": (_gpt_step_fn(NEURON, True, "neuron", "reduce-overhead", 1, 0.1),
                                              NEURON),
                   "cpu eager": (_gpt_step_fn(cpu, False, None, None, 1, 0.1), cpu)},
                  args.warmup, args.repeat)


def bench_gpt_decode(args):
    """(d) the GPT's forward on one 16-token sequence (no grad): eager, compiled, replayed."""
    from gpt import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128)
    base = GPT(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    variants = {}
    for name, device, mode in (("neuron eager", NEURON, None), ("neuron default", NEURON, "default"),
                               ("neuron reduce-overhead", NEURON, "reduce-overhead"),
                               ("cpu eager", torch.device("cpu"), None)):
        model = copy.deepcopy(base).to(device)
        f = torch.compile(model, backend="neuron", mode=mode) if mode else model
        x = idx.to(device)

        def run(f=f, x=x):
            with torch.no_grad():
                for _ in range(20):  # 20 calls per sample: a call is ~0.5 ms
                    f(x)
        variants[name] = (run, device)
    return timeit(variants, args.warmup, args.repeat)


# (c) FlexAttention causal fwd+bwd --------------------------------------------------------------

def bench_flex(args):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, L, D = 4, 8, 256, 64
    bm = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, L, L, device=NEURON)
    qkv = [torch.randn(B, H, L, D, device=NEURON, requires_grad=True) for _ in range(3)]
    grad = torch.randn(B, H, L, D, device=NEURON)
    compiled = torch.compile(flex_attention, backend="neuron")

    def run(fn):
        def step():
            for t in qkv:
                t.grad = None
            fn(*qkv, block_mask=bm).backward(grad)
        return step

    out = timeit({"neuron eager": (run(flex_attention), NEURON),
                  "neuron compiled": (run(compiled), NEURON)}, args.warmup, args.repeat)
    out["cpu inductor"] = None
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    args = p.parse_args()
    import warnings

    warnings.filterwarnings("ignore")
    rows = [("(a) pointwise x10, 4M fp32", bench_pointwise(args)),
            ("(a') arithmetic pointwise x10, 4M fp32", bench_pointwise(args, pointwise_chain_arith)),
            ("(b) GPT train step (2L, d128, 16x64)", bench_gpt(args)),
            ("(c) FlexAttention causal fwd+bwd (4x8x256x64)", bench_flex(args))]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.repeat} interleaved "
          "rounds: median [min-max]")
    for name, r in rows:
        e, c, i = r["neuron eager"], r["neuron compiled"], r["cpu inductor"]
        print(f"{name}\n  neuron eager {fmt(e)} | neuron compiled {fmt(c)} | cpu inductor "
              f"{fmt(i) if i else 'n/a'}")
        print(f"  compiled/eager {fmt_ratio(ratios(c, e))}"
              + (f" | compiled/cpu-inductor {fmt_ratio(ratios(c, i))}" if i else ""))
    for name, r in (("(b) GPT train step, mode='reduce-overhead' (capturable AdamW)", bench_gpt_replay(args)),
                    ("(d) GPT forward, batch 1 x 16 tokens, no grad (20 calls)", bench_gpt_decode(args)),
                    ("(e) GPT train step with dropout 0.1, batch 1 x 64, mode='reduce-overhead'",
                     bench_gpt_dropout_replay(args))):
        print(f"{name}\n  " + " | ".join(f"{k} {fmt(v)}" for k, v in r.items()))
        print("  " + " | ".join(f"{k}/{ref} {fmt_ratio(ratios(r[k], r[ref]))}"
                                for k, ref in (("neuron reduce-overhead", "neuron default"),
                                               ("neuron reduce-overhead", "cpu eager"),
                                               ("neuron default", "cpu eager"))) + (
            f" | neuron eager/cpu eager {fmt_ratio(ratios(r['neuron eager'], r['cpu eager']))}"
            if "neuron eager" in r else ""))
    print("compile metrics:", torch.neuron.get_dynamo_metrics())


if __name__ == "__main__":
    main()
