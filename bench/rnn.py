"""nn.LSTM / nn.GRU / nn.RNN training steps on neuron vs the same model on CPU.

On neuron (torchneuron/kernels/rnn.py) the LSTM runs oneDNN's layers as on CPU; the GRU and the
RNN project the inputs of all steps in one GEMM per layer and direction, as on CPU, then run
one cell a step (the GRU the fused ``_thnn_fused_gru_cell``, the RNN CPU's ops). Prints the median [min-max] time per forward+backward step of each and the
neuron/CPU ratio per interleaved round (bench/_stats.py).

Usage: python bench/rnn.py [--rounds 7] [--seq 35] [--batch 20] [--hidden 200]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _stats import fmt, fmt_ratio, ratios  # noqa: E402


def _step(model, x):
    out, _ = model(x)
    out.sum().backward()


def _time(model, x, reps: int) -> float:
    _step(model, x)
    t0 = time.perf_counter()
    for _ in range(reps):
        _step(model, x)
    torch.neuron.synchronize()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seq", type=int, default=35)
    p.add_argument("--batch", type=int, default=20)
    p.add_argument("--hidden", type=int, default=200)
    args = p.parse_args()
    torch.manual_seed(0)
    for kind in (nn.LSTM, nn.GRU, nn.RNN):
        cpu = kind(args.hidden, args.hidden, num_layers=2)
        dev = copy.deepcopy(cpu).to("neuron")
        x = torch.randn(args.seq, args.batch, args.hidden)
        xd = x.to("neuron")
        tc, td = [], []
        for _ in range(args.rounds):  # interleaved: both sides under the same load
            tc.append(_time(cpu, x, args.reps))
            td.append(_time(dev, xd, args.reps))
        print(f"{kind.__name__} 2x{args.hidden}, seq {args.seq}, batch {args.batch} (fwd+bwd): "
              f"neuron {fmt(td)}, cpu {fmt(tc)}, neuron/cpu {fmt_ratio(ratios(td, tc))}")


if __name__ == "__main__":
    main()
