"""Training layers whose neuron kernels differ from CPU's, neuron against CPU in the same run.

- RMSNorm (`nn.RMSNorm`, `F.rms_norm`: torchtitan's Llama, Qwen, Mistral-style models built on
  torch.nn) runs one kernel each way on neuron (csrc/backend/rms_norm.cpp) where CPU runs its
  composite of about ten ops forward and twenty backward; LayerNorm runs CPU's kernels on both
  (for scale). Forward, then backward of a random gradient. Target: RMSNorm <= 0.25 (memory
  passes: 2 forward and 3 backward against CPU's ~25).
- GELU's tanh approximation (`F.gelu(x, approximate="tanh")`) takes SLEEF's 3.5-ULP tanh
  (csrc/backend/gelu_tanh.cpp) where CPU takes the 1-ULP one. Forward and backward. Target <= 0.6.
- The embedding's weight gradient (`embedding_dense_backward`) runs CPU's walk into the device's
  pooled result (csrc/backend/embedding_backward.cpp), where CPU allocates a fresh zeroed table
  every call. Target <= 0.5 at GPT-2's table (50257 x 768).
- Scaled-dot-product attention of short sequences in fp32 (and fp16, through exact fp32 copies)
  runs csrc/backend/small_attention.cpp on AVX-512 hosts, where CPU runs its flash kernel:
  forward and backward (gradients of q, k and v), q, k and v as nn attention's views of one
  projection. Target <= 0.8 for the causal cases (the demo GPT's shape among them) and a padded
  batch (Hugging Face's causal mask with padding, a boolean attn_mask: the kernel reads the mask
  and skips each row's masked tail); without a mask reported (about 0.8-0.9: no masked work to
  skip).

Times per call with the default intra-op threads; ratio neuron / CPU, median and [min-max] over
interleaved rounds.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, interleaved, ratios, summary  # noqa: E402

ROUNDS = 9
TARGETS = {"RMSNorm": 0.25, "embedding": 0.5, "GELU(tanh)": 0.6, "attention": 0.8}


def cases(device: str) -> dict:
    out = {}
    for rows, dim, dt in ((4096, 1024, torch.bfloat16), (4096, 1024, torch.float32), (256, 4096, torch.bfloat16)):
        x = torch.randn(rows, dim, device=device, dtype=dt, requires_grad=True)
        g = torch.randn(rows, dim, device=device, dtype=dt)
        name = f"{rows}x{dim} {str(dt).removeprefix('torch.')}"
        for kind, layer in (("RMSNorm", torch.nn.RMSNorm(dim, eps=1e-6)), ("LayerNorm", torch.nn.LayerNorm(dim))):
            layer = layer.to(device, dt)
            out[f"{kind} {name}"] = (lambda layer=layer, x=x, g=g:
                                     torch.autograd.grad(layer(x), [x] + list(layer.parameters()), g))
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(4096, 1024, device=device, dtype=dt, requires_grad=True)
        g = torch.randn(4096, 1024, device=device, dtype=dt)
        out[f"GELU(tanh) 4096x1024 {str(dt).removeprefix('torch.')}"] = (
            lambda x=x, g=g: torch.autograd.grad(torch.nn.functional.gelu(x, approximate="tanh"), x, g))
    for rows, dim, tokens, dt in ((50257, 768, 1024, torch.float32), (32000, 1024, 2048, torch.bfloat16)):
        idx = torch.randint(0, rows, (tokens,), device=device)
        g = torch.randn(tokens, dim, device=device, dtype=dt)
        out[f"embedding grad {rows}x{dim} {str(dt).removeprefix('torch.')}, {tokens} tokens"] = (
            lambda g=g, idx=idx, rows=rows: torch.ops.aten.embedding_dense_backward(g, idx, rows, -1, False))
    for B, H, L, E, kind, dt in ((16, 4, 64, 32, "causal", torch.float32), (4, 8, 256, 64, "causal", torch.float32),
                                 (8, 8, 128, 64, "full", torch.float32), (4, 8, 256, 64, "causal", torch.float16),
                                 (4, 8, 128, 64, "padded", torch.float32), (2, 8, 384, 64, "padded", torch.float32)):
        x = torch.randn(B, L, 3 * H * E, device=device, dtype=dt)
        q, k, v = (t.view(B, L, H, E).transpose(1, 2).detach().requires_grad_() for t in x.split(H * E, -1))
        g = torch.randn(B, H, L, E, device=device, dtype=dt)
        mask = None
        if kind == "padded":  # sequence b keeps L - 16 b tokens, as a padded batch of a tokenizer
            keep = torch.arange(L)[None, :] < (L - 16 * torch.arange(B))[:, None]
            mask = (torch.ones(L, L, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]).to(device)
        out[f"attention {B}x{H}x{L}x{E} {kind} {str(dt).removeprefix('torch.')}"] = (
            lambda q=q, k=k, v=v, g=g, causal=kind == "causal", mask=mask: torch.autograd.grad(
                torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal),
                [q, k, v], g))
    return out


def main() -> None:
    import torchneuron  # noqa: F401

    print(f"training layers, {torch.get_num_threads()} intra-op threads; neuron / CPU")
    cpu, dev = cases("cpu"), cases("neuron")
    missed = []
    for name in cpu:
        s = interleaved({"cpu": cpu[name], "neuron": dev[name]}, 5, ROUNDS)
        r = ratios(s["neuron"], s["cpu"])
        target = None if " full " in name else TARGETS.get(name.split()[0])
        if target is not None and summary(r)[0] > target:
            missed.append(name)
        print(f"  {name:44s} cpu {fmt(s['cpu'], 1e3, 'ms', 2)}, neuron {fmt(s['neuron'], 1e3, 'ms', 2)}, "
              f"ratio {fmt_ratio(r)}" + (f"  (target <= {target})" if target is not None else ""))
    print("targets missed: " + ", ".join(missed) if missed else "all targets met")


if __name__ == "__main__":
    main()
