"""Running a kernel: argument conversion, source checks, programs of an LNC launch, outputs.

Inputs (numpy arrays or CPU torch tensors) become HBM tensors that *share memory* with the
caller's arrays, so inputs a kernel writes are updated in place (as on the device). The
programs of an LNC=2 launch run concurrently (one thread each, see :mod:`.launch`) with their
own SBUF/PSUM and instruction streams; ``nl.shared_hbm`` allocations are shared.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from . import dtypes as dt
from .errors import NKIArgumentError, NKIBufferError, NKITracingError
from .tensor import NkiTensor, hbm, wrap_array
from .launch import Aborted, Launch
from .tracer import KernelContext, activate

_checked: dict = {}


def check_source(fn: Callable) -> None:
    """Reject Python constructs the NKI compiler does not accept (once per function)."""
    code = getattr(fn, "__code__", None)
    if code is None or code in _checked:
        return
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        _checked[code] = True
        return
    first = code.co_firstlineno
    fname = code.co_filename

    def bad(node, what: str, fix: str):
        raise NKITracingError(f"{what} is not supported in NKI kernels", fix=fix,
                              location=f"{fname}:{first + node.lineno - 1}", rule="unsupported-syntax")

    fdef = tree.body[0] if tree.body else None
    for node in ast.walk(tree):
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            bad(node, "`yield` (generator kernels)", "return the output tensors instead")
        elif isinstance(node, (ast.Await, ast.AsyncFor, ast.AsyncWith)) or (
                isinstance(node, ast.AsyncFunctionDef) and node is fdef):
            bad(node, "async code", "write the kernel as a plain function")
        elif isinstance(node, ast.Try):
            bad(node, "`try`/`except`", "check conditions explicitly; errors abort compilation")
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            bad(node, "`global`/`nonlocal`", "pass values as arguments and return results")
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators):
                if isinstance(op, (ast.Is, ast.IsNot)):
                    if not (isinstance(right, ast.Constant) and right.value is None) and not (
                            isinstance(node.left, ast.Constant) and node.left.value is None):
                        bad(node, "the `is` operator (except `is None`)", "compare with == instead")
    _checked[code] = True


@dataclass
class RunResult:
    outputs: Any
    programs: list  # per program: list of Instr
    platform: Any
    ledgers: list  # per program: its MemoryLedger
    written_inputs: list = None  # numpy arrays of the kernel inputs some DMA wrote

    @property
    def peak_sbuf(self) -> list:
        """Peak live SBUF bytes per partition of each program (tile lifetimes)."""
        return [m.peak_sbuf for m in self.ledgers]


def _to_numpy(x: Any, path: str, writebacks: list) -> tuple[np.ndarray, Any] | None:
    """(array sharing memory with x, NKI dtype) for a numpy array / CPU torch tensor, else None."""
    if isinstance(x, np.ndarray):
        d = dt.as_dtype(x.dtype)
        if x.flags.c_contiguous:
            return x, d
        c = np.ascontiguousarray(x)
        writebacks.append((x, c))
        return c, d
    mod = type(x).__module__
    if mod.startswith("torch"):
        import torch
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                raise NKIArgumentError(f"argument {path} is on {x.device}; the simulator takes CPU "
                                       "tensors", fix="call the kernel through nki.jit (which moves "
                                       "device tensors) or pass .cpu() tensors")
            d = dt.as_dtype(x.dtype)
            t = x.detach()
            if not t.is_contiguous():
                c = t.contiguous()
                writebacks.append((t, c))
                t = c
            if t.dtype == torch.bfloat16:
                arr = t.view(torch.int16).numpy().view(dt.bfloat16)
            elif str(t.dtype).startswith("torch.float8"):
                arr = t.view(torch.uint8).numpy().view(dt.storage(d))
            else:
                arr = t.numpy()
            return arr, d
    return None


def _convert_args(args: tuple, kwargs: dict, writebacks: list) -> tuple[list, dict]:
    """Replace arrays by ('array', np, dtype, name) specs; reject what NKI rejects."""
    def conv(v, path):
        if isinstance(v, list):
            raise NKITracingError(f"argument {path} is a list; NKI kernels do not accept list "
                                  "arguments", fix="pass a tuple instead", rule="argument")
        if isinstance(v, tuple):
            return tuple(conv(e, f"{path}[{i}]") for i, e in enumerate(v))
        if isinstance(v, dict):
            return {k: conv(e, f"{path}[{k!r}]") for k, e in v.items()}
        r = _to_numpy(v, path, writebacks)
        if r is not None:
            return ("__array__", r[0], r[1], path)
        if isinstance(v, np.generic):
            return v.item()
        return v
    return ([conv(a, f"#{i}") for i, a in enumerate(args)],
            {k: conv(v, k) for k, v in kwargs.items()})


def _wrap(spec: Any, inputs: list | None = None) -> Any:
    if isinstance(spec, tuple):
        if len(spec) == 4 and spec[0] == "__array__":
            t = wrap_array(spec[1], spec[2], spec[3].lstrip("#") or "in", hbm)
            if inputs is not None:
                inputs.append(t.storage)
            return t
        return tuple(_wrap(s, inputs) for s in spec)
    if isinstance(spec, dict):
        return {k: _wrap(v, inputs) for k, v in spec.items()}
    return spec


def _collect_output(ret: Any, where: str) -> Any:
    if ret is None:
        return None
    if isinstance(ret, NkiTensor):
        if not ret.buffer.is_hbm:
            raise NKIBufferError(
                f"kernel returned {ret._desc()} ({where}); kernel outputs must live in HBM",
                fix="allocate outputs with nl.ndarray(shape, dtype, buffer=nl.shared_hbm), store "
                    "into them and return them", rule="output-buffer")
        return ret
    if isinstance(ret, (tuple, list)):
        return type(ret)(_collect_output(r, where) for r in ret)
    if isinstance(ret, dict):
        return {k: _collect_output(v, where) for k, v in ret.items()}
    return ret


def _materialise(ret: Any) -> Any:
    if isinstance(ret, NkiTensor):
        st = ret.storage
        if ret.data is st.array and not st.external:
            # A whole output allocation is owned by this run only: hand it over without a copy.
            return st.array
        return np.array(ret.data)
    if isinstance(ret, (tuple, list)):
        return type(ret)(_materialise(r) for r in ret)
    if isinstance(ret, dict):
        return {k: _materialise(v) for k, v in ret.items()}
    return ret


def run(fn: Callable, args: tuple, kwargs: dict, *, lnc: int = 1, platform: Any = None,
        numerics: bool = True, seed: int = 0, grid_ndim: int | None = None) -> RunResult:
    """Run ``fn`` as an NKI kernel on the simulator; outputs are numpy arrays.

    The ``lnc`` programs run concurrently (one thread each under LNC=2), sharing
    ``shared_hbm``; ``grid_ndim`` is what ``nl.program_ndim()`` reports (0 for ``kernel(...)``,
    1 for ``kernel[lnc](...)``; default 1 when lnc > 1).
    """
    from ..platform import get_platform
    plat = platform if hasattr(platform, "sbuf_partitions") else get_platform(platform)
    if lnc not in (1, 2):
        raise NKIArgumentError(f"launch grid [{lnc}]: the grid is the LNC degree and must be 1 or 2",
                               fix="launch with kernel[1] or kernel[2]; loop over work inside the "
                                   "kernel instead of using a multi-dimensional SPMD grid")
    check_source(fn)
    writebacks: list = []
    specs, kwspecs = _convert_args(args, kwargs, writebacks)
    launch = Launch(lnc, (1 if lnc > 1 else 0) if grid_ndim is None else grid_ndim)
    kernel_file = getattr(getattr(fn, "__code__", None), "co_filename", None)
    ctxs = [KernelContext(plat, pid, launch, numerics=numerics, seed=seed, kernel_file=kernel_file)
            for pid in range(lnc)]
    inputs: list = [[] for _ in range(lnc)]  # Storages of the wrapped kernel inputs
    rets: list = [None] * lnc
    errors: list = [None] * lnc

    def program(pid: int) -> None:
        ctx = ctxs[pid]
        try:
            with activate(ctx), _SingleThreadBlas():
                wargs = [_wrap(s, inputs[pid]) for s in specs]
                wkwargs = {k: _wrap(v, inputs[pid]) for k, v in kwspecs.items()}
                rets[pid] = _collect_output(fn(*wargs, **wkwargs), f"program {pid}")
                del wargs, wkwargs
                ctx.memory.finish(ctx.instructions)
        except Aborted:
            pass
        except BaseException as e:  # noqa: BLE001  (re-raised in the caller's thread)
            errors[pid] = e
            launch.fail(e)
        finally:
            launch.finished(pid)

    if lnc == 1:
        program(0)
    else:
        workers = [threading.Thread(target=program, args=(pid,), name=f"nki-program-{pid}",
                                    daemon=True) for pid in range(1, lnc)]
        for w in workers:
            w.start()
        program(0)
        for w in workers:
            w.join()
    first = launch.failed
    if first is not None:
        raise first
    out = _materialise(rets[0])  # after every program wrote its share of shared_hbm
    for orig, copy in writebacks:
        orig[...] = copy
    written = []
    for st in (s for lst in inputs for s in lst):
        if st.dirty and not any(w is st.array for w in written):
            written.append(st.array)
    return RunResult(out, [c.instructions for c in ctxs], plat, [c.memory for c in ctxs],
                     written)


def to_kind_of(outputs: Any, args: tuple, kwargs: dict) -> Any:
    """Convert numpy outputs to torch tensors if any input was a torch tensor."""
    def is_torch(v):
        if isinstance(v, (tuple, list)):
            return any(is_torch(e) for e in v)
        return type(v).__module__.startswith("torch") and hasattr(v, "dtype")
    if not (any(is_torch(a) for a in args) or any(is_torch(v) for v in kwargs.values())):
        return outputs
    return numpy_to_torch(outputs)


def numpy_to_torch(x: Any) -> Any:
    import torch
    if isinstance(x, np.ndarray):
        if x.dtype == dt.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
        if x.dtype in (dt.float8_e4m3, dt.float8_e5m2, dt.float8_e4m3fn):
            tdt = {dt.float8_e5m2: torch.float8_e5m2, dt.float8_e4m3fn: torch.float8_e4m3fn}.get(
                x.dtype)
            if tdt is None:  # torch has no IEEE e4m3; widen to float32
                return torch.from_numpy(x.astype(np.float32))
            return torch.from_numpy(np.ascontiguousarray(x).view(np.uint8)).view(tdt)
        return torch.from_numpy(np.ascontiguousarray(x))
    if isinstance(x, (tuple, list)):
        return type(x)(numpy_to_torch(e) for e in x)
    if isinstance(x, dict):
        return {k: numpy_to_torch(v) for k, v in x.items()}
    return x


class _SingleThreadBlas:
    """Run numpy's OpenBLAS single-threaded while a kernel simulates.

    Matmul tiles are at most [128, 128] x [128, 512]: threading them gains nothing, and
    OpenBLAS worker threads spin-waiting on a loaded machine made each tile 100x slower.
    Uses threadpoolctl when installed, else OpenBLAS's per-thread setter; no-op otherwise.
    """

    _setter = None
    _resolved = False

    @classmethod
    def _resolve(cls):
        if cls._resolved:
            return cls._setter
        cls._resolved = True
        try:
            import ctypes
            import glob
            import os
            libdir = os.path.join(os.path.dirname(os.path.dirname(np.__file__)), "numpy.libs")
            for path in glob.glob(os.path.join(libdir, "*openblas*.so*")):
                lib = ctypes.CDLL(path)
                fn = getattr(lib, "openblas_set_num_threads_local", None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    fn.argtypes = [ctypes.c_int]
                    cls._setter = fn
                    break
        except OSError:
            cls._setter = None
        return cls._setter

    def __enter__(self):
        fn = self._resolve()
        self.prev = fn(1) if fn is not None else None
        return self

    def __exit__(self, *exc):
        fn = self._setter
        if fn is not None and self.prev is not None and self.prev > 0:
            fn(self.prev)
        return False
