"""Random kernels: neuron's counter-based Philox kernels against CPU's (mt19937, MKL for
bernoulli) in the same run.

Cases: dropout (training, the hot random op of a training step) in fp32 and bf16, randn and
rand in fp32, at 1 Mi elements (throughput) and 16 Ki elements (per-op cost). Times are
per call with the default intra-op threads on both devices; ratios neuron / CPU, median and
[min-max] over interleaved rounds. Target: dropout and rand <= 1.0 at 1 Mi elements.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from _stats import fmt, fmt_ratio, interleaved, ratios  # noqa: E402

ROUNDS = 15


def cases(device: str, n: int) -> dict:
    x32 = torch.randn(n, device=device)
    x16 = x32.bfloat16()
    return {
        "dropout fp32": lambda: F.dropout(x32, 0.1, training=True),
        "dropout bf16": lambda: F.dropout(x16, 0.1, training=True),
        "randn fp32": lambda: torch.randn(n, device=device),
        "rand fp32": lambda: torch.rand(n, device=device),
    }


def main() -> None:
    import torchneuron  # noqa: F401

    print(f"random kernels, {torch.get_num_threads()} intra-op threads; neuron / CPU")
    for n, inner in ((1 << 20, 10), (1 << 14, 200)):
        cpu, dev = cases("cpu", n), cases("neuron", n)
        for name in cpu:
            s = interleaved({"cpu": cpu[name], "neuron": dev[name]}, inner, ROUNDS)
            print(f"  {name:13s} n={n:>8d}: cpu {fmt(s['cpu'], 1e6, 'us', 1)}, "
                  f"neuron {fmt(s['neuron'], 1e6, 'us', 1)}, ratio {fmt_ratio(ratios(s['neuron'], s['cpu']))}")


if __name__ == "__main__":
    main()
