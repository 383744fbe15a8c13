"""Copies between neuron devices for single-process data parallelism, as ``torch.cuda.comm``.

``torch.nn.DataParallel`` and ``torch.nn.parallel.comm`` (``broadcast``, ``broadcast_coalesced``,
``scatter``, ``gather``, ``reduce_add``...) reach the device through seven ``torch._C``
primitives taking device indices (``_broadcast``, ``_broadcast_out``, ``_broadcast_coalesced``,
``_scatter``, ``_scatter_out``, ``_gather``, ``_gather_out``). PyTorch defines them only in CUDA
builds (torch/csrc/cuda/comm.cpp), so on a CPU build ``DataParallel`` on neuron failed with
"module 'torch._C' has no attribute '_scatter'". :func:`install` defines them there with the
same semantics for neuron devices (indices name neuron devices, -1 or "cpu" the host where
CUDA's accept it). Neuron devices share the host's memory, so each transfer is a device copy
queued like any other, on the destination's current stream or the stream given; CUDA's
coalescing of small tensors (one NCCL/cudaMemcpy per buffer) would only add copies here.

This module also re-exports ``torch.nn.parallel.comm``'s functions, as ``torch.cuda.comm`` does.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.nn.parallel.comm import (broadcast, broadcast_coalesced, gather, reduce_add,
                                    reduce_add_coalesced, scatter)

__all__ = ["broadcast", "broadcast_coalesced", "reduce_add", "reduce_add_coalesced", "scatter", "gather"]

_PRIMITIVES = ("_broadcast", "_broadcast_out", "_broadcast_coalesced", "_scatter", "_scatter_out",
               "_gather", "_gather_out")


def _device(index: int) -> torch.device:
    return torch.device("cpu") if index == -1 else torch.device("neuron", index)


def _check_devices(devices: Sequence[int], what: str) -> None:
    if len(devices) == 0:
        raise RuntimeError(f"{what}: expected at least one device")
    for d in devices:
        if not isinstance(d, int) or not 0 <= d < torch.neuron.device_count():
            raise RuntimeError(f"{what}: {d!r} is not a neuron device index "
                               f"(0..{torch.neuron.device_count() - 1})")


def _to(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A tensor already on the device is returned itself (copy=False), as CUDA's comm does. To
    # the host, a blocking copy: a non-blocking one would land in pinned memory still being
    # written when the host reads it (CUDA's comm copies into pageable memory, which waits too).
    return t.to(device, non_blocking=device.type != "cpu")


def _broadcast(tensor: torch.Tensor, devices: Sequence[int]) -> list[torch.Tensor]:
    _check_devices(devices, "broadcast")
    return [_to(tensor, _device(d)) for d in devices]


def _broadcast_out(tensor: torch.Tensor, out: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    for i, o in enumerate(out):
        if o.device.type != "neuron":
            raise RuntimeError(f"broadcast: out[{i}] is on {o.device}; every output must be a neuron tensor")
        if o.shape != tensor.shape:
            raise RuntimeError(f"broadcast: out[{i}] has shape {tuple(o.shape)}, expected {tuple(tensor.shape)}")
        o.copy_(tensor, non_blocking=True)
    return list(out)


def _broadcast_coalesced(tensors: Sequence[torch.Tensor], devices: Sequence[int],
                         buffer_size: int) -> list[list[torch.Tensor]]:
    _check_devices(devices, "broadcast_coalesced")
    for t in tensors:
        if t.device != _device(devices[0]):
            raise RuntimeError(f"broadcast_coalesced: all tensors must be on devices[0] "
                               f"(neuron:{devices[0]}), got one on {t.device}")
    # The source device's "copies" are the tensors themselves; the others get fresh tensors,
    # each with its own version counter.
    return [list(tensors)] + [[t.to(_device(d), non_blocking=True, copy=True) for t in tensors]
                              for d in devices[1:]]


def _chunks(tensor: torch.Tensor, n: int, chunk_sizes: Optional[Sequence[int]], dim: int,
            what: str) -> list[torch.Tensor]:
    if chunk_sizes is None:
        return list(tensor.chunk(n, dim))
    if len(chunk_sizes) != n:
        raise RuntimeError(f"{what}: {len(chunk_sizes)} chunk sizes for {n} devices")
    if sum(chunk_sizes) != tensor.size(dim) or any(c < 0 for c in chunk_sizes):
        raise RuntimeError(f"{what}: chunk sizes {list(chunk_sizes)} do not sum to the size of "
                           f"dimension {dim} ({tensor.size(dim)})")
    return list(tensor.split(list(chunk_sizes), dim))


def _scatter(tensor: torch.Tensor, devices: Sequence[int], chunk_sizes: Optional[Sequence[int]],
             dim: int, streams: Optional[Sequence[Optional[torch.Stream]]]) -> list[torch.Tensor]:
    _check_devices(devices, "scatter")
    chunks = _chunks(tensor, len(devices), chunk_sizes, dim, "scatter")
    out = []
    for i, chunk in enumerate(chunks):
        with torch.neuron.stream(streams[i] if streams else None):  # (None: the current stream)
            out.append(_to(chunk, _device(devices[i])))
    return out


def _scatter_out(tensor: torch.Tensor, out: Sequence[torch.Tensor], dim: int,
                 streams: Optional[Sequence[Optional[torch.Stream]]]) -> list[torch.Tensor]:
    if len(out) == 0:
        raise RuntimeError("scatter: expected at least one output tensor")
    chunks = _chunks(tensor, len(out), [o.size(dim) for o in out], dim, "scatter")
    for i, (chunk, o) in enumerate(zip(chunks, out)):
        if o.shape != chunk.shape:
            raise RuntimeError(f"scatter: out[{i}] has shape {tuple(o.shape)}, expected {tuple(chunk.shape)}")
        with torch.neuron.stream(streams[i] if streams else None):
            o.copy_(chunk, non_blocking=True)
    return list(out)


def _check_gather(tensors: Sequence[torch.Tensor], dim: int) -> None:
    if len(tensors) == 0:
        raise RuntimeError("gather: expected at least one tensor")
    first = tensors[0]
    d = dim % max(first.dim(), 1)
    for i, t in enumerate(tensors):
        if t.device.type != "neuron":
            raise RuntimeError(f"gather: tensor {i} is on {t.device}; gather takes neuron tensors")
        if t.dim() != first.dim() or any(a != b for k, (a, b) in enumerate(zip(t.shape, first.shape)) if k != d):
            raise RuntimeError(f"gather: tensor {i} has shape {tuple(t.shape)}, which does not match "
                               f"{tuple(first.shape)} outside dimension {dim}")


def _gather(tensors: Sequence[torch.Tensor], dim: int, destination: Optional[int]) -> torch.Tensor:
    _check_gather(tensors, dim)
    dest = _device(torch.neuron.current_device() if destination is None else destination)
    if dest.type == "neuron":
        _check_devices([dest.index], "gather")
    return torch.cat([_to(t, dest) for t in tensors], dim)


def _gather_out(tensors: Sequence[torch.Tensor], out: torch.Tensor, dim: int) -> torch.Tensor:
    _check_gather(tensors, dim)
    return torch.cat([_to(t, out.device) for t in tensors], dim, out=out)


def install() -> None:
    """Define the primitives on ``torch._C`` where this torch build has none (CPU builds)."""
    if hasattr(torch._C, "_scatter"):  # a CUDA build: its indices mean CUDA devices
        return
    for name in _PRIMITIVES:
        setattr(torch._C, name, globals()[name])
