"""The extension's own parallel loops (fp8 casts, transposes, Philox kernels, vLLM kernels) run
on torch's intra-op threads: `at::parallel_for` is header code whose `omp parallel` pragma
vanishes in a unit compiled without -fopenmp (all of them ran on one thread until the eleventh
session), and the OpenMP runtime must be the one torch loaded, so that `torch.set_num_threads`
governs both and no second thread pool competes for the cores."""

import json
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


_MAPS = """
import json, torch, torchneuron
torch.ones(1, device="neuron").to(torch.float8_e4m3fn)  # the extension has run a kernel
with open("/proc/self/maps") as f:
    print(json.dumps(sorted({line.split()[-1] for line in f if "libgomp" in line})))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps")
def test_one_openmp_runtime_is_loaded_and_it_is_torchs():
    # In a fresh process: other packages may bring their own renamed copies (sentencepiece does).
    out = subprocess.run([sys.executable, "-c", _MAPS], capture_output=True, text=True, check=True).stdout
    gomp = json.loads(out.strip().splitlines()[-1])
    assert len(gomp) == 1, gomp
    assert gomp[0].startswith(torch.__path__[0])
