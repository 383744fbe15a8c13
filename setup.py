"""Build of torchneuron's C++ core against the installed torch (no build isolation).

Two extensions: ``torchneuron._C`` (runtime + PyTorch device glue) and, when its sources
exist, ``torchneuron._C_distributed`` (the c10d backend), kept apart so the device core does
not link the distributed headers' weight into every build.
"""
import glob
import os
import shlex
import subprocess

from setuptools import setup

ext_modules = []
cmdclass = {}


def _pch_is_current(gch, command):
    """True when `gch` was built by `command` and no header it read has changed since."""
    try:
        with open(gch + ".cmd") as f:
            if f.read() != command:
                return False
        with open(gch + ".d") as f:
            deps = f.read().replace("\\\n", " ").split(":", 1)[1].split()
        built = os.path.getmtime(gch)
        return all(os.path.getmtime(d) <= built for d in deps)
    except (OSError, IndexError):
        return False


def _own_dir_and_precompiled_header(compile_objects):
    """Wraps torch's ninja compile step: one ninja directory per extension and, for
    torchneuron._C, first (re)builds csrc/precompiled.h into a .gch with the very flags ninja
    will use (GCC ignores a .gch built with other flags), then adds `-include` of it to every
    unit (TORCHNEURON_NO_PCH=1: without). The other extension compiles unchanged."""

    def compile_with_pch(**kw):
        # Each extension writes its build.ninja in a directory of its own, so that both can
        # compile at once (see _ParallelBuild); the objects keep their absolute paths.
        name = next(f.strip("'").split("=", 1)[1] for f in kw["post_cflags"]
                    if f.strip("'").startswith("-DTORCH_EXTENSION_NAME="))
        kw["build_directory"] = os.path.join(kw["build_directory"], "ninja" + name)
        if name != "_C" or os.environ.get("TORCHNEURON_NO_PCH") == "1":
            return compile_objects(**kw)
        pch_dir = os.path.join(kw["build_directory"], "pch")
        os.makedirs(pch_dir, exist_ok=True)
        # The .gch must sit next to the header named by -include: a copy in the build tree.
        header = os.path.join(pch_dir, "precompiled.h")
        with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "precompiled.h")) as f:
            text = f.read()
        if not os.path.exists(header) or open(header).read() != text:
            with open(header, "w") as f:
                f.write(text)
        gch = header + ".gch"
        cflags, post = ([a for f in kw[k] for a in shlex.split(f)] for k in ("cflags", "post_cflags"))
        # ninja's order: $cxx $cflags -c $in -o $out $post_cflags
        cmd = ([_cpp.get_cxx_compiler()] + cflags + ["-x", "c++-header", header, "-o", gch,
               "-MMD", "-MF", gch + ".d"] + post)
        if not _pch_is_current(gch, shlex.join(cmd)):
            print(f"building the precompiled header {gch}", flush=True)
            subprocess.run(cmd, check=True)
            with open(gch + ".cmd", "w") as f:
                f.write(shlex.join(cmd))
        kw["post_cflags"] = kw["post_cflags"] + ["-include", shlex.quote(header), "-Winvalid-pch"]
        return compile_objects(**kw)

    return compile_with_pch


# Unity ("jumbo") translation units: each group below compiles as one unit that #includes its
# files, so the torch headers they share are parsed, and their templates instantiated, once per
# group rather than once per file. Measured per unit (CPU s): loading the precompiled header and
# instantiating what it declares is ~3 s even for an empty file, torch's pybind headers ~15 s
# more, pybind_utils.h (JIT stack parsing) ~27 s. Grouped: the four Python-binding units share
# one pybind parse; the small runtime and dispatch units share one header load. The sources stay
# one concept per file; an edit to any of them recompiles its group (ninja tracks includes).
# Files in no group compile alone; TORCHNEURON_UNITY_BUILD=0 compiles every file alone.
_UNITY_GROUPS = {
    # Python.h (via pybind) first, as Python requires; longest group first so ninja starts it first
    "python_bindings": ["csrc/module.cpp", "csrc/backend/cpu_kernel_call.cpp", "csrc/backend/enqueue.cpp",
                        "csrc/backend/memory_history.cpp", "csrc/backend/profiler.cpp", "csrc/backend/fusion.cpp"],
    "runtime": ["csrc/runtime/runtime.cpp", "csrc/runtime/engine.cpp", "csrc/runtime/trace.cpp", "csrc/backend/allocator.cpp",
                "csrc/backend/guard.cpp", "csrc/backend/generator.cpp", "csrc/backend/hooks.cpp",
                "csrc/backend/gpu_trace.cpp", "csrc/backend/ipc.cpp", "csrc/backend/graph.cpp"],
    "dispatch": ["csrc/backend/zero_copy.cpp", "csrc/backend/fallback.cpp",
                 "csrc/backend/bool_ops.cpp", "csrc/backend/fp8.cpp", "csrc/backend/sparse.cpp", "csrc/backend/nested.cpp",
                 "csrc/backend/transpose.cpp", "csrc/backend/extrema.cpp", "csrc/backend/bf16_gemm.cpp",
                 "csrc/backend/amx_gemm.cpp", "csrc/backend/gemv.cpp",
                 "csrc/backend/foreach.cpp", "csrc/backend/vml_threads.cpp", "csrc/backend/conv_net.cpp",
                 "csrc/backend/rnn_cells.cpp", "csrc/backend/structured_queued.cpp", "csrc/backend/sync_debug.cpp"],
    "distributed": ["csrc/distributed/backend.cpp", "csrc/distributed/ddp_timer.cpp"],
}


