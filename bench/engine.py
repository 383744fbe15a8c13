"""The execution engine (torch.neuron.engine) against native CPU eager, measured interleaved in
one run: every round times CPU, neuron with synchronous kernels, and neuron with the engine on.

Cases (issue 13 targets, engine time / CPU time, judged on the median):
  (a) host enqueue rate vs execution rate on 16-element adds (reported, no target);
  (b) the 16-element add with the engine on: <= 1.6;
  (c) one training step of the demo GPT (AdamW, foreach; synchronized, as in
      bench/eager_overhead.py): <= 0.85 (needs Adaptive Eager);
  (d) a pointwise-heavy model, an MLP with LayerNorm/GELU at batch 8 plus its AdamW step: <= 0.6
      (needs Adaptive Eager);
  (e) (d)'s AdamW step alone, capturable, eager and replayed from torch.accelerator.Graph
      (reported, no target);
  (f) (d)'s whole training step, capturable, eager and replayed from a graph (reported).
"neuron engine" runs with Adaptive Eager on (torch.neuron.engine.set_fusion_enabled), measured
after its kernels compiled; "engine default" as the engine ships, without the generated kernels
(the precompiled families on, among them the interpreted kernel that runs an optimizer step's
foreach lists as one region); "executor" as "engine", with the queues
run by the executor thread (torch.neuron.engine.set_executor_thread_enabled) while the host runs
ahead.
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, ratios, summary  # noqa: E402
from eager_overhead import add_case, train_case as gpt_case  # noqa: E402  (the same workloads)

engine = torch.neuron.engine
from torchneuron.compile import eager_fusion  # noqa: E402


def mlp_model(device):
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 1)).to(device)


def mlp_case(device, capturable=False):
    model = mlp_model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=capturable)
    x = torch.randn(8, 256, device=device)

    def step():
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return step


MODES = ("cpu", "sync", "default", "engine")


def run(fn, mode: str, inner: int) -> float:
    if mode != "cpu":
        engine.set_enabled(mode in ("default", "engine", "executor"))
        engine.set_fusion_enabled(mode in ("engine", "executor"))
        engine.set_executor_thread_enabled(mode == "executor")
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    if mode != "cpu":
        torch.neuron.synchronize()
    return (time.perf_counter() - start) / inner


def interleaved(make, inner: int, rounds: int) -> dict:
    fns = {m: make("cpu" if m == "cpu" else "neuron") for m in MODES}
    for m in MODES:
        run(fns[m], m, max(1, inner // 4))
    # Adaptive Eager compiles a region's kernels in the background once it has seen it twice:
    # let that finish before timing (the steady state of a training loop). A loop's first steps
    # cut their regions differently (an optimizer's first step creates its state), so warm up
    # until a few steps ask for no new kernel: a compile during the timed rounds would take a
    # core for seconds.
    for _ in range(10):
        requested = engine.stats()["kernels_requested"]
        run(fns["engine"], "engine", 3)
        eager_fusion.wait()
        if engine.stats()["kernels_requested"] == requested:
            break
    samples = {m: [] for m in MODES}
    for _ in range(rounds):
        for m in MODES:
            samples[m].append(run(fns[m], m, inner))
    return samples


def child(case: str, mode: str, inner: int, rounds: int = 7) -> None:
    """Run in a process of its own (see executor_case): print seconds per step of `case` in
    `mode` ("cpu" or "executor"), the median over `rounds`."""
    make = {"c": gpt_case, "d": mlp_case}[case]
    fn = make("cpu" if mode == "cpu" else "neuron")
    for _ in range(4):
        run(fn, mode, 5)
        eager_fusion.wait()
    print(statistics.median(run(fn, mode, inner) for _ in range(rounds)))


def executor_case(case: str, inner: int, runs: int = 5) -> dict:
    """CPU eager and the engine with its executor thread (and Adaptive Eager), each in processes
    of its own, alternated `runs` times. Not interleaved in one process as the other modes are:
    the executor's OpenMP team, once it exists, slows every other team of the process (libgomp
    then counts more threads than cores and stops spinning between parallel regions), which
    would slow the CPU baseline measured beside it (2-4x on (d))."""
    import subprocess

    samples = {"cpu": [], "executor": []}
    for _ in range(runs):
        for mode in samples:
            out = subprocess.run([sys.executable, __file__, "--child", case, mode, str(inner)], check=True,
                                 capture_output=True, text=True).stdout
            samples[mode].append(float(out.split()[-1]))
    return samples


def enqueue_rate(n: int = 20000, rounds: int = 7) -> tuple[list, list]:
    """Per-op host time of enqueueing n 16-element adds, and per-op time until all ran."""
    engine.set_enabled(True)
    a, b = torch.randn(16, device="neuron"), torch.randn(16, device="neuron")
    host, total = [], []
    for _ in range(rounds):
        torch.neuron.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            a + b
        enqueued = time.perf_counter()
        torch.neuron.synchronize()
        done = time.perf_counter()
        host.append((enqueued - start) / n)
        total.append((done - start) / n)
    return host, total


def timed_calls(fns: dict, rounds: int, inner: int) -> dict:
    """Seconds per call of each of `fns` ("cpu" and neuron ones, synchronized), interleaved over
    `rounds`, after a warm-up that lets Adaptive Eager compile what it will fuse."""
    for _ in range(3):
        for name, fn in fns.items():
            for _ in range(10):
                fn()
        torch.neuron.synchronize()
        eager_fusion.wait()
    samples = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(inner):
                fn()
            if name != "cpu":
                torch.neuron.synchronize()
            samples[name].append((time.perf_counter() - start) / inner)
    return samples


def graph_case(rounds: int = 9, inner: int = 100) -> dict:
    """The AdamW step of (d) alone (gradients fixed): CPU's (foreach), neuron's capturable one
    run eagerly, and the same captured once with torch.accelerator.Graph and replayed; the
    engine and Adaptive Eager on for neuron. Per step, synchronized; reported, no target."""
    def make(device, capturable=False):
        model = mlp_model(device)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())).to(device)
        return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True, capturable=capturable)

    engine.set_enabled(True)
    engine.set_fusion_enabled(True)
    engine.set_executor_thread_enabled(False)
    cpu, eager, graphed = make("cpu"), make("neuron", True), make("neuron", True)
    graphed.step()  # the optimizer's state, outside the capture
    graph = torch.accelerator.Graph()
    with torch.Stream(device="neuron"), graph:
        graphed.step()
    fns = {"cpu": cpu.step, "eager": eager.step, "graph": graph.replay}
    return timed_calls(fns, rounds, inner)


def step_graph_case(rounds: int = 9, inner: int = 50) -> dict:
    """(d)'s whole training step (forward, backward, AdamW) on neuron captured once with
    torch.accelerator.Graph and replayed, against CPU's eager step and neuron's eager step with
    the engine and Adaptive Eager on (neuron's optimizers `capturable=True`, as a graph needs).
    Per step, synchronized; reported, no target."""
    engine.set_enabled(True)
    engine.set_fusion_enabled(True)
    engine.set_executor_thread_enabled(False)
    graphed = mlp_case("neuron", capturable=True)
    graphed()  # the optimizer's state, outside the capture
    graph = torch.accelerator.Graph()
    with torch.Stream(device="neuron"), graph:
        graphed()
    fns = {"cpu": mlp_case("cpu"), "eager": mlp_case("neuron", capturable=True), "graph": graph.replay}
    return timed_calls(fns, rounds, inner)


def new_signature(rng: random.Random, nbufs: int = 6, nops: int = 12) -> bytes:
    """A random group signature of vector ops (no sqrt) over `nbufs` slots, in first-use order:
    new to the code cache, so loading it compiles."""
    vector_kinds = [k for k, (_, _, _, formula) in enumerate(eager_fusion.KINDS) if formula]
    sig = [nbufs]
    for i in range(nops):
        kind = rng.choice(vector_kinds)
        arity = eager_fusion.KINDS[kind][1]
        sig += [kind] + [min(i, nbufs - 1) if j == 0 else rng.randrange(nbufs) for j in range(arity)]
    return bytes(sig)


def compile_times(rounds: int = 3) -> tuple[list, list]:
    """Seconds to compile one new Adaptive Eager kernel: through the code cache Adaptive Eager
    uses (Inductor's precompiled cpp_prefix.h), and through Inductor's plain C++ code cache."""
    from torch._inductor.codecache import CppCodeCache

    eager_fusion.compile_signature(new_signature(random.Random()))  # Inductor's one-time set-up
    rng = random.Random()
    with_pch, without = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        eager_fusion.compile_signature(new_signature(rng))
        with_pch.append(time.perf_counter() - start)
        start = time.perf_counter()
        CppCodeCache.load(eager_fusion.source([new_signature(rng)]))
        without.append(time.perf_counter() - start)
    return with_pch, without


def main() -> None:
    was, was_fusing, was_thread = engine.is_enabled(), engine.is_fusion_enabled(), engine.is_executor_thread_enabled()
    try:
        host, total = enqueue_rate()
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}; "
              "median [min-max] over interleaved rounds")
        print(f"(a) 16-element adds, engine on: host enqueue {fmt(host, 1e6, 'us')} per op, "
              f"executed {fmt(total, 1e6, 'us')} per op (the device keeps up when the two match)")
        print(f"{'case':<26}{'cpu':>26}{'neuron sync':>26}{'neuron engine':>26}{'sync/cpu':>18}"
              f"{'default/cpu':>18}{'engine/cpu':>18}{'executor/cpu':>18}{'target':>8}  ok")
        print("(executor/cpu: the engine with its executor thread, CPU and executor each in processes of "
              "their own, alternated 5 times; the others interleaved in this process)")
        for name, make, inner, rounds, target in [
            ("(b) add, 16 elements", add_case, 20000, 11, 1.6),
            ("(c) GPT train step", gpt_case, 5, 9, 0.85),
            ("(d) MLP + AdamW, batch 8", mlp_case, 20, 9, 0.6),
        ]:
            t = interleaved(make, inner, rounds)
            if name[1] in "cd":
                x = executor_case(name[1], inner)
                t["executor"], t["cpu_alone"] = x["executor"], x["cpu"]
            else:
                t["executor"], t["cpu_alone"] = [float("nan")], [1.0]
            us = statistics.median(t["cpu"]) < 1e-3
            scale, unit = (1e6, "us") if us else (1e3, "ms")
            r_sync, r_eng = ratios(t["sync"], t["cpu"]), ratios(t["engine"], t["cpu"])
            r_unf, r_exe = ratios(t["default"], t["cpu"]), ratios(t["executor"], t["cpu_alone"])
            ok = min(summary(r_eng)[0], summary(r_exe)[0], summary(r_unf)[0]) <= target
            print(f"{name:<26}{fmt(t['cpu'], scale, unit):>26}{fmt(t['sync'], scale, unit):>26}"
                  f"{fmt(t['engine'], scale, unit):>26}{fmt_ratio(r_sync):>18}{fmt_ratio(r_unf):>18}{fmt_ratio(r_eng):>18}"
                  f"{fmt_ratio(r_exe) if r_exe[0] == r_exe[0] else 'n/a':>18}{target:8.2f}  {'yes' if ok else 'NO'}")
        g = graph_case()
        print(f"(e) AdamW step of (d), engine + Adaptive Eager: CPU {fmt(g['cpu'], 1e6, 'us')}; neuron capturable, "
              f"eager {fmt_ratio(ratios(g['eager'], g['cpu']))}, replayed from a graph "
              f"{fmt_ratio(ratios(g['graph'], g['cpu']))} of CPU (reported, no target)")
        g = step_graph_case()
        print(f"(f) (d)'s whole step, engine + Adaptive Eager: CPU {fmt(g['cpu'], 1e3, 'ms')}; neuron capturable, "
              f"eager {fmt_ratio(ratios(g['eager'], g['cpu']))}, replayed from a graph "
              f"{fmt_ratio(ratios(g['graph'], g['cpu']))} of CPU (reported, no target)")
        with_pch, without = compile_times()
        print(f"Adaptive Eager compile of a new 12-op kernel: {fmt(with_pch, 1, 's')} (precompiled header), "
              f"{fmt(without, 1, 's')} without")
        s = engine.stats()
        print(f"engine: {s['enqueued']} kernels enqueued, {s['drains']} host waits found work queued; "
              f"Adaptive Eager: {s['fused']} kernels ran fused in {s['regions']} generated-kernel calls, "
              f"{s['kernels_compiled']} kernels compiled, {s['kernels_failed']} failed; "
              f"{s['interpreted']} groups of foreach lists run by the interpreted kernel")
    finally:
        engine.set_executor_thread_enabled(was_thread)
        engine.set_enabled(was)
        engine.set_fusion_enabled(was_fusing)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        main()
