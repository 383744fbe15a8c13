"""The extension's own parallel loops (fp8 casts, transposes, Philox kernels, vLLM kernels) run
on torch's intra-op threads: `at::parallel_for` is header code whose `omp parallel` pragma
vanishes in a unit compiled without -fopenmp (all of them ran on one thread until the eleventh
session), and the OpenMP runtime must be the one torch loaded, so that `torch.set_num_threads`
governs both and no second thread pool competes for the cores."""

import shutil
import subprocess
import sys

import pytest
import torch

import torchneuron


def test_the_extension_compiles_its_parallel_loops_with_openmp():
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm is not installed")
    imports = subprocess.run([nm, "-D", "--undefined-only", torchneuron._C.__file__], capture_output=True,
                             text=True, check=True).stdout
    assert "GOMP_parallel" in imports  # the outlined `omp parallel` regions call into libgomp


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_is_loaded_and_it_is_torchs():
    torch.ones(1, device="neuron").to(torch.float8_e4m3fn)  # the extension has run a kernel
    with open("/proc/self/maps") as f:
        gomp = {line.split()[-1] for line in f if "libgomp" in line}
    assert len(gomp) == 1, gomp
    assert gomp.pop().startswith(torch.__path__[0])
