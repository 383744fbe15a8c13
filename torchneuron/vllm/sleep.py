"""vLLM's sleep mode on neuron (``LLM(enable_sleep_mode=True)``, ``llm.sleep()`` / ``wake_up()``).

On CUDA vLLM builds it on ``CuMemAllocator``: allocations made under a tag (``weights``,
``kv_cache``, ...) come from a memory pool whose physical pages can be unmapped and mapped again
at the same virtual addresses. neuron's caching allocator has the same mechanism
(``torch.neuron.MemPool`` with ``remappable`` segments: reserved address space over the device's
heap file, pages mapped and unmapped in place). So each tag gets such a pool; sleeping copies the
tags to offload into host memory, then gives every page back to the device; waking maps them
again and restores the copies (the rest reads as zeros). Tensors keep their data pointers
throughout, so the model and its KV cache need no rebuilding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from vllm.device_allocator import DEFERRABLE_TAGS
from vllm.device_allocator.sleep_mode_backend import SleepModeBackend
from vllm.logger import init_logger

from .. import _C

__all__ = ["NeuronSleepAllocator", "NeuronSleepModeBackend", "release_sleep_allocator", "sleep_allocator"]

logger = init_logger(__name__)


class _SleepPool(torch.neuron.MemPool):
    """A MemPool whose segments can sleep (remappable)."""

    def __init__(self) -> None:
        super().__init__(_remappable=True)

    def bytes(self) -> int:
        return sum(s["total_size"] for s in self.snapshot())


class NeuronSleepAllocator:
    """The tagged pools of one worker process (``CuMemAllocator``'s interface)."""

    default_tag = "default"

    def __init__(self) -> None:
        self._pools: dict[str, _SleepPool] = {}
        self._asleep: dict[str, bool] = {}  # tag -> offloaded when it went to sleep

    @contextlib.contextmanager
    def use_memory_pool(self, tag: str | None = None) -> Iterator[None]:
        """Allocations inside come from ``tag``'s pool."""
        tag = tag or self.default_tag
        pool = self._pools.get(tag)
        if pool is None:
            pool = self._pools[tag] = _SleepPool()
        with torch.neuron.use_mem_pool(pool):
            yield

    def sleep(self, offload_tags: tuple[str, ...] | str | None = None) -> None:
        """Give every tag's pages back to the device; those of ``offload_tags`` (default: the
        default tag) are copied to host memory first. A tag already asleep keeps its policy."""
        if offload_tags is None:
            offload_tags = (self.default_tag,)
        elif isinstance(offload_tags, str):
            offload_tags = (offload_tags,)
        freed = kept = 0
        for tag in self._pools:
            offload = tag in offload_tags
            size = self._put_to_sleep(tag, offload)
            freed += size
            kept += size if offload else 0
        logger.info("neuron sleep mode: freed %.3f GiB of device memory, %.3f GiB of it kept in host "
                    "memory", freed / 2**30, kept / 2**30)

    def discard(self, tags: tuple[str, ...] | str) -> None:
        """Give ``tags``' pages back without keeping their contents."""
        for tag in (tags,) if isinstance(tags, str) else tags:
            if tag in self._pools:
                self._put_to_sleep(tag, False)

    def _put_to_sleep(self, tag: str, offload: bool) -> int:
        """Unmap ``tag``'s pages (copied to host memory first with ``offload``) unless it is
        asleep already; the bytes it gave back."""
        if tag in self._asleep:
            return 0
        pool = self._pools[tag]
        size = pool.bytes()
        _C._mem_pool_sleep(pool._id, offload)
        self._asleep[tag] = offload
        return size

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Map the pages of ``tags`` (default: all) again, restoring what was offloaded. As
        CuMemAllocator: only the deferrable tags (weights, kv_cache) wait for their turn; every
        other tag wakes with the first call."""
        for tag in list(self._asleep):
            if tags is None or tag in tags or tag not in DEFERRABLE_TAGS:
                del self._asleep[tag]
                _C._mem_pool_wake(self._pools[tag]._id)

    def get_current_usage(self) -> int:
        """Bytes the pools hold (mapped or asleep)."""
        return sum(pool.bytes() for pool in self._pools.values())

    def release(self) -> None:
        """Let the pools go (the engine shut down): their idle memory returns to the device, and
        blocks still held join the device's pool, freed with their tensors. A live pool keeps
        its cached memory otherwise, so a later engine in the process would find it taken."""
        self.wake_up()
        self._pools.clear()


_instance: NeuronSleepAllocator | None = None


def sleep_allocator() -> NeuronSleepAllocator:
    """This process's allocator: the engine's (one at a time per process, as CuMemAllocator)."""
    global _instance
    if _instance is None:
        _instance = NeuronSleepAllocator()
    return _instance


def release_sleep_allocator() -> None:
    """Release this process's allocator, if any (the worker's shutdown)."""
    global _instance
    if _instance is not None:
        _instance.release()
        _instance = None


class NeuronSleepModeBackend(SleepModeBackend):
    """vLLM's sleep-mode backend on neuron: ``CuMemBackend``'s policy over the allocator above
    (level 1 keeps the weights in host memory, level 2 discards them; runtime state is kept at
    both levels)."""

    def suspend(self, level: int = 1) -> None:
        self._state = "SUSPENDED"
        offload: tuple[str, ...] = ("runtime", "cudagraph")
        if level == 1:
            offload = ("weights", *offload)
        sleep_allocator().sleep(offload_tags=offload)

    def resume(self, tags: list[str] | None = None) -> None:
        self._state = "RESUMING"
        sleep_allocator().wake_up(tags)
        self._state = "RUNNING"

    def discard(self, tags: tuple[str, ...]) -> None:
        sleep_allocator().discard(tags)
        self._state = "SUSPENDED"

    @classmethod
    def preserves_communicators(cls) -> bool:
        return True
