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


_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# This file is called nkilib.py: keep its directory off sys.path so imports find the packages
# (same trick as bench/nki.py).
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(_ROOT)
sys.modules.pop("nkilib", None)

import nki  # noqa: E402
import torchneuron.nkilib as nkilib  # noqa: E402
from torchneuron.nkilib.perf_cases import cases  # noqa: E402
from torchneuron.platform import get_platform  # noqa: E402

sys.path.insert(0, _HERE)  # after `import nkilib` (this directory holds nkilib.py)
from _stats import fmt, fmt_ratio, ratios  # noqa: E402


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
        tn, ts = [], []
        for _ in range(5):  # interleaved rounds; SDPA is the best of 3 calls within a round
            tn.append(_timed(sim))
            ts.append(min(_timed(sdpa) for _ in range(3)))
        err = (sim() - sdpa()).abs().max().item()
        print(f"attention_cte fwd simulation, {H} heads x S={S} x d={d} fp32, "
              f"{'causal' if causal else 'full'} (5 rounds, median [min-max]): {fmt(tn, digits=0)} "
              f"vs SDPA on CPU {fmt(ts, digits=0)} -> ratio {fmt_ratio(ratios(tn, ts))}x "
              f"(target <= 10x on the median); max |err| {err:.1e}")


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
