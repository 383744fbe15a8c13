"""Helpers shared by the tests (importable as ``support``; tests/ is on pytest's pythonpath)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_python(code: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter (topology and autoload are per process)."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=full_env, timeout=timeout, cwd=REPO)


# The kernels of csrc/backend/random.cpp, as torchneuron's op tracking names them. An op that ran
# one draws from neuron's Philox generator, whose numbers differ from CPU's by design.
RANDOM_KERNELS = frozenset(f"aten::{k}" for k in (
    "uniform_", "normal_", "log_normal_", "exponential_", "cauchy_", "geometric_", "random_",
    "bernoulli_", "native_dropout", "randperm", "multinomial", "_standard_gamma",
    "_sample_dirichlet", "poisson", "binomial"))


def ran_random_kernel() -> bool:
    """Whether a neuron random kernel ran since the last ``torchneuron.clear_op_tracking()``."""
    import torchneuron

    return bool(RANDOM_KERNELS & set(torchneuron.get_executed_ops()))
