"""The ``torchneuron`` command. ``torchneuron info`` lists the emulated machine like ``neuron-ls``."""

from __future__ import annotations

import argparse
import sys


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def info(out=None) -> None:
    """Print platform, chips, devices and their memory in use."""
    out = out or sys.stdout
    import torch

    from . import platform

    topo = platform.topology()
    p = topo.platform
    print(f"torchneuron (emulated) — platform {p.name} ({p.chip}, {p.core_version})", file=out)
    print(f"chips: {topo.num_chips}   physical NeuronCores/chip: {p.physical_cores_per_chip}   "
          f"LNC: {topo.lnc}   logical cores/chip: {topo.logical_cores_per_chip}", file=out)
    print(f"HBM/chip: {_gib(p.hbm_bytes_per_chip)} at {p.hbm_bandwidth_per_chip / 1e12:.1f} TB/s   "
          f"TensorE/core: {p.tensor_tflops['bf16']:.0f} TFLOPS bf16   "
          f"NeuronLink: {p.neuronlink_bytes_per_s / 1e12:.2f} TB/s", file=out)
    header = f"{'DEVICE':<10}{'CHIP':>5}{'CORE':>6}{'MEMORY USED':>14}{'RESERVED':>12}{'CAPACITY':>12}"
    print("+" + "-" * (len(header) + 2) + "+", file=out)
    print(f"| {header} |", file=out)
    print("+" + "-" * (len(header) + 2) + "+", file=out)
    initialized = torch.neuron.is_initialized()
    for i in range(torch.neuron.device_count()):
        cap = torch.neuron.get_device_properties(i).total_memory
        used = torch.neuron.memory_allocated(i) if initialized else 0
        reserved = torch.neuron.memory_reserved(i) if initialized else 0
        row = (f"{'neuron:' + str(i):<10}{topo.chip_of(i):>5}{topo.visible_cores[i]:>6}"
               f"{_gib(used):>14}{_gib(reserved):>12}{_gib(cap):>12}")
        print(f"| {row} |", file=out)
    print("+" + "-" * (len(header) + 2) + "+", file=out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="list platform, chips, devices and memory (like neuron-ls)")
    args = parser.parse_args(argv)
    if args.command in (None, "info"):
        try:
            info()
        except ValueError as exc:  # a bad topology variable
            print(f"torchneuron: {exc}", file=sys.stderr)
            return 2
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
