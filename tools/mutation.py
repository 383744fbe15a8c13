"""Mutation testing of the modules where a silent error costs most (``make mutation``).

Runs mutmut 3 (the ``mutation`` extra) once per module, each with only the tests relevant to
that module, and prints killed/survived/timeout/no-tests counts and the surviving mutants' diffs.
Not part of ``make test``: a run of one module takes minutes to an hour on 2 cores. See
docs/testing.md for how to read the results and the recorded scores.

    python tools/mutation.py                   # every module, smallest first
    python tools/mutation.py platform memory   # some modules
    python tools/mutation.py --list            # the modules, their files and tests
    python tools/mutation.py --rerun-survivors perf_model   # only the last run's survivors

How mutmut 3 is made to work here (each point was a failure without it):

* Configuration per module. mutmut reads ``[tool.mutmut]`` from pyproject.toml; this script
  replaces that reader with the module's settings (file to mutate, test selection), so one run
  never maps or runs the tests of another module. Each module runs in a fresh process and a
  fresh ``mutants/`` directory (mutmut's cache would otherwise reset on the changed selection).
* The C++ extension. mutmut copies ``torchneuron/`` (all files, so ``_C*.so`` too) into
  ``mutants/`` and puts ``mutants/`` first on ``sys.path``; the editable install's finder comes
  after ``sys.path``, so the copied package wins. ``PYTHONPATH`` points there too, for the
  interpreters that tests start (``support.run_python``, spawned distributed ranks).
* The fork rule. mutmut forks once per mutant. A process forked after the neuron runtime was
  initialised refuses to use the device (CUDA's rule, csrc/runtime/runtime.cpp), so mutmut's
  default (fork from the process that ran the whole suite for its statistics) breaks every
  device test. ``process_isolation = "forkserver"`` keeps the parent clean; the fork server only
  imports and collects (neither initialises the runtime; mutmut's clean run, forked the same
  way, would fail first if they did), so each mutant's fork starts with a fresh device.
* Functions only. mutmut 3 mutates code inside functions and methods; module-level tables (the
  hardware facts in ``platform.PLATFORMS``) and decorated functions (properties, ``lru_cache``,
  ``custom_op`` registrations) are not mutated. Their values are pinned by direct tests instead.
* Subprocess coverage. A test reaches a function only if the call is recorded in the test's own
  process; code that runs only in a child interpreter shows as "no tests" (counted as not killed).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REPORT_DIR = REPO / "build" / "mutation"


@dataclass(frozen=True)
class Module:
    """One mutation target: the file, the tests that specify it, optionally only some functions."""

    path: str
    tests: tuple[str, ...]
    # mutmut function-name globs (``x_name`` for functions, ``xǁClassǁname`` for methods);
    # empty: every function of the file
    functions: tuple[str, ...] = ()
    note: str = ""
    # extra pytest arguments for this module's runs (e.g. a shorter ``--timeout`` where a
    # mutant can loop: the suite's 300 s per test would hold a worker that long)
    pytest_args: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    @property
    def dotted(self) -> str:
        dotted = self.path[:-3].replace("/", ".")
        return dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted

    def patterns(self) -> list[str]:
        if not self.functions:
            return [f"{self.dotted}.*"]
        return [f"{self.dotted}.{f}__mutmut_*" for f in self.functions]


# Smallest and fastest first. Test selections are the files that exercise the module in-process.
MODULES: dict[str, Module] = {
    "platform": Module(
        "torchneuron/platform.py",
        ("tests/device/test_topology.py", "tests/device/test_platform_rules.py"),
    ),
    "distributed": Module(
        "torchneuron/distributed/__init__.py",
        # in-process only: the subprocess tests of test_dist_registration.py (15-18 s each) cannot
        # be attributed to a function and only slowed every mutant of register()
        ("tests/distributed/test_dist_wiring.py",),
    ),
    "memory": Module(
        "torchneuron/neuron/memory.py",
        # test_memory.py's allocator tests go through the C++ API, not this module, and its OOM
        # cases run in subprocesses: left out for speed (its Python calls are in test_memory_api)
        ("tests/device/test_memory_api.py", "tests/profiler/test_memory_history.py",
         "tests/device/test_mem_pool.py"),
    ),
    "perf_model": Module(
        "torchneuron/nki/perf_model.py",
        # per-rule, scheduling and unit tests (about 20 s in all); test_golden_perf.py (about 5 min:
        # it models every NKI-lib kernel) is left out, it would make a run take hours
        ("tests/nki/test_perf_model_units.py", "tests/nki/test_perf_model_rules.py", "tests/nki/test_nki_perf.py"),
    ),
    "checks": Module(
        "torchneuron/nki/checks.py",
        ("tests/nki/test_check_messages.py", "tests/nki/test_nki_checks.py", "tests/nki/test_memory_limits.py"),
    ),
    "tracer": Module(
        "torchneuron/nki/tracer.py",
        ("tests/nki/test_tracer_units.py", "tests/nki/test_nki_perf.py", "tests/nki/test_nki_checks.py",
         "tests/nki/test_nki_lnc.py"),
    ),
    "isa_costs": Module(
        "torchneuron/nki/isa.py",
        # test_golden_perf.py (about 5 min) left out, as for perf_model
        ("tests/nki/test_isa_costs.py", "tests/nki/test_perf_model_rules.py", "tests/nki/test_memory_limits.py"),
        # the cost and capacity rules, not the numerics of every instruction
        functions=("x__vec_cycles", "x__all16", "x__any_psum", "x__emit", "x__one_bank", "x__run_bytes",
                   "x__dma_bytes"),
        note="cost/capacity helpers of isa.py only",
    ),
    "nkilib_ops": Module(
        "torchneuron/nkilib/ops.py",
        # the wiring unit tests, then the op-level gradient tests against CPU autograd; the
        # kernel tests of these files never call ops.py's wiring and the compiled-step tests
        # take minutes, so only the op tests are named
        ("tests/nkilib/test_ops_autograd_wiring.py",
         "tests/nkilib/test_nkilib_norm_mlp_backward.py::test_op_rmsnorm_mlp_grads_on_neuron_match_cpu_autograd",
         "tests/nkilib/test_nkilib_norm_mlp_backward.py::test_op_backward_kernels_lnc2_on_neuron",
         "tests/nkilib/test_nkilib_moe_backward.py::test_moe_op_gradients_on_neuron_use_the_kernel",
         "tests/nkilib/test_nkilib_grouped_mm.py::test_op_gradients_match_autograd_of_the_reference",
         "tests/nkilib/test_nkilib_attention.py::test_op_attention_autograd_matches_sdpa",
         "tests/nkilib/test_nkilib_attention.py::test_op_attention_on_neuron_device",
         "tests/nkilib/test_nkilib_kernels.py::test_op_cross_entropy_autograd_matches_torch_on_neuron",
         "tests/nkilib/test_nkilib_kernels.py::test_op_rope_autograd_is_inverse_rotation"),
        # the autograd wiring (setup_context / backward of every op, the differentiable wrappers
        # attention and cross_entropy, the lnc check); the custom ops themselves are decorated
        # (not mutated by mutmut), grouped_mm's argument checks and _moe_torch (a test
        # reference) are left out for time
        functions=("x__attn_setup", "x__attn_backward", "x_attention", "x__lnc", "x__rmsnorm_setup",
                   "x__rmsnorm_backward", "x__rope_setup", "x__rope_backward", "x__mlp_setup",
                   "x__mlp_backward", "x_cross_entropy", "x__ce_setup", "x__ce_backward", "x__moe_setup",
                   "x__moe_backward", "x__gmm_setup", "x__gmm_backward", "x__wgrad_backward"),
        note="autograd wiring of ops.py only",
    ),
    "compile_backend": Module(
        "torchneuron/compile/backend.py",
        ("tests/compile/test_errors.py", "tests/compile/test_error_helpers.py",
         "tests/compile/test_backend_wiring.py", "tests/compile/test_modes.py",
         "tests/compile/test_cache.py", "tests/compile/test_registration.py"),
        # the cycle-guard mutants of _op_from_exception loop forever on a cyclic exception chain;
        # 120 s, well above the slowest selected test, ends them sooner
        pytest_args=("--timeout=120",),
    ),
}


# ------------------------------------------------------------------------------------------
# inner run (one module, in its own process)
# ------------------------------------------------------------------------------------------
def _settings(mod: Module) -> dict:
    return {
        "source_paths": ["torchneuron"],
        "only_mutate": [mod.path],
        # tests read these through the repository root (tools/perf_golden.py, docs tables); the
        # top-level shim packages (``import nki``, ``nkilib``...) are found through the working
        # directory, which is ``mutants/`` during a run
        "also_copy": ["tools", "docs", "nki", "nkilib", "neuronxcc", "torch_neuronx"],
        "pytest_add_cli_args_test_selection": [t for t in mod.tests if (REPO / t.split("::")[0]).exists()],
        # -p no:cacheprovider: forked children must not race on .pytest_cache;
        # timeouts per test stay the suite's own (pytest-timeout from pyproject)
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning", *mod.pytest_args],
        "process_isolation": "forkserver",
        # the fork server collects the selected tests once (imports torch, torchneuron, conftest
        # and test modules; collection creates no device tensor), so a mutant's fork only runs
        # them. Should collection ever initialise the runtime, mutmut's clean run (forked the
        # same way) fails before any mutant is counted.
        "forkserver_warmup": "collect",
        "preload_modules_file": str(REPORT_DIR / "preload.txt"),
        "mutate_only_covered_lines": False,
        # loaded machine: a mutant is a timeout only when it takes far longer than its tests did
        "timeout_multiplier": 10.0,
        "timeout_constant": 30.0,
        "use_git_change_detection": False,
        "track_dependencies": True,
        # TORCHNEURON_MUTATION_DEBUG=1: mutmut prints every pytest command and its output
        "debug": os.environ.get("TORCHNEURON_MUTATION_DEBUG", "") not in ("", "0"),
    }


def _write_setup_cfg(path: Path, settings: dict) -> None:
    """The same settings for interpreters that tests start inside ``mutants/``: their
    trampolines read mutmut's configuration from the working directory (without it they stop
    with "Could not figure out where the code to mutate is")."""
    lines = ["[mutmut]"]
    for key, value in settings.items():
        if isinstance(value, list):
            value = "\n    " + "\n    ".join(value) if len(value) > 1 else (value[0] if value else "")
        elif isinstance(value, bool):
            value = "true" if value else "false"
        lines.append(f"{key} = {value}")
    path.write_text("\n".join(lines) + "\n")


def _inner(name: str, max_children: int, rerun: bool = False) -> int:
    mod = MODULES[name]
    previous = None
    if rerun:
        # after tests were added for a run's survivors: mutate the same file, run only the
        # survivors (exact mutant names), and merge their new outcome into that run's counts
        previous = json.loads((REPORT_DIR / f"{name}.json").read_text())
        if previous.get("path") != mod.path or not previous.get("survivors"):
            print(f"{name}: no survivors of a run of {mod.path} to re-run", file=sys.stderr)
            return 2
    os.chdir(REPO)
    shutil.rmtree(REPO / "mutants", ignore_errors=True)
    (REPO / "mutants").mkdir()
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    (REPORT_DIR / "preload.txt").write_text("torch\ntorchneuron\npytest\n")

    import mutmut.configuration as mc

    settings = _settings(mod)
    _write_setup_cfg(REPO / "mutants" / "setup.cfg", settings)
    mc._config_reader = lambda: (lambda key, default: settings.get(key, default))  # noqa: E731
    mc.reset_config()

    import mutmut.__main__ as mm

    start = time.monotonic()
    try:
        mm._run(list(previous["survivors"]) if previous else mod.patterns(), max_children)
    except SystemExit as e:  # mutmut exits on a failed clean run or forced-fail check
        if e.code not in (0, None):
            print(f"mutmut stopped with exit code {e.code}", file=sys.stderr)
            return int(e.code) if isinstance(e.code, int) else 1
    elapsed = time.monotonic() - start
    return _report(name, mod, elapsed, previous)


def _report(name: str, mod: Module, elapsed: float, previous: dict | None = None) -> int:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    data = SourceFileMutationData(path=Path(mod.path))
    data.load()
    pats = list(previous["survivors"]) if previous else mod.patterns()
    results = {k: status_by_exit_code[v] for k, v in data.exit_code_by_key.items()
               if any(fnmatch.fnmatch(k, p) for p in pats)}
    counts: dict[str, int] = {}
    if previous:  # the earlier run's caught mutants stay caught: tests were only added
        counts = {"killed": previous["killed"], "timeout": previous["timeout"], "segfault": previous["segfault"]}
        counts = {k: v for k, v in counts.items() if v}
    for status in results.values():
        counts[status] = counts.get(status, 0) + 1
    total = previous["total"] if previous else len(results)
    killed = counts.get("killed", 0)
    timeout = counts.get("timeout", 0)
    # a mutant whose tests crashed the interpreter (mutmut: "segfault") was caught too
    caught = ("killed", "timeout", "segfault")
    score = 100.0 * sum(counts.get(c, 0) for c in caught) / total if total else 0.0
    survivors = sorted(k for k, s in results.items() if s not in caught)
    summary = {
        "module": name, "path": mod.path, "date": time.strftime("%Y-%m-%d %H:%M"),
        "total": total, "killed": killed, "timeout": timeout,
        "segfault": counts.get("segfault", 0),
        "survived": counts.get("survived", 0), "no_tests": counts.get("no tests", 0),
        "other": {k: v for k, v in counts.items() if k not in caught + ("survived", "no tests")},
        "score_percent": round(score, 1), "seconds": round(elapsed), "tests": list(mod.tests),
        "rerun_of": ({"date": previous["date"], "score_percent": previous["score_percent"],
                      "survivors": len(previous["survivors"]), "seconds": previous["seconds"]}
                     if previous else None),
        "survivors": {k: results[k] for k in survivors},
    }
    (REPORT_DIR / f"{name}.json").write_text(json.dumps(summary, indent=1))
    with open(REPORT_DIR / f"{name}.diff", "w") as f:
        for k in survivors:
            f.write(f"### {k} ({results[k]})\n")
            try:
                f.write(get_diff_for_mutant(k, path=mod.path) + "\n\n")
            except Exception as e:  # noqa: BLE001  (a report must not lose the counts)
                f.write(f"(no diff: {e})\n\n")
    print(f"\n{name}: {total} mutants, {killed} killed, {timeout} timeout, {summary['segfault']} crashed, "
          f"{summary['survived']} survived, "
          f"{summary['no_tests']} no tests -> {score:.1f}% killed in {elapsed:.0f} s "
          f"(survivors: {REPORT_DIR / (name + '.diff')})")
    return 0


# ------------------------------------------------------------------------------------------
# outer driver
# ------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("modules", nargs="*", help=f"modules to run (default: all): {', '.join(MODULES)}")
    ap.add_argument("--list", action="store_true", help="list the modules and their tests")
    ap.add_argument("--max-children", type=int, default=2, help="mutants tested in parallel (default 2)")
    ap.add_argument("--rerun-survivors", action="store_true",
                    help="run only the survivors recorded in build/mutation/<module>.json and merge")
    ap.add_argument("--inner", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.inner:
        return _inner(args.inner, args.max_children, args.rerun_survivors)
    if args.list:
        for name, mod in MODULES.items():
            print(f"{name:16s} {mod.path}{'  [' + mod.note + ']' if mod.note else ''}")
            for t in mod.tests:
                print(f"{'':16s}   {t}")
        return 0
    unknown = [m for m in args.modules if m not in MODULES]
    if unknown:
        ap.error(f"unknown module(s) {unknown}; choose from {list(MODULES)}")
    try:
        import mutmut  # noqa: F401
    except ImportError:
        print("mutmut is not installed: run `make mutation` (installs the `mutation` extra)", file=sys.stderr)
        return 2
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "mutants")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("OMP_NUM_THREADS", "1")
    rc = 0
    for name in args.modules or list(MODULES):
        print(f"=== {name}: {MODULES[name].path}", flush=True)
        r = subprocess.run([sys.executable, __file__, "--inner", name, "--max-children", str(args.max_children)]
                           + (["--rerun-survivors"] if args.rerun_survivors else []), env=env, cwd=REPO)
        rc = rc or r.returncode
    return rc


if __name__ == "__main__":
    sys.exit(main())
