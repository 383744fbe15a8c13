"""A small Llama-style MoE language model whose norms, attention, RoPE, MoE and loss run on
NKI-lib kernels, trained for a few steps on the ``neuron`` device, then the modelled Trainium time of
one training step's kernels.

Per layer: RMSNorm (``rmsnorm`` / ``rmsnorm_bwd``) -> q/k/v projections -> RoPE
(``nkilib.rope``) -> causal GQA attention (``attention_cte`` forward, ``attention_bwd``
backward) -> output projection -> RMSNorm -> router (softmax top-k) -> blockwise MoE
(``moe_cte`` forward, ``moe_cte_bwd`` backward).
The loss is ``cross_entropy_fwd`` / ``cross_entropy_bwd``. Every kernel runs on the NKI
simulator (the device is emulated); ``nki.benchmark`` then models each kernel on trn2.

Run:  python examples/llama_nkilib.py [--steps 5] [--platform trn2]
"""

from __future__ import annotations

import argparse
import math
import time
from collections import Counter

import numpy as np
import torch
import torch.nn as nn

import nki
from torchneuron import nkilib  # torchneuron's kernels (AWS's layout: top-level `nkilib`)
from torchneuron.nkilib import ops

CALLS: Counter = Counter()  # (kernel name, shapes...) -> calls in one training step


def record(name, *shapes, **kw):
    CALLS[(name, shapes, tuple(sorted(kw.items())))] += 1


