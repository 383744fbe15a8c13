"""Build of torchneuron's C++ core against the installed torch (no build isolation)."""
import glob
import os

from setuptools import setup

ext_modules = []
cmdclass = {}
if os.environ.get("TORCHNEURON_SKIP_EXT") != "1":
    from torch.utils.cpp_extension import BuildExtension, CppExtension

    sources = sorted(glob.glob("csrc/**/*.cpp", recursive=True))
    ext_modules.append(
        CppExtension(
            name="torchneuron._C",
            sources=sources,
            extra_compile_args=["-O2", "-fvisibility=hidden", "-Wno-unused-parameter"],
        )
    )
    cmdclass["build_ext"] = BuildExtension.with_options(use_ninja=True)

setup(ext_modules=ext_modules, cmdclass=cmdclass)
