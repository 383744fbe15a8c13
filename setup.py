"""Build of torchneuron's C++ core against the installed torch (no build isolation).

Two extensions: ``torchneuron._C`` (runtime + PyTorch device glue) and, when its sources
exist, ``torchneuron._C_distributed`` (the c10d backend), kept apart so the device core does
not link the distributed headers' weight into every build.
"""
import glob
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("TORCHNEURON_SKIP_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    # -Wno-interference-size: torch headers use std::hardware_destructive_interference_size.
    flags = ["-O2", "-fvisibility=hidden", "-Wno-unused-parameter", "-Wno-interference-size"]
    # Python's own CFLAGS carry -g; full debug info over torch's templates doubles every compile
    # (ops.cpp: 50 s of CPU with it, 26 s without). Symbols stay, so backtraces still name
    # functions; TORCHNEURON_DEBUG_BUILD=1 keeps the debug info for gdb sessions.
    flags.append("-g" if os.environ.get("TORCHNEURON_DEBUG_BUILD") == "1" else "-g0")
    # The wheel ships ATen's per-operator headers (ATen/ops/*.h); with AT_PER_OPERATOR_HEADERS,
    # ATen's own headers (Resize.h, ExpandUtils.h, ...) include those instead of Functions.h and
    # NativeFunctions.h, the declarations of all ~2,500 operators (about 15 s of parsing per
    # unit). Only the headers change, as in PyTorch's own build. Units that need no operator
    # beyond Tensor's methods also define TORCH_ASSERT_ONLY_METHOD_OPERATORS, which makes an
    # include of the all-operator headers an error instead of a silent slowdown.
    macros = [("AT_PER_OPERATOR_HEADERS", None)]
    core = sorted(glob.glob("csrc/runtime/*.cpp") + glob.glob("csrc/backend/*.cpp")) + ["csrc/module.cpp"]
    # The kineto plugin (csrc/backend/profiler.cpp) compiles against the kineto headers the
    # wheel ships; libtorch was built with USE_KINETO, and fmt is used header-only.
    import torch.utils.cpp_extension as _cpp

    kineto = [os.path.join(d, "kineto") for d in _cpp.include_paths() if os.path.isdir(os.path.join(d, "kineto"))]
    ext_modules.append(CppExtension(name="torchneuron._C", sources=core, include_dirs=kineto,
                                    define_macros=macros + [("USE_KINETO", None), ("FMT_HEADER_ONLY", None)],
                                    extra_compile_args=flags))
    dist = sorted(glob.glob("csrc/distributed/*.cpp"))
    if dist:
        ext_modules.append(
            CppExtension(name="torchneuron._C_distributed", sources=dist, define_macros=macros,
                         extra_compile_args=flags))
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
