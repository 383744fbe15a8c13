"""NKI-lib figures: modelled latency / MFU / roofline per kernel, and simulation speed.

* For every kernel, a realistic shape is run through ``nki.benchmark`` (timing-only: the
  performance model needs the instruction stream, not the values) on trn2 and trn3, LNC=1
  (one physical NeuronCore). The roofline bound is max(compute, memory): compute = TensorE
  FLOPs / the core's peak for the matmul dtype; memory = the kernel's compulsory HBM bytes
  (inputs read once + outputs written once) / the core's HBM share
  (``hbm_bandwidth_per_chip / physical_cores_per_chip``). "% roof" = bound / latency.
* Simulation speed: attention_cte forward (8 heads, seq 2048, head dim 128, fp32, causal and
  not) simulated with numerics vs ``F.scaled_dot_product_attention`` on the CPU.

Run:  python bench/nkilib.py [--quick]   (prints a markdown table; docs/nkilib.md holds a copy)
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

import ml_dtypes
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# This file is called nkilib.py: keep its directory off sys.path so `import nkilib` finds the
# package (same trick as bench/nki.py).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(_ROOT)
sys.modules.pop("nkilib", None)

import nki  # noqa: E402
import nkilib  # noqa: E402
from torchneuron.platform import get_platform  # noqa: E402

BF = ml_dtypes.bfloat16


def z(*shape, dtype=BF):
    return np.zeros(shape, dtype)


def cases(quick: bool):
    """(name, kernel, args, kwargs, lnc, flops, compulsory HBM bytes, matmul dtype)."""
    out = []
    S, d = (4096 if quick else 8192), 128
    for causal in (False, True):
        pairs = S * (S + 1) // 2 if causal else S * S
        out.append((f"attention_cte fwd S={S} d={d} {'causal' if causal else 'full'}",
                    nkilib.attention_cte, (z(1, S, d), z(1, d, S), z(1, S, d)),
                    dict(scale=1 / math.sqrt(d), causal_mask=causal), 1, 4.0 * pairs * d,
                    4 * S * d * 2, "bfloat16"))
    Sb = 2048 if quick else 4096
    pairs = Sb * (Sb + 1) // 2
    out.append((f"attention_bwd S={Sb} d={d} causal", nkilib.attention_bwd,
                (z(1, 1, d, Sb), z(1, 1, d, Sb), z(1, 1, d, Sb), z(1, 1, d, Sb), z(1, 1, d, Sb),
                 z(1, 1, 128, Sb // 128, dtype=np.float32)),
                dict(use_causal_mask=True, softmax_scale=1 / math.sqrt(d)), 1, 10.0 * pairs * d,
                8 * Sb * d * 2, "bfloat16"))
    N, H = 4096, 4096
    out.append((f"rmsnorm N={N} H={H}", nkilib.rmsnorm, (z(N, H), z(H)), {}, 1, 0.0,
                2 * N * H * 2, ""))
    out.append((f"rmsnorm_bwd N={N} H={H}", nkilib.rmsnorm_bwd, (z(N, H), z(H), z(N, H)), {}, 1,
                0.0, (3 * N * H + 2 * H) * 2, ""))
    out.append(("rope B=1 S=4096 H=32 d=128", nkilib.rope,
                (z(1, 4096, 32, 128), z(4096, 64, dtype=np.float32),
                 z(4096, 64, dtype=np.float32)), {}, 1, 0.0, 2 * 4096 * 32 * 128 * 2 +
                2 * 4096 * 64 * 4, ""))
    T, H, I = 2048, 4096, 2048
    out.append((f"mlp T={T} H={H} I={I}", nkilib.mlp, (z(T, H), z(H, I), z(H, I), z(I, H)), {}, 1,
                6.0 * T * H * I, (2 * T * H + 3 * H * I) * 2, "bfloat16"))
    # model FLOPs of the backward: 12 T H I (the kernel also recomputes h_g, h_u: +4 T H I)
    out.append((f"mlp_bwd T={T} H={H} I={I}", nkilib.mlp_bwd,
                (z(T, H), z(H, I), z(H, I), z(I, H), z(T, H)), {}, 1, 12.0 * T * H * I,
                (4 * T * H + 6 * H * I) * 2, "bfloat16"))
    T, H, I, E, B, NB = 4096, 2048, 768, 8, 512, 16
    out.append((f"moe_cte {NB} blocks x {B} tok, H={H} I={I} E={E}", nkilib.moe_cte,
                (z(T + 1, H), z((T + 1) * E, 1, dtype=np.float32), z(E, H, 2, I), z(E, I, H),
                 z(NB * B, dtype=np.int32), z(NB, 1, dtype=np.int32), B), {}, 1,
                6.0 * NB * B * H * I, (2 * NB * B * H + 3 * E * H * I) * 2, "bfloat16"))
    # backward: model FLOPs 12 x (the kernel also recomputes h_g, h_u: +4); bytes: x, dout
    # rows read, dx written, weights read, weight gradients written
    out.append((f"moe_cte_bwd {NB} blocks x {B} tok, H={H} I={I} E={E}", nkilib.moe_cte_bwd,
                (z(T + 1, H), z((T + 1) * E, 1, dtype=np.float32), z(E, H, 2, I), z(E, I, H),
                 z(NB * B, dtype=np.int32), z(NB, 1, dtype=np.int32), z(T + 1, H), B), {}, 1,
                12.0 * NB * B * H * I, (3 * NB * B * H + 6 * E * H * I) * 2, "bfloat16"))
    T, G, K, N = 4096, 8, 2048, 1536
    ends = tuple((g + 1) * T // G for g in range(G))
    out.append((f"grouped_mm T={T} G={G} K={K} N={N}", nkilib.grouped_mm,
                (z(T, K), z(G, K, N), ends), {}, 1, 2.0 * T * K * N,
                (T * K + G * K * N + T * N) * 2, "bfloat16"))
    out.append(("router_topk T=4096 E=128 k=8", nkilib.router_topk,
                (z(4096, 128, dtype=np.float32),), dict(k=8), 1, 0.0,
                4096 * 128 * 8 + 4096 * 8 * 4, ""))
    N, V = 4096, 32768
    out.append((f"cross_entropy fwd N={N} V={V}", nkilib.cross_entropy_fwd,
                (z(N, V), z(N, dtype=np.int32)), {}, 1, 0.0, N * V * 2, ""))
    out.append((f"cross_entropy bwd N={N} V={V}", nkilib.cross_entropy_bwd,
                (z(N, V), z(N, dtype=np.int32), z(N, dtype=np.float32), z(N, dtype=np.float32)),
                {}, 1, 0.0, 2 * N * V * 2, ""))
    out.append(("cumsum N=4096 L=4096 fp32", nkilib.cumsum, (z(4096, 4096, dtype=np.float32),),
                {}, 1, 0.0, 2 * 4096 * 4096 * 4, ""))
    return out


def roofline_us(plat, flops, nbytes, mm_dtype, lnc):
    hbm = plat.hbm_bandwidth_per_chip / plat.physical_cores_per_chip * lnc
    mem = nbytes / hbm
    comp = flops / (plat.peak_flops(mm_dtype) * lnc) if flops else 0.0
    return comp * 1e6, mem * 1e6


def perf_table(quick: bool) -> None:
    print("| kernel | platform | latency us | MFU | TensorE MFU | compute bound us "
          "| memory bound us | % of roofline | model s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, kern, args, kw, lnc, flops, nbytes, mm in cases(quick):
        for pname in ("trn2", "trn3"):
            plat = get_platform(pname)
            t = time.perf_counter()
            r = nki.benchmark(kern, platform=pname, numerics=False)[lnc](*args, **kw)
            el = time.perf_counter() - t
            comp, mem = roofline_us(plat, flops, nbytes, mm, lnc)
            bound = max(comp, mem)
            # MFU: the kernel's model FLOPs (the attention FLOPs; causal: the kept half);
            # TensorE MFU: every matmul nki.benchmark counted (incl. mask-adding matmuls)
            mfu = f"{comp / r.latency_us * 100:.1f}%" if flops else "-"
            tmfu = f"{r.mfu * 100:.1f}%" if r.flops else "-"
            print(f"| {name} | {pname} | {r.latency_us:.1f} | {mfu} | {tmfu} | {comp:.1f} | "
                  f"{mem:.1f} | {bound / r.latency_us * 100:.0f}% | {el:.1f} |", flush=True)


def sim_speed() -> None:
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    H, S, d = 8, 2048, 128
    q, k, v = (torch.randn(H, S, d) for _ in range(3))
    kt = k.transpose(1, 2).contiguous()
    for causal in (True, False):
        def sdpa():
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=causal)[0]

        def sim():
            return nki.simulate(nkilib.attention_cte)(q, kt, v, scale=1 / math.sqrt(d),
                                                      causal_mask=causal)
        sdpa()
        sim()
        ts = min(_timed(sdpa) for _ in range(3))
        tn = min(_timed(sim) for _ in range(2))
        err = (sim() - sdpa()).abs().max().item()
        print(f"attention_cte fwd simulation, {H} heads x S={S} x d={d} fp32, "
              f"{'causal' if causal else 'full'}: {tn * 1e3:.0f} ms vs SDPA on CPU "
              f"{ts * 1e3:.0f} ms -> ratio {tn / ts:.2f}x (target <= 10x); max |err| {err:.1e}")


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller attention shapes")
    ap.add_argument("--no-sim-speed", action="store_true")
    args = ap.parse_args()
    perf_table(args.quick)
    if not args.no_sim_speed:
        print()
        sim_speed()


if __name__ == "__main__":
    main()