class RMSNorm(nn.Module):
    """RMSNorm through the NKI-lib kernels (forward ``rmsnorm``, backward ``rmsnorm_bwd``)."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        record("rmsnorm", x.numel() // x.shape[-1], x.shape[-1])
        return ops.rmsnorm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.h, self.kvh, self.d = heads, kv_heads, dim // heads
        self.wq = nn.Linear(dim, heads * self.d, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.d, bias=False)
        self.wo = nn.Linear(heads * self.d, dim, bias=False)

    def forward(self, x, cos, sin):
        B, S, _ = x.shape
        q = ops.rope(self.wq(x).view(B, S, self.h, self.d), cos, sin)
        k = ops.rope(self.wk(x).view(B, S, self.kvh, self.d), cos, sin)
        v = self.wv(x).view(B, S, self.kvh, self.d)
        record("rope", (B, S, self.h, self.d))
        record("rope", (B, S, self.kvh, self.d))
        o = ops.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        record("attention", B, self.h, self.kvh, S, self.d)
        return self.wo(o.transpose(1, 2).reshape(B, S, -1))


class MoE(nn.Module):
    def __init__(self, dim, hidden, experts, top_k, block_size):
        super().__init__()
        self.e, self.k, self.bs = experts, top_k, block_size
        self.router = nn.Linear(dim, experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(experts, dim, 2, hidden) / math.sqrt(dim))
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def forward(self, x):
        B, S, D = x.shape
        T = B * S
        xt = x.reshape(T, D)
        probs = torch.softmax(self.router(xt).float(), -1)
        topv, topi = probs.topk(self.k, -1)
        # masked affinities (T+1, E): normalised top-k probabilities, zero row for padding
        aff = torch.zeros(T, self.e, device=x.device).scatter(
            1, topi, topv / topv.sum(-1, keepdim=True))
        aff = torch.cat([aff, aff.new_zeros(1, self.e)])
        tp, be = nkilib.make_blocks(topi.cpu(), self.e, self.bs, T)
        hs = torch.cat([xt, xt.new_zeros(1, D)])  # padding row T
        out = ops.moe_cte(hs, aff.reshape(-1, 1), self.gate_up, self.down, tp.to(x.device),
                          be.to(x.device), self.bs, 1)
        record("moe_cte", T, D, self.gate_up.shape[-1], self.e, be.shape[0], self.bs)
        return out[:T].reshape(B, S, D)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n1 = RMSNorm(cfg.dim)
        self.attn = Attention(cfg.dim, cfg.heads, cfg.kv_heads)
        self.n2 = RMSNorm(cfg.dim)
        self.moe = MoE(cfg.dim, cfg.hidden, cfg.experts, cfg.top_k, cfg.block_size)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.n1(x), cos, sin)
        return x + self.moe(self.n2(x))


class Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        d = cfg.dim // cfg.heads
        inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
        ang = torch.arange(cfg.seq).float()[:, None] * inv[None, :]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x, self.cos, self.sin)
        logits = self.head(self.norm(x)).reshape(-1, self.head.out_features)
        record("cross_entropy", *logits.shape)
        return ops.cross_entropy(logits, targets.reshape(-1))


class Cfg:
    vocab, dim, heads, kv_heads, layers = 512, 128, 4, 2, 2
    hidden, experts, top_k, block_size = 128, 4, 2, 128
    seq, batch = 128, 2


def modelled_step(platform: str) -> None:
    """Model every kernel call of one training step (forward + backward) with nki.benchmark."""
    bf = np.float32
    rows = []
    for (name, shapes, kw), n in sorted(CALLS.items(), key=lambda x: x[0][0]):
        if name == "rope":
            (B, S, H, d), = shapes
            jobs = [("rope fwd+bwd", nkilib.rope, (np.zeros((B, S, H, d), bf),
                     np.zeros((S, d // 2), bf), np.zeros((S, d // 2), bf)), {}, 2)]
        elif name == "attention":
            B, H, Hkv, S, d = shapes
            nq = math.ceil(S / 128)
            jobs = [("attention_cte fwd", nkilib.attention_cte,
                     (np.zeros((B * H, S, d), bf), np.zeros((B * Hkv, S, d), bf),
                      np.zeros((B * Hkv, S, d), bf)),
                     dict(scale=1 / math.sqrt(d), tp_k=True, cache_softmax=True), 1),
                    ("attention_bwd", nkilib.attention_bwd,
                     tuple(np.zeros(s, bf) for s in ((B, H, d, S), (B, Hkv, d, S), (B, Hkv, d, S),
                                                     (B, H, d, S), (B, H, d, S)))
                     + (np.zeros((B, H, 128, nq), np.float32),),
                     dict(softmax_scale=1 / math.sqrt(d)), 1)]
        elif name == "moe_cte":
            T, D, I, E, NB, BS = shapes
            moe_args = (np.zeros((T + 1, D), bf), np.zeros(((T + 1) * E, 1), np.float32),
                        np.zeros((E, D, 2, I), bf), np.zeros((E, I, D), bf),
                        np.zeros(NB * BS, np.int32), np.zeros((NB, 1), np.int32))
            jobs = [("moe_cte fwd", nkilib.moe_cte, moe_args + (BS,), {}, 1),
                    ("moe_cte bwd", nkilib.moe_cte_bwd,
                     moe_args + (np.zeros((T + 1, D), bf), BS), {}, 1)]
        elif name == "rmsnorm":
            N, D = shapes
            x, w = np.zeros((N, D), bf), np.zeros(D, bf)
            jobs = [("rmsnorm fwd", nkilib.rmsnorm, (x, w), {}, 1),
                    ("rmsnorm bwd", nkilib.rmsnorm_bwd, (x, w, np.zeros((N, D), bf)), {}, 1)]
        else:
            N, V = shapes
            jobs = [("cross_entropy fwd", nkilib.cross_entropy_fwd,
                     (np.zeros((N, V), bf), np.zeros(N, np.int32)), {}, 1),
                    ("cross_entropy bwd", nkilib.cross_entropy_bwd,
                     (np.zeros((N, V), bf), np.zeros(N, np.int32), np.zeros(N, np.float32),
                      np.zeros(N, np.float32)), {}, 1)]
        for label, kern, args, kwargs, mult in jobs:
            r = nki.benchmark(kern, platform=platform, numerics=False)(*args, **kwargs)
            rows.append((label, shapes, n * mult, r.latency_us, r.mfu))
    total = 0.0
    print(f"\nmodelled NKI kernel time of one training step on {platform} (fp32 kernels, LNC=1):")
    for label, shapes, n, lat, mfu in rows:
        total += n * lat
        print(f"  {label:20s} {str(shapes):28s} x{n:<3d} {lat:8.1f} us each"
              + (f"  MFU {mfu * 100:4.1f}%" if mfu else ""))
    print(f"  total {total:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--platform", default="trn2")
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = Cfg()
    dev = torch.device("neuron")
    model = Model(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # a learnable toy task: next token = (token * 7 + 3) mod vocab
    idx = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq))
    tgt = (idx * 7 + 3) % cfg.vocab
    idx, tgt = idx.to(dev), tgt.to(dev)
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step == args.steps - 1:
            CALLS.clear()  # record the kernel calls of one (the last) step
        loss = model(idx, tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}")
    print(f"{args.steps} steps on {dev} in {time.perf_counter() - t0:.1f} s "
          "(every NKI kernel simulated)")
    modelled_step(args.platform)


if __name__ == "__main__":
    main()
