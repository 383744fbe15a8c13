"""Device memory that can be shared between processes, against native CPU in the same run.

(a) A fresh 4 MiB device segment (``empty_cache()`` then ``zeros``: heap-file mapping and first
    touch of the pages) against ``torch.zeros`` of the same size on CPU.
(b) Sending a freshly computed 16 MiB tensor to another process and getting one value back
    (``torch.multiprocessing`` pipe, spawned consumer): neuron shares the device block zero-copy,
    CPU copies the tensor into POSIX shared memory first (torch's ``file_descriptor`` strategy).

Ratios neuron / CPU; median and range over interleaved rounds.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.multiprocessing as mp


def _echo_first(conn) -> None:
    while True:
        t = conn.recv()
        if t is None:
            return
        conn.send(float(t.view(-1)[0]))


def _timed(fn, inner: int) -> float:
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner


def interleaved(fns: dict, inner: int, rounds: int) -> dict:
    for fn in fns.values():  # warm up
        _timed(fn, max(1, inner // 4))
    samples = {k: [] for k in fns}
    for _ in range(rounds):
        for k, fn in fns.items():
            samples[k].append(_timed(fn, inner))
    return samples


def fresh_segment(device: str):
    n = (4 << 20) // 4

    def run():
        if device != "cpu":
            torch.neuron.empty_cache()
        torch.zeros(n, device=device)
    return run


def send_fresh(device: str, conn):
    base = torch.randn(4 << 20, device=device)  # 16 MiB

    def run():
        conn.send(base * 2.0)  # a fresh tensor each time, as a producer would send
        conn.recv()
    return run


def report(name: str, samples: dict) -> None:
    cpu, neuron = samples["cpu"], samples["neuron"]
    ratios = [n / c for n, c in zip(neuron, cpu)]
    unit = lambda s: f"{s * 1e6:9.1f} us" if s < 1e-3 else f"{s * 1e3:9.3f} ms"
    print(f"{name:<34}{unit(statistics.median(cpu)):>12}{unit(statistics.median(neuron)):>12}"
          f"{statistics.median(ratios):8.3f}  [{min(ratios):.3f}, {max(ratios):.3f}]")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median over {rounds} rounds")
    print(f"{'case':<34}{'cpu':>12}{'neuron':>12}{'ratio':>8}  range")
    report("(a) fresh 4 MiB segment + touch", interleaved(
        {"cpu": fresh_segment("cpu"), "neuron": fresh_segment("neuron")}, 50, rounds))
    ctx = mp.get_context("spawn")
    conns = {}
    procs = []
    for device in ("cpu", "neuron"):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_echo_first, args=(child,), daemon=True)
        p.start()
        conns[device] = parent
        procs.append(p)
    report("(b) send fresh 16 MiB, get 1 value", interleaved(
        {d: send_fresh(d, conns[d]) for d in ("cpu", "neuron")}, 10, rounds))
    for c in conns.values():
        c.send(None)
    for p in procs:
        p.join(timeout=30)


if __name__ == "__main__":
    main()
