"""Regenerate the performance model's golden figures (tests/nki/golden_perf.json).

The golden test (tests/nki/test_golden_perf.py) pins the modelled latency, instruction count,
DMA bytes and TensorE FLOPs of every NKI-lib kernel at the shapes of docs/nkilib.md (LNC=1 and a
set at LNC=2) and of the tutorial kernels, on trn2 and trn3. A change to the performance model
or to a kernel's schedule that moves any of them fails that test; when the change is intended,
run this script, review the diff of the JSON (and refresh the table in docs/nkilib.md with
``python bench/nkilib.py``), and commit both.

    python tools/perf_golden.py          # print the differences against the committed file
    python tools/perf_golden.py --write  # rewrite it
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "nki", "golden_perf.json")
PLATFORMS = ("trn2", "trn3")


def tutorial_cases() -> list:
    """The tutorial kernels of tests/nki/nki_kernels.py at benchmark shapes."""
    import ml_dtypes
    import numpy as np
    sys.path.insert(0, os.path.join(ROOT, "tests", "nki"))
    from nki_kernels import copy_kernel, matmul_kernel, softmax_kernel
    bf = ml_dtypes.bfloat16
    return [
        ("tutorial matmul 2048^3 bf16", matmul_kernel,
         (np.zeros((2048, 2048), bf), np.zeros((2048, 2048), bf)), {}, 1),
        ("tutorial matmul 1024x1024x2048 fp32", matmul_kernel,
         (np.zeros((1024, 1024), np.float32), np.zeros((1024, 2048), np.float32)), {}, 1),
        ("tutorial copy 128x65536 fp32", copy_kernel, (np.zeros((128, 65536), np.float32),), {}, 1),
        ("tutorial softmax 128x4096 fp32", softmax_kernel, (np.zeros((128, 4096), np.float32),), {}, 1),
        ("tutorial softmax 128x4096 bf16", softmax_kernel, (np.zeros((128, 4096), bf),), {}, 1),
    ]


def all_cases() -> list:
    from torchneuron.nkilib.perf_cases import cases, lnc2_cases
    out = [c[:5] for c in cases()] + [c[:5] for c in lnc2_cases()]
    return out + tutorial_cases()


def measure(case, platform: str) -> dict:
    import nki
    name, kernel, args, kwargs, lnc = case
    bench = nki.benchmark(kernel, platform=platform, numerics=False)
    r = (bench[lnc] if lnc != 1 else bench)(*args, **kwargs)
    return {"latency_us": round(r.latency_us, 6), "instructions": r.instructions,
            "dma_bytes": r.dma_bytes, "flops": r.flops}


def compute() -> dict:
    return {c[0]: {p: measure(c, p) for p in PLATFORMS} for c in all_cases()}


def diff(old: dict, new: dict) -> list[str]:
    lines = []
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            lines.append(f"{name}: {'added' if name in new else 'removed'}")
            continue
        for p in PLATFORMS:
            for k, v in new[name][p].items():
                if old[name][p].get(k) != v:
                    lines.append(f"{name} [{p}] {k}: {old[name][p].get(k)} -> {v}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite tests/nki/golden_perf.json")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    new = compute()
    old = json.load(open(GOLDEN)) if os.path.exists(GOLDEN) else {}
    changes = diff(old, new)
    print("\n".join(changes) if changes else "no change")
    if args.write:
        with open(GOLDEN, "w") as f:
            json.dump(new, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    main()
