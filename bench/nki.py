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


@nki.jit
def _many_small(x, n):
    t = nl.load(x)
    r = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
    for _ in range(n):
        nisa.tensor_scalar(r, t, nl.add, 1.0)


def _best(f, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def instructions_per_second() -> None:
    x = np.zeros((128, 64), np.float32)
    n = 20000
    for numerics in (True, False):
        s = _best(lambda: nki.simulate(_many_small, numerics=numerics)(x, n), 3)
        print(f"simulated instructions/s ([128, 64] tensor_scalar, numerics={numerics}): "
              f"{(n + 1) / s:,.0f}")


def softmax_ratio() -> None:
    import torch
    x = np.random.default_rng(0).standard_normal((128, 4096)).astype(np.float32)
    xt = torch.from_numpy(x)
    sim = nki.simulate(softmax_kernel)
    sim(x)  # warm-up (source checks are cached per kernel)
    t_sim = _best(lambda: sim(x), 20)
    t_torch = _best(lambda: torch.softmax(xt, dim=-1), 50)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a loaded machine makes torch's thread pool erratic: report both
    try:
        t_torch1 = _best(lambda: torch.softmax(xt, dim=-1), 50)
    finally:
        torch.set_num_threads(threads)
    print(f"softmax 128x4096 fp32: simulator {t_sim * 1e3:.2f} ms; torch.softmax "
          f"{t_torch * 1e3:.3f} ms ({threads} threads) -> ratio {t_sim / t_torch:.1f}x, "
          f"{t_torch1 * 1e3:.3f} ms (1 thread) -> ratio {t_sim / t_torch1:.1f}x (target <= 20x)")


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
