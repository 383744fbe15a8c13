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
    core = sorted(glob.glob("csrc/runtime/*.cpp") + glob.glob("csrc/backend/*.cpp")) + ["csrc/module.cpp"]
    ext_modules.append(CppExtension(name="torchneuron._C", sources=core, extra_compile_args=flags))
    dist = sorted(glob.glob("csrc/distributed/*.cpp"))
    if dist:
        ext_modules.append(
            CppExtension(name="torchneuron._C_distributed", sources=dist, extra_compile_args=flags))
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
