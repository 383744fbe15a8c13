"""Estimate a model's Trainium step without running it: ATen ops captured on the meta device.

:func:`estimate_meta_step` runs a function over ``meta`` tensors (shapes only, no data, no
device memory) under a ``TorchDispatchMode`` that turns every non-view ATen op into a
:class:`~.records.DeviceRecord`, then replays the records on the estimated timeline with no
host gaps (the host is assumed to keep up, as a compiled graph or an asynchronous eager
runtime would). Useful for models too large to run on the emulator: the 1B-parameter
Llama-shaped benchmark in ``bench/profiler.py`` uses it.
"""

from __future__ import annotations

import itertools
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .estimate import Hardware, hardware
from .estimate_timeline import build_timeline, summarize
from .records import DeviceRecord, TensorMeta

__all__ = ["estimate_meta_step", "capture_meta_records"]

_SKIP = {"detach", "view", "_unsafe_view", "alias", "t", "transpose", "permute", "expand",
         "unsqueeze", "squeeze", "select", "slice", "as_strided", "split", "split_with_sizes",
         "unbind", "reshape", "_reshape_alias", "empty", "empty_like", "empty_strided",
         "lift_fresh", "_to_copy_meta", "clone_meta", "set_", "resize_", "sym_size", "sym_stride",
         "is_same_size", "_local_scalar_dense", "new_empty", "new_empty_strided", "zeros_like_meta"}


def _meta(t: torch.Tensor, written: bool) -> TensorMeta:
    key = t.untyped_storage()._cdata if t.layout == torch.strided else id(t)
    return TensorMeta(str(t.dtype).replace("torch.", ""), tuple(t.shape), tuple(t.stride()), key, 0,
                      t.storage_offset(), written, not written, False)


class _Capture(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.records: list[DeviceRecord] = []
        self._ids = itertools.count(1)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name.split("::")[-1]
        if name in _SKIP or getattr(func, "is_view", False):
            return out
        ins = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not outs and not ins:
            return out
        overload = func._overloadname
        rid = next(self._ids)
        tensors = [_meta(t, False) for t in ins] + [_meta(t, True) for t in outs]
        # Launch times 1 ns apart: the host never holds the device back.
        self.records.append(DeviceRecord(rid, "kernel", "nc::" + name + ("" if overload == "default" else "." + overload),
                                         0, 0, 1, rid, rid, rid, rid, tensors=tensors))
        return out


def capture_meta_records(fn: Callable[[], Any]) -> list[DeviceRecord]:
    """The device records of ``fn()`` run on meta tensors."""
    cap = _Capture()
    with cap:
        fn()
    return cap.records


def estimate_meta_step(fn: Callable[[], Any], hw: Hardware | None = None) -> dict:
    """Estimated step of ``fn()`` (on meta tensors) on ``hw`` (default: the configured platform):
    ``{"est_ns", "busy_ns", "flops", "bytes", "mfu", "mbu", "kernels", ...}``."""
    hw = hw or hardware()
    recs = capture_meta_records(fn)
    tl = build_timeline(recs, hw)
    out = summarize(tl)
    by_engine: dict[str, float] = {}
    for e in tl.device_items():
        by_engine[e.cost.engine] = by_engine.get(e.cost.engine, 0.0) + e.cost.est_ns
    out["by_engine_ns"] = by_engine
    return out
