"""Realistic shapes for every NKI-lib kernel, with their model FLOPs and compulsory HBM bytes.

Shared by ``bench/nkilib.py`` (the modelled-performance table in docs/nkilib.md) and by the
performance-model golden test (``tests/nkilib/test_golden_perf.py``, regenerated deliberately
with ``tools/perf_golden.py``). Arguments are zero-filled NumPy arrays: the performance model
needs the instruction stream, not the values.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

import torchneuron.nkilib as nkilib

__all__ = ["cases", "lnc2_cases", "Case"]

BF = ml_dtypes.bfloat16
Case = tuple  # (name, kernel, args, kwargs, lnc, flops, compulsory HBM bytes, matmul dtype)


def z(*shape, dtype=BF):
    return np.zeros(shape, dtype)


def cases(quick: bool = False) -> list[Case]:
    """(name, kernel, args, kwargs, lnc, flops, compulsory HBM bytes, matmul dtype) per kernel;
    ``quick`` halves the attention sequence lengths."""
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


def lnc2_cases() -> list[Case]:
    """Kernels that split across the two physical cores of an LNC=2 logical core."""
    S, d = 4096, 128
    T, H, I, E, B, NB = 2048, 2048, 768, 8, 512, 8
    return [
        (f"attention_cte fwd S={S} d={d} causal LNC=2", nkilib.attention_cte,
         (z(1, S, d), z(1, d, S), z(1, S, d)), dict(scale=1 / math.sqrt(d), causal_mask=True), 2,
         2.0 * S * (S + 1) * d, 4 * S * d * 2, "bfloat16"),
        ("rmsnorm N=4096 H=4096 LNC=2", nkilib.rmsnorm, (z(4096, 4096), z(4096)), {}, 2, 0.0,
         2 * 4096 * 4096 * 2, ""),
        ("mlp T=2048 H=4096 I=2048 LNC=2", nkilib.mlp,
         (z(2048, 4096), z(4096, 2048), z(4096, 2048), z(2048, 4096)), {}, 2,
         6.0 * 2048 * 4096 * 2048, (2 * 2048 * 4096 + 3 * 4096 * 2048) * 2, "bfloat16"),
        (f"moe_cte {NB} blocks x {B} tok, H={H} I={I} E={E} LNC=2", nkilib.moe_cte,
         (z(T + 1, H), z((T + 1) * E, 1, dtype=np.float32), z(E, H, 2, I), z(E, I, H),
          z(NB * B, dtype=np.int32), z(NB, 1, dtype=np.int32), B), {}, 2,
         6.0 * NB * B * H * I, (2 * NB * B * H + 3 * E * H * I) * 2, "bfloat16"),
        ("cumsum N=4096 L=4096 fp32 LNC=2", nkilib.cumsum, (z(4096, 4096, dtype=np.float32),), {},
         2, 0.0, 2 * 4096 * 4096 * 4, ""),
    ]