def _unity_sources(sources: list[str], build_dir: str) -> list[str]:
    """`sources` with each group's members replaced by one generated unit in `build_dir` (rewritten
    only when its text changes, so incremental builds stay incremental)."""
    if os.environ.get("TORCHNEURON_UNITY_BUILD") == "0":
        return sources
    here = os.path.dirname(os.path.abspath(__file__))
    out, grouped = [], set()
    for name, members in _UNITY_GROUPS.items():
        members = [m for m in members if m in sources]
        if len(members) < 2:
            continue
        # TORCH_ASSERT_ONLY_METHOD_OPERATORS is a per-file promise: reset it between files.
        # cpu_stub.h (macros only) comes first: a member that calls a CPU DispatchStub needs its
        # macros before any member's first include of DispatchStub.h.
        text = ("// Generated by setup.py (unity build): do not edit.\n"
                f'#include "{os.path.join(here, "csrc/backend/cpu_stub.h")}"\n') + "".join(
            f'#undef TORCH_ASSERT_ONLY_METHOD_OPERATORS\n#include "{os.path.join(here, m)}"\n'
            for m in members)
        path = os.path.join(build_dir, f"unity_{name}.cpp")
        os.makedirs(build_dir, exist_ok=True)
        if not os.path.exists(path) or open(path).read() != text:
            with open(path, "w") as f:
                f.write(text)
        out.append(path)
        grouped.update(members)
    return out + [s for s in sources if s not in grouped]


if os.environ.get("TORCHNEURON_SKIP_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # -Wno-interference-size: torch headers use std::hardware_destructive_interference_size.
    # -pipe: the compiler's intermediate files stay in memory, not in TMPDIR (a CI run once
    # failed with "error writing to /tmp/cc*.s: No space left on device").
    flags = ["-O2", "-pipe", "-fvisibility=hidden", "-Wno-unused-parameter", "-Wno-interference-size"]
    # Python's own CFLAGS carry -g; full debug info over torch's templates doubles every compile
    # (ops.cpp: 50 s of CPU with it, 26 s without). Symbols stay, so backtraces still name
    # functions; TORCHNEURON_DEBUG_BUILD=1 keeps the debug info for gdb sessions.
    flags.append("-g" if os.environ.get("TORCHNEURON_DEBUG_BUILD") == "1" else "-g0")
    # at::parallel_for is header code: in a unit compiled without -fopenmp its `omp parallel`
    # pragma is ignored and every loop runs on one thread. Linked with -fopenmp, the extension
    # needs libgomp.so.1, which resolves to the copy torch ships and has loaded already (one
    # OpenMP runtime, so torch.set_num_threads governs our loops too).
    flags.append("-fopenmp")
    # The wheel ships ATen's per-operator headers (ATen/ops/*.h); with AT_PER_OPERATOR_HEADERS,
    # ATen's own headers (Resize.h, ExpandUtils.h, ...) include those instead of Functions.h and
    # NativeFunctions.h, the declarations of all ~2,500 operators (about 15 s of parsing per
    # unit). Only the headers change, as in PyTorch's own build. Units that need no operator
    # beyond Tensor's methods also define TORCH_ASSERT_ONLY_METHOD_OPERATORS, which makes an
    # include of the all-operator headers an error instead of a silent slowdown.
    macros = [("AT_PER_OPERATOR_HEADERS", None)]
    core = _unity_sources(sorted(glob.glob("csrc/runtime/*.cpp") + glob.glob("csrc/backend/*.cpp"))
                          + ["csrc/module.cpp"], os.path.join("build", "unity"))
    # The kineto plugin (csrc/backend/profiler.cpp) compiles against the kineto headers the
    # wheel ships; libtorch was built with USE_KINETO, and fmt is used header-only.
    import torch.utils.cpp_extension as _cpp

    kineto = [os.path.join(d, "kineto") for d in _cpp.include_paths() if os.path.isdir(os.path.join(d, "kineto"))]
    # A precompiled header of the torch headers nearly every unit parses (csrc/precompiled.h):
    # torch's BuildExtension has no option for one, so its ninja step is wrapped (torch is
    # pinned; the wrapped function gets the final flag lists, so the .gch matches by construction).
    _cpp._write_ninja_file_and_compile_objects = _own_dir_and_precompiled_header(
        _cpp._write_ninja_file_and_compile_objects)
    ext_modules.append(CppExtension(name="torchneuron._C", sources=core, include_dirs=kineto,
                                    define_macros=macros + [("USE_KINETO", None), ("FMT_HEADER_ONLY", None)],
                                    extra_compile_args=flags, extra_link_args=["-fopenmp"]))
    dist = _unity_sources(sorted(glob.glob("csrc/distributed/*.cpp")), os.path.join("build", "unity"))
    if dist:
        ext_modules.append(
            CppExtension(name="torchneuron._C_distributed", sources=dist, define_macros=macros,
                         extra_compile_args=flags, extra_link_args=["-fopenmp"]))

    class _ParallelBuild(BuildExtension.with_options(use_ninja=True)):
        """Builds the two extensions side by side (setuptools' parallel build_ext, each with its
        own ninja run), not one after the other: otherwise the precompiled header runs alone
        before _C's units and _C_distributed's backend.cpp alone after them, one core idle."""

        def finalize_options(self):
            super().finalize_options()
            if self.parallel is None:
                self.parallel = len(self.extensions)

    cmdclass["build_ext"] = _ParallelBuild

setup(ext_modules=ext_modules, cmdclass=cmdclass)
