"""PyTorch integration: calling ``@nki.jit`` kernels on torch tensors, and ``nki_op``.

* ``kernel(*tensors)`` with CPU or ``neuron`` tensors runs the kernel on the simulator: device
  tensors are copied to the host, the kernel runs, outputs come back on the input's device and
  inputs the kernel wrote are copied back. Output metadata (shapes, dtypes) is cached per
  kernel, LNC degree, argument shapes/dtypes and constant arguments -- the specialisation key
  of the NKI compiler -- so shape inference under ``FakeTensorMode`` is a cache hit after the
  first call (or a timing-only run otherwise).
* :func:`nki_op` registers a function that calls kernels as a ``torch.library.custom_op`` with
  an automatic fake (meta) implementation, so it stays one node inside ``torch.compile`` and
  supports ``register_autograd``.

This module imports torch; the rest of ``torchneuron.nki`` does not.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import numpy as np
import torch

from . import dtypes as dt
from .simulator import numpy_to_torch, run

_spec_cache: dict = {}


def _is_fake(t: torch.Tensor) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
        if is_fake(t):
            return True
    except ImportError:  # pragma: no cover
        pass
    return t.device.type == "meta"


def _key_of(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("T", tuple(int(s) for s in v.shape), str(v.dtype))
    if isinstance(v, np.ndarray):
        return ("A", v.shape, str(v.dtype))
    if isinstance(v, (tuple, list)):
        return (type(v).__name__,) + tuple(_key_of(e) for e in v)
    if isinstance(v, dict):
        return ("D",) + tuple(sorted((k, _key_of(e)) for k, e in v.items()))
    try:
        hash(v)
        return ("C", v)
    except TypeError:
        return ("R", repr(v))


def specialization_key(kernel: Any, lnc: int, args: tuple, kwargs: dict) -> tuple:
    """The compile-cache key: kernel, LNC degree, shapes/dtypes and constant arguments."""
    return (id(getattr(kernel, "fn", kernel)), lnc, _key_of(args), _key_of(kwargs))


def _map(v: Any, f: Callable) -> Any:
    if isinstance(v, torch.Tensor):
        return f(v)
    if isinstance(v, tuple):
        return tuple(_map(e, f) for e in v)
    if isinstance(v, list):
        return [_map(e, f) for e in v]
    if isinstance(v, dict):
        return {k: _map(e, f) for k, e in v.items()}
    return v


def _tensors(v: Any) -> list:
    out: list = []
    _map(v, lambda t: out.append(t) or t)
    return out


def _spec(outputs: Any) -> Any:
    if isinstance(outputs, np.ndarray):
        return ("out", outputs.shape, outputs.dtype)
    if isinstance(outputs, (tuple, list)):
        return type(outputs)(_spec(o) for o in outputs)
    return outputs


def _np_zeros(t: torch.Tensor) -> np.ndarray:
    d = dt.as_dtype(t.dtype)
    return np.zeros(tuple(int(s) for s in t.shape), dtype=dt.storage(d))


def _fake_outputs(spec: Any, device: torch.device) -> Any:
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "out":
        tdt = numpy_to_torch(np.zeros((), spec[2])).dtype
        return torch.empty(spec[1], dtype=tdt, device=device)
    if isinstance(spec, (tuple, list)):
        return type(spec)(_fake_outputs(s, device) for s in spec)
    return spec


def _written(h: torch.Tensor, arrays: list | None) -> bool:
    """Whether the host copy ``h`` of a device input shares memory with a written input."""
    if arrays is None:
        return True
    if not arrays:
        return False
    hv = h.view(torch.int16) if h.dtype == torch.bfloat16 else h
    try:
        hn = hv.numpy()
    except (TypeError, RuntimeError):  # dtypes numpy cannot view: be conservative
        return True
    return any(np.shares_memory(hn, a) for a in arrays)


def call_kernel(kernel: Any, lnc: int, args: tuple, kwargs: dict, grid_ndim: int = 1) -> Any:
    """Run an ``@nki.jit`` kernel on torch tensors (CPU, neuron, or fake for shape inference)."""
    fn = getattr(kernel, "fn", kernel)
    tensors = _tensors((args, kwargs))
    key = specialization_key(kernel, lnc, args, kwargs)
    if grid_ndim:  # kernel[lnc](...) (nl.program_ndim() == 1) may specialise differently
        key = key + ("grid",)
    device = tensors[0].device if tensors else torch.device("cpu")
    if any(_is_fake(t) for t in tensors):
        spec = _spec_cache.get(key)
        if spec is None:
            # Shape inference: a timing-only run on zero arrays gives the output shapes.
            na = _map(args, _np_zeros)
            nk = _map(kwargs, _np_zeros)
            spec = _spec(run(fn, na, nk, lnc=lnc, numerics=False, grid_ndim=grid_ndim).outputs)
            _spec_cache[key] = spec
        return _fake_outputs(spec, device)
    # While torch.profiler records neuron activities, the launch is one device activity
    # (torchneuron.profiler.nki); None otherwise.
    from ..profiler import nki as _prof

    act = _prof.begin(fn, tensors, device)
    try:
        host: dict[int, torch.Tensor] = {}

        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t
            h = t.detach().cpu()
            host[id(h)] = (t, h)
            return h
        hargs = _map(args, to_host)
        hkwargs = _map(kwargs, to_host)
        res = run(fn, hargs, hkwargs, lnc=lnc, grid_ndim=grid_ndim)
        _spec_cache[key] = _spec(res.outputs)
        for dev_t, h in host.values():
            # Kernels may write their inputs in place (as on the device): copy back the ones a
            # DMA wrote -- only those, so read-only inputs keep their autograd version counter.
            if _written(h, res.written_inputs):
                with torch.no_grad():
                    dev_t.copy_(h)
        out = numpy_to_torch(res.outputs)
        if device.type != "cpu":
            out = _map(out, lambda t: t.to(device))
    except BaseException:
        if act is not None:
            _prof.cancel(act)
        raise
    if act is not None:
        _prof.end(act, fn, res, _tensors(out))
    return out


def nki_op(name: str, fn: Callable | None = None, *, mutates_args: Iterable[str] | str = (),
           device_types: Any = None, schema: str | None = None) -> Any:
    """Register ``fn`` (a function calling NKI kernels) as ``torch.library.custom_op(name)``.

    The fake implementation is derived automatically (kernels run timing-only on zero inputs
    to get output shapes; cached per specialisation), so the op is a single node under
    ``torch.compile``. Use as a decorator::

        @nki_op("mylib::softmax", mutates_args=())
        def softmax(x: torch.Tensor) -> torch.Tensor:
            return softmax_kernel(x)

        softmax.register_autograd(backward, setup_context=setup)
    """
    def register(f: Callable):
        op = torch.library.custom_op(name, mutates_args=mutates_args, device_types=device_types,
                                     schema=schema)(f)

        def fake(*args, **kwargs):
            return f(*args, **kwargs)  # kernels see fake tensors and return fake outputs
        op.register_fake(fake)
        return op
    return register(fn) if fn is not None else register


__all__ = ["nki_op", "call_kernel", "specialization_key"]
