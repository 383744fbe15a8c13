"""Transposed layouts: copies between row-major and column-major layouts (`x.t().contiguous()`),
whole-tensor max of a transposed tensor, the fp8 casts of torchao's float8 training and bf16
weight-gradient products (A column-major), neuron against CPU in the same run
(csrc/backend/transpose.cpp, extrema.cpp, fp8.cpp, gemm.cpp).

Times per call with the default intra-op threads on both devices; ratios neuron / CPU, median
and [min-max] over interleaved rounds. Target: every case <= 1.0 (CPU walks the strided side
element by element; neuron streams both sides through L1 tiles).
"""

from __future__ import annotations

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, interleaved, ratios, summary  # noqa: E402

ROUNDS = 11


def cases(device: str) -> dict:
    out = {}
    for rows, cols in ((1024, 2048), (256, 256)):
        x = torch.randn(rows, cols, device=device)
        for name, dt in (("fp8", torch.float8_e4m3fn), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
            xt = x.to(dt).t()
            out[f"{name} {rows}x{cols} .t().contiguous()"] = (lambda xt=xt: xt.contiguous())
    b = torch.randn(1024, 2048, device=device).bfloat16()
    out["bf16 1024x2048 max(abs(x.t()))"] = lambda: torch.max(torch.abs(b.t()))
    out["bf16 1024x2048 .t() -> fp8"] = lambda: b.t().to(torch.float8_e4m3fn)
    # torchao's tensor-wise cast: amax, the scale from it, then scale, clamp and narrow
    # (hp_tensor_to_float8_dynamic's ops; on neuron the precompiled family's runs in registers).
    m8 = torch.finfo(torch.float8_e4m3fn).max
    out["bf16 1024x2048 torchao scaling cast -> fp8"] = lambda: (
        b.to(torch.float32) * (m8 / torch.clamp(torch.max(torch.abs(b)).to(torch.float64), min=1e-12)).to(torch.float32)
    ).clamp(-m8, m8).to(torch.float8_e4m3fn)
    # Results kept, as a training step keeps its transposes: their memory is not in cache when written.
    big = torch.randn(1024, 2048, device=device)
    for name, dt in (("fp8", torch.float8_e4m3fn), ("fp32", torch.float32)):
        out[f"{name} 1024x2048 .t().contiguous(), last 10 kept"] = (
            lambda xt=big.to(dt).t(), kept=collections.deque(maxlen=10): kept.append(xt.contiguous()))
    out["stacked 1000x16x16 fp32 .transpose(-1,-2).contiguous()"] = (
        lambda s=torch.randn(1000, 16, 16, device=device): s.transpose(-1, -2).contiguous())
    out["NCHW -> NHWC 8x32x32x32 fp32"] = (
        lambda c=torch.randn(8, 32, 32, 32, device=device): c.contiguous(memory_format=torch.channels_last))
    # Weight gradients: grad_output.t() @ input, a bf16 mm whose A is column-major (gemm.cpp,
    # row_major_first: neuron multiplies a row-major copy of A where B is wide).
    for m, k, n in ((1024, 1024, 2048), (2048, 1024, 1024), (768, 2048, 3072)):
        ga, gb = torch.randn(k, m, device=device).bfloat16(), torch.randn(k, n, device=device).bfloat16()
        out[f"bf16 weight-gradient mm {m}x{k}x{n} (A column-major)"] = lambda ga=ga, gb=gb: ga.t() @ gb
    out["attention (4,8,256,64) fp32 .transpose(-1,-2).contiguous()"] = (
        lambda q=torch.randn(4, 8, 256, 64, device=device): q.transpose(-1, -2).contiguous())
    return out


def main() -> None:
    import torchneuron  # noqa: F401

    print(f"transposed layouts, {torch.get_num_threads()} intra-op threads; neuron / CPU, target <= 1.0")
    cpu, dev = cases("cpu"), cases("neuron")
    missed = []
    for name in cpu:
        inner = 5 if "weight-gradient" in name else 20 if "1024" in name or "attention" in name or "1000x" in name else 200
        s = interleaved({"cpu": cpu[name], "neuron": dev[name]}, inner, ROUNDS)
        r = ratios(s["neuron"], s["cpu"])
        if summary(r)[0] > 1.0:
            missed.append(name)
        print(f"  {name:58s} cpu {fmt(s['cpu'], 1e6, 'us', 1)}, neuron {fmt(s['neuron'], 1e6, 'us', 1)}, "
              f"ratio {fmt_ratio(r)}")
    print("targets missed: " + ", ".join(missed) if missed else "all targets met")


if __name__ == "__main__":
    main()
