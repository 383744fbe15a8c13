"""torchneuron.nki: an NKI (Neuron Kernel Interface) 0.6-compatible language, simulator and
performance model that runs on the host CPU with numpy.

    import nki, nki.language as nl, nki.isa as nisa   # (aliases of torchneuron.nki.*)

    @nki.jit
    def add_kernel(a, b):
        out = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        x, y = nl.load(a), nl.load(b)
        nl.store(out, nl.add(x, y))
        return out

    nki.simulate(add_kernel)(a_np, b_np)                 # numpy in, numpy out
    nki.benchmark(add_kernel, platform="trn2")(a_np, b_np).latency_us

This package imports only numpy/ml_dtypes (torch is imported lazily when a torch tensor is
passed), so the simulator works without the neuron device. See docs/nki.md.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from . import collectives, constants, dtypes, isa, language, typing
from . import dtypes as dtype  # nki.dtype (dtype names; also the annotation `nki.dtype`)
from .errors import (NKIArgumentError, NKIBufferError, NKIDtypeError, NKIError, NKIMemoryError,
                     NKIOutOfBoundsError, NKIPartitionError, NKIPlatformError, NKIShapeError,
                     NKITracingError)
from .perf_model import BenchmarkResult, analyze
from .simulator import run as _run
from .simulator import to_kind_of as _to_kind_of
from .tensor import NkiTensor
from .tracer import current_or_none as _current_or_none

__all__ = [
    "jit", "simulate", "benchmark", "Kernel", "LaunchedKernel", "BenchmarkResult", "NkiTensor",
    "language", "isa", "collectives", "typing", "dtype", "dtypes", "NKIError", "NKITracingError", "NKIArgumentError", "NKIShapeError",
    "NKIPartitionError", "NKIDtypeError", "NKIBufferError", "NKIMemoryError",
    "NKIOutOfBoundsError", "NKIPlatformError",
]

__version__ = "0.6.0+torchneuron"


def _grid_lnc(grid: Any) -> int:
    if isinstance(grid, tuple):
        if len(grid) != 1:
            raise NKIArgumentError(
                f"launch grid {grid}: NKI 0.6 grids have one dimension, the LNC degree (1 or 2)",
                fix="launch with kernel[2](...) and loop over the remaining work inside the kernel")
        grid = grid[0]
    return int(grid)


def _has_torch(args: tuple, kwargs: dict) -> bool:
    def t(v):
        if isinstance(v, (tuple, list)):
            return any(t(e) for e in v)
        return type(v).__module__.startswith("torch") and hasattr(v, "device")
    return any(t(a) for a in args) or any(t(v) for v in kwargs.values())


class Kernel:
    """An ``@nki.jit`` kernel. Call it directly (LNC=1) or as ``kernel[2](...)`` (LNC=2).

    numpy arguments run on the simulator and return numpy arrays; torch tensors (CPU or
    ``neuron``) go through :mod:`torchneuron.nki.torch_ops` and return torch tensors.
    """

    def __init__(self, fn: Callable, **options: Any):
        if isinstance(fn, Kernel):
            fn = fn.fn
        self.fn = fn
        self.options = options
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> "LaunchedKernel":
        return LaunchedKernel(self, _grid_lnc(grid))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._launch(1, args, kwargs, grid_ndim=0)

    def _launch(self, lnc: int, args: tuple, kwargs: dict, grid_ndim: int = 1) -> Any:
        ctx = _current_or_none()
        if ctx is not None and ctx.active:
            # A kernel called from a running kernel is inlined (as the NKI compiler does): it
            # runs on the caller's program and grid.
            return self.fn(*args, **kwargs)
        if _has_torch(args, kwargs):
            from .torch_ops import call_kernel
            return call_kernel(self, lnc, args, kwargs, grid_ndim=grid_ndim)
        return _run(self.fn, args, kwargs, lnc=lnc, grid_ndim=grid_ndim).outputs

    def __repr__(self) -> str:
        return f"<nki.jit kernel {getattr(self.fn, '__qualname__', self.fn)}>"


class LaunchedKernel:
    """``kernel[lnc]``: the kernel with its launch grid (call it, or pass it to
    ``nki.simulate`` / ``nki.benchmark``)."""

    def __init__(self, kernel: Kernel, lnc: int):
        self.kernel = kernel
        self.fn = kernel.fn
        self.lnc = lnc

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.kernel._launch(self.lnc, args, kwargs, grid_ndim=1)

    def __repr__(self) -> str:
        return f"{self.kernel!r}[{self.lnc}]"


def jit(func: Callable | None = None, **options: Any) -> Any:
    """Mark ``func`` as an NKI kernel (usable as ``@nki.jit``, ``@nki.jit()`` or ``nki.jit(f)``).

    Options are accepted for source compatibility and ignored (the target platform comes from
    ``NEURON_PLATFORM_TARGET_OVERRIDE``).
    """
    if func is None:
        return lambda f: Kernel(f, **options)
    return Kernel(func, **options)


def _fn(kernel: Any) -> Callable:
    return kernel.fn if isinstance(kernel, (Kernel, LaunchedKernel)) else kernel


class _Simulation:
    def __init__(self, kernel, platform, numerics, seed):
        self.fn = _fn(kernel)
        # nki.simulate(kernel[2]) carries its grid
        self.grid = kernel.lnc if isinstance(kernel, LaunchedKernel) else None
        self.platform = platform
        self.numerics = numerics
        self.seed = seed

    def __getitem__(self, grid: Any) -> Callable:
        lnc = _grid_lnc(grid)
        return lambda *a, **k: self._go(lnc, a, k, 1)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.grid is not None:
            return self._go(self.grid, args, kwargs, 1)
        return self._go(1, args, kwargs, 0)

    def _run(self, lnc, args, kwargs, ndim):
        return _run(self.fn, args, kwargs, lnc=lnc, platform=self.platform,
                    numerics=self.numerics, seed=self.seed, grid_ndim=ndim)

    def _go(self, lnc, args, kwargs, ndim):
        return _to_kind_of(self._run(lnc, args, kwargs, ndim).outputs, args, kwargs)


def simulate(kernel: Any, platform: str | None = None, *, numerics: bool = True,
             seed: int = 0) -> _Simulation:
    """``simulate(kernel)(*args)`` / ``simulate(kernel)[2](*args)``: run on the simulator.

    Arguments are numpy arrays or CPU torch tensors; outputs come back as the same kind.
    ``platform`` defaults to ``NEURON_PLATFORM_TARGET_OVERRIDE`` (else trn2). With
    ``numerics=False`` only checks and instruction recording run (outputs hold sentinels).
    """
    return _Simulation(kernel, platform, numerics, seed)


class _Benchmark(_Simulation):
    def _go(self, lnc, args, kwargs, ndim):
        res = self._run(lnc, args, kwargs, ndim)
        outs = _to_kind_of(res.outputs, args, kwargs) if self.numerics else None
        return analyze(res.programs, res.platform, outs, max(res.peak_sbuf, default=0))


def benchmark(kernel: Any, platform: str = "trn2", *, numerics: bool = True,
              seed: int = 0) -> _Benchmark:
    """``benchmark(kernel, platform="trn2")(*args)`` -> :class:`BenchmarkResult`.

    Runs the kernel on the simulator (``numerics=False``: timing only, no values computed) and
    schedules its instruction stream with the performance model of ``platform``.
    """
    return _Benchmark(kernel, platform, numerics, seed)


def __getattr__(name: str) -> Any:
    # torch_ops imports torch; load it only when asked for.
    if name in ("nki_op", "torch_ops"):
        import importlib
        mod = importlib.import_module(__name__ + ".torch_ops")
        return mod if name == "torch_ops" else mod.nki_op
    raise AttributeError(f"module 'torchneuron.nki' has no attribute {name!r}")
