"""NKI simulator / performance-model figures (not a test; prints numbers).

* simulated instructions per second (small tiles, numerics on and timing-only);
* a 128 x 4096 softmax kernel's simulation time vs torch.softmax on the CPU (target <= 20x);
* modelled MFU of the tiled 2048^3 bf16 matmul kernel on trn2 and trn3.

Run:  python bench/nki.py
"""

from __future__ import annotations

import os
import sys
import time

import ml_dtypes
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_HERE)
# This file is called nki.py: keep its directory off sys.path so `import nki` finds the package.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
sys.path.append(_ROOT)
sys.path.insert(0, os.path.join(_ROOT, "tests", "nki"))  # the kernels the tests specify
sys.modules.pop("nki", None)

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402
from nki_kernels import matmul_kernel, softmax_kernel  # noqa: E402

sys.path.insert(0, _HERE)  # after `import nki` (this directory holds nki.py): the shared summaries
from _stats import fmt, fmt_ratio, ratios, summary  # noqa: E402


@nki.jit
def _many_small(x, n):
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    for _ in range(n):
        nisa.tensor_scalar(r, t, nl.add, 1.0)


def _timed(f) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


def _samples(f, repeat: int) -> list[float]:
    return [_timed(f) for _ in range(repeat)]


def instructions_per_second() -> None:
    x = np.zeros((128, 64), np.float32)
    n = 20000
    for numerics in (True, False):
        rates = [(n + 1) / t for t in _samples(lambda: nki.simulate(_many_small, numerics=numerics)(x, n), 5)]
        m, lo, hi = summary(rates)
        print(f"simulated instructions/s ([128, 64] tensor_scalar, numerics={numerics}): "
              f"{m:,.0f} [{lo:,.0f}-{hi:,.0f}]")


def softmax_ratio() -> None:
    import torch
    x = np.random.default_rng(0).standard_normal((128, 4096)).astype(np.float32)
    xt = torch.from_numpy(x)
    sim = nki.simulate(softmax_kernel)
    sim(x)  # warm-up (source checks are cached per kernel)
    # Interleaved rounds: each round times the simulation once and torch.softmax (best of 5
    # calls, it is 100x shorter) with the default threads and with one thread.
    threads = torch.get_num_threads()
    t_sim, t_torch, t_torch1 = [], [], []
    for _ in range(15):
        t_sim.append(_timed(lambda: sim(x)))
        t_torch.append(min(_samples(lambda: torch.softmax(xt, dim=-1), 5)))
        torch.set_num_threads(1)  # a loaded machine makes torch's thread pool erratic: report both
        try:
            t_torch1.append(min(_samples(lambda: torch.softmax(xt, dim=-1), 5)))
        finally:
            torch.set_num_threads(threads)
    print(f"softmax 128x4096 fp32 (15 rounds, median [min-max]): simulator {fmt(t_sim)}; "
          f"torch.softmax {fmt(t_torch, digits=3)} ({threads} threads) -> ratio "
          f"{fmt_ratio(ratios(t_sim, t_torch), 1)}x; {fmt(t_torch1, digits=3)} (1 thread) -> ratio "
          f"{fmt_ratio(ratios(t_sim, t_torch1), 1)}x (target <= 20x on the median)")


def matmul_mfu() -> None:
    a = np.random.default_rng(0).standard_normal((2048, 2048)).astype(ml_dtypes.bfloat16)
    for plat in ("trn2", "trn3"):
        t = time.perf_counter()
        r = nki.benchmark(matmul_kernel, platform=plat, numerics=False)(a, a)
        wall = time.perf_counter() - t
        print(f"matmul 2048^3 bf16 on {plat}: modelled {r.latency_us:.1f} us, MFU "
              f"{r.mfu * 100:.1f}%, {r.instructions} instructions (modelled in {wall * 1e3:.0f} ms)")
    t = time.perf_counter()
    r = nki.benchmark(matmul_kernel, platform="trn2", numerics=True)(a, a)
    print(f"  with numerics: {(time.perf_counter() - t) * 1e3:.0f} ms wall; max |err| vs numpy "
          f"{np.abs(r.outputs - a.astype(np.float32).T @ a.astype(np.float32)).max():.2e}")


if __name__ == "__main__":
    instructions_per_second()
    softmax_ratio()
    matmul_mfu()
