"""Fused row softmax as an NKI kernel: simulate it, check it against torch, model its speed.

Run:  python examples/nki_softmax.py [--rows 1024] [--cols 4096] [--trace softmax.json]
"""

from __future__ import annotations

import argparse
import time

import torch

import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def softmax_kernel(x):
    """softmax(x, dim=-1) for x [R, F], 128 rows per tile, one pass over SBUF per tile.

    Per tile: DMA in -> VectorE max (negated) -> ScalarE exp(x - max) with the row sum fused
    into the same instruction -> VectorE reciprocal -> VectorE scale -> DMA out.
    """
    R, F = x.shape
    P = nl.tile_size.pmax
    out = nl.ndarray((R, F), x.dtype, buffer=nl.shared_hbm)
    for i in nl.affine_range((R + P - 1) // P):
        rows = min(P, R - i * P)
        t = nl.ndarray((rows, F), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * P:i * P + rows, :])
        neg_max = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(neg_max, op=nl.maximum, data=t, axis=1, negate=True)
        e = nl.ndarray((rows, F), nl.float32, buffer=nl.sbuf)
        total = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.activation(e, op=nl.exp, data=t, bias=neg_max, reduce_op=nl.add, reduce_res=total)
        inv = nl.ndarray((rows, 1), nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(inv, total)
        y = nl.ndarray((rows, F), x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(y, e, op0=nl.multiply, operand0=inv)
        nisa.dma_copy(dst=out[i * P:i * P + rows, :], src=y)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--trace", default=None, help="write a Perfetto/Chrome trace of the trn2 model")
    args = ap.parse_args()

    x = torch.randn(args.rows, args.cols)
    t0 = time.perf_counter()
    y = nki.simulate(softmax_kernel)(x)
    sim_s = time.perf_counter() - t0
    err = (y - torch.softmax(x, dim=-1)).abs().max().item()
    print(f"simulated softmax [{args.rows}, {args.cols}] fp32 in {sim_s * 1e3:.1f} ms; "
          f"max |error| vs torch.softmax = {err:.2e}")
    assert err < 1e-5, err

    xb = x.to(torch.bfloat16)
    errb = (nki.simulate(softmax_kernel)(xb).float() - torch.softmax(xb.float(), -1)).abs().max()
    print(f"bf16 input/output: max |error| = {errb.item():.2e} (bf16 output rounding)")

    nbytes = 2 * x.numel() * x.element_size()
    for plat in ("trn2", "trn3"):
        r = nki.benchmark(softmax_kernel, platform=plat)(x.numpy())
        print(f"{plat}: modelled latency {r.latency_us:.1f} us, "
              f"{nbytes / (r.latency_us * 1e-6) / 1e9:.0f} GB/s effective, "
              f"{r.instructions} instructions; busy us "
              + ", ".join(f"{k}={v:.1f}" for k, v in r.engine_busy_us.items()))
        if plat == "trn2" and args.trace:
            print("trace written to", r.save_trace(args.trace))


if __name__ == "__main__":
    main()
