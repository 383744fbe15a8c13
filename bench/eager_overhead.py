"""Eager overhead of the neuron device against native CPU, measured interleaved in one run.

Ratios neuron time / CPU time (targets): (a) 16-element add <= 1.6, (b) 512x512 matmul <= 1.02,
(c) one training step of the demo GPT with identical optimizer settings <= 1.10; a 256-element
sqrt (MKL's vector math on both) (d) in MKL's default threading <= 1.6, as the small add, and
(e) once torch.set_num_threads was called, after which MKL opens its OpenMP team even for small
calls on CPU, and neuron makes them on one MKL thread (csrc/backend/vml_threads.h): <= 1.0; (f) the demo
GPT's causal attention forward+backward (16x4x64x32) <= 1.0 and (g) a UNet block's GroupNorm
forward+backward (4x64x32x32, 32 groups) <= 1.0 (both run before (e), whose thread setting
sticks). Each is the median of per-round ratios with its min-max (bench/_stats.py); targets are
judged on the median.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
from gpt import GPT, CharDataset, GPTConfig  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, interleaved, ratios, summary  # noqa: E402


def add_case(device):
    a, b = torch.randn(16, device=device), torch.randn(16, device=device)
    return lambda: a + b


def matmul_case(device):
    a, b = torch.randn(512, 512, device=device), torch.randn(512, 512, device=device)
    return lambda: torch.mm(a, b)


def sqrt_case(device):
    a = torch.rand(256, device=device) + 0.5
    return lambda: torch.sqrt(a)


def attention_case(device):
    # the demo GPT's attention, forward and backward (neuron's kernels write the device's results
    # in place; sdpa.cpp, direct_flash)
    B, H, L, E = 16, 4, 64, 32
    q, k, v = (torch.randn(B, L, H, E, device=device).transpose(1, 2).requires_grad_() for _ in range(3))
    g = torch.randn(B, H, L, E, device=device)

    def step():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        q.grad = k.grad = v.grad = None
    return step


def group_norm_case(device):
    # a diffusion UNet's normalization, forward and backward (neuron's kernels write the device's
    # results in place; ops.cpp, GroupNormKernel)
    norm = torch.nn.GroupNorm(32, 64).to(device)
    x = torch.randn(4, 64, 32, 32, device=device, requires_grad=True)
    g = torch.randn(4, 64, 32, 32, device=device)

    def step():
        norm(x).backward(g)
        x.grad = norm.weight.grad = norm.bias.grad = None
    return step


def sqrt_set_threads_case(device):
    torch.set_num_threads(torch.get_num_threads())  # sticky: this case runs last
    return sqrt_case(device)


def train_case(device):
    torch.manual_seed(0)
    cfg = GPTConfig()
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # same on both devices
    data = CharDataset(block_size=cfg.block_size)
    x, y = data.batch(16, torch.Generator().manual_seed(0))
    x, y = x.to(device), y.to(device)

    def step():
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if device != "cpu":
            torch.accelerator.synchronize()
    return step


def import_times(repeats: int = 7) -> dict:
    """Wall time of ``import torch`` in a fresh interpreter, autoload on and off, interleaved."""
    samples = {True: [], False: []}
    for _ in range(repeats):
        for autoload in (True, False):
            env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="1" if autoload else "0")
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True)
            samples[autoload].append(time.perf_counter() - start)
    return samples


def main() -> None:
    imp = import_times()
    extra = [a - b for a, b in zip(imp[True], imp[False])]
    m, lo, hi = summary(extra)
    print(f"import torch: {fmt(imp[False], 1, 's', 3)} without autoload, {fmt(imp[True], 1, 's', 3)} "
          f"with; difference {m:+.3f} s [{lo:+.3f}..{hi:+.3f}] (target <= +0.3 s)")
    rows = []
    for name, make, inner, rounds, target in [
        ("(a) add, 16 elements", add_case, 20000, 15, 1.6),
        ("(b) matmul 512x512", matmul_case, 40, 15, 1.02),
        ("(c) GPT train step", train_case, 10, 15, 1.10),
        ("(d) sqrt, 256 elements", sqrt_case, 20000, 15, 1.6),
        ("(f) attention fwd+bwd", attention_case, 50, 15, 1.0),
        ("(g) group norm fwd+bwd", group_norm_case, 50, 15, 1.0),
        ("(e) (d) after set_num_threads", sqrt_set_threads_case, 20000, 15, 1.0),
    ]:
        t = interleaved({"cpu": make("cpu"), "neuron": make("neuron")}, inner, rounds)
        rows.append((name, t["cpu"], t["neuron"], ratios(t["neuron"], t["cpu"]), target))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median [min-max] over "
          f"interleaved rounds, load {os.getloadavg()[0]:.1f}")
    print(f"{'case':<24}{'cpu':>30}{'neuron':>30}{'neuron / cpu':>20}{'target':>8}  ok")
    for name, c, n, r, tgt in rows:
        us = max(c) < 1e-3
        scale, unit = (1e6, "us") if us else (1e3, "ms")
        ok = summary(r)[0] <= tgt
        print(f"{name:<24}{fmt(c, scale, unit):>30}{fmt(n, scale, unit):>30}{fmt_ratio(r):>20}"
              f"{tgt:8.2f}  {'yes' if ok else 'NO'}")


if __name__ == "__main__":
    main()
