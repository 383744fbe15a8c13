"""Device memory that can be shared between processes, against native CPU in the same run.

(a) Allocating and touching a tensor in a fresh device segment (``empty_cache()`` first, so the
    caching allocator must map a segment from the runtime's heap file) against ``torch.empty``
    plus ``fill_`` on CPU (glibc malloc): 256 KiB (a 2 MiB segment), 4 MiB (a 20 MiB segment),
    128 MiB (above the 64 MiB the runtime keeps mapped for reuse: cold shared-memory pages).
    CPU time of the process (user + system), one thread: robust to other jobs on the machine.
(b) Sending a freshly computed 16 MiB tensor to another process and getting one value back
    (``torch.multiprocessing`` pipe, spawned consumer; wall time): neuron shares the device block
    zero-copy, CPU copies the tensor into POSIX shared memory first (torch's
    ``file_descriptor`` strategy).

Ratios neuron / CPU; median and range over interleaved rounds.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

from _stats import interleaved


def _echo_first(conn) -> None:
    while True:
        t = conn.recv()
        if t is None:
            return
        conn.send(float(t.view(-1)[0]))


def fresh_segment(device: str, nbytes: int):
    def run():
        if device != "cpu":
            torch.neuron.empty_cache()
        torch.empty(nbytes // 4, device=device).fill_(1.0)
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
    print(f"{name:<40}{unit(statistics.median(cpu)):>12}{unit(statistics.median(neuron)):>12}"
          f"{statistics.median(ratios):8.3f}  [{min(ratios):.3f}, {max(ratios):.3f}]")


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median over {rounds} rounds")
    print(f"{'case':<40}{'cpu':>12}{'neuron':>12}{'ratio':>8}  range")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    for label, nbytes, inner in [("256 KiB", 256 << 10, 200), ("4 MiB", 4 << 20, 50),
                                 ("128 MiB", 128 << 20, 3)]:
        report(f"(a) fresh segment, {label}, CPU time", interleaved(
            {d: fresh_segment(d, nbytes) for d in ("cpu", "neuron")}, inner, rounds, time.process_time))
    torch.set_num_threads(threads)
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
