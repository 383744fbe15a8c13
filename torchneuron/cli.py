"""The ``torchneuron`` command.

``torchneuron info`` lists the emulated machine like ``neuron-ls``;
``torchneuron profile run [--steps A:B] [--out DIR] script.py args...`` profiles an unmodified
script; ``torchneuron profile report DIR`` writes the bottleneck report of a profile.
"""

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


def _print_report(rep, out=None) -> None:
    out = out or sys.stdout
    for line in rep.headline:
        print(line, file=out)
    if rep.findings:
        print("top findings:", file=out)
        for i, f in enumerate(rep.findings[:5], 1):
            saving = f" [~{f['saving_ns'] / 1e3:.0f} us/step]" if f["saving_ns"] else ""
            print(f"  {i}. {f['text']}{saving}", file=out)
    print(f"report: {rep.html_path}\n        {rep.markdown_path}", file=out)


def profile_command(args) -> int:
    """``torchneuron profile run|report``."""
    if args.profile_command == "report":
        from .profiler.report import write_report

        try:
            rep = write_report(args.dir)
        except (FileNotFoundError, ImportError) as exc:
            print(f"torchneuron profile report: {exc}", file=sys.stderr)
            return 2
        _print_report(rep)
        return 0
    from .profiler.run import parse_steps, profile_script

    try:
        steps = parse_steps(args.steps)
    except ValueError as exc:
        print(f"torchneuron profile run: {exc}", file=sys.stderr)
        return 2
    if not args.script:
        print("torchneuron profile run: give a script to run (torchneuron profile run script.py args...)",
              file=sys.stderr)
        return 2
    try:
        res = profile_script(args.script, args.args, args.out, steps)
    except FileNotFoundError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    if res.rank_dir is None:
        print(f"torchneuron profile run: nothing was recorded (the script finished before step "
              f"{steps[0] if steps else 0}?); output directory {res.out_dir}", file=sys.stderr)
        return 1
    print(f"trace and Parquet tables: {res.rank_dir}")
    if res.report is not None:
        _print_report(res.report)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="torchneuron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("info", help="list platform, chips, devices and memory (like neuron-ls)")
    prof = sub.add_parser("profile", help="profile a script / write a profile's report")
    psub = prof.add_subparsers(dest="profile_command", required=True)
    run = psub.add_parser("run", help="profile an unmodified script: torchneuron profile run script.py args...")
    run.add_argument("--steps", default=None, metavar="A:B",
                     help="record optimizer steps A..B-1 (default: the whole run)")
    run.add_argument("--out", default="neuron_profile", metavar="DIR",
                     help="output directory (default: ./neuron_profile)")
    run.add_argument("script", nargs="?")
    run.add_argument("args", nargs=argparse.REMAINDER, help="the script's arguments")
    rep = psub.add_parser("report", help="write DIR/report.html and report.md and print the top findings")
    rep.add_argument("dir")
    args = parser.parse_args(argv)
    if args.command in (None, "info"):
        try:
            info()
        except ValueError as exc:  # a bad topology variable
            print(f"torchneuron: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command == "profile":
        return profile_command(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
