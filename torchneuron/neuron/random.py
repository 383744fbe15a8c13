"""Random number generation on neuron devices (``torch.neuron.random``), like ``torch.cuda.random``.

Each device has a default generator; ``torch.manual_seed`` seeds them all. Generators are
counter-based, as CUDA's: a state is 16 bytes (uint64 seed, int64 offset), random kernels compute
element ``i`` of an op from Philox4x32-10 at ``offset + i`` and advance the offset by the element
count rounded up to 4. So the numbers differ from CPU's for the same seed (as CUDA's do), and
DTensor's offset-based RNG tracker and ``torch.utils.checkpoint`` work as on CUDA.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from .. import _C
from ._utils import _get_device_index

__all__ = [
    "get_rng_state", "get_rng_state_all", "set_rng_state", "set_rng_state_all", "manual_seed",
    "manual_seed_all", "seed", "seed_all", "initial_seed", "default_generators",
]


def _generator(device: Any = None) -> torch.Generator:
    torch.neuron._lazy_init()
    index = _get_device_index(device, optional=True)
    torch.neuron._check_index(index)
    return _C._get_default_generator(index)


def __getattr__(name: str) -> Any:
    if name == "default_generators":
        torch.neuron._lazy_init()
        return tuple(_C._get_default_generator(i) for i in range(torch.neuron.device_count()))
    raise AttributeError(name)


def get_rng_state(device: Any = "neuron") -> torch.Tensor:
    """The RNG state of ``device`` as a 16-byte CPU ByteTensor: uint64 seed, int64 offset."""
    return _generator(device).get_state()


def get_rng_state_all() -> list[torch.Tensor]:
    """The RNG states of all devices."""
    return [get_rng_state(i) for i in range(torch.neuron.device_count())]


def set_rng_state(new_state: torch.Tensor, device: Any = "neuron") -> None:
    """Restore the RNG state of ``device`` (from :func:`get_rng_state`)."""
    with torch._C._DisableFuncTorch():
        _generator(device).set_state(new_state.clone(memory_format=torch.contiguous_format))


def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    """Restore the RNG states of all devices."""
    for i, state in enumerate(new_states):
        set_rng_state(state, i)


def manual_seed(seed: int) -> None:
    """Seed the current device's generator."""
    _generator(None).manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    """Seed every device's generator."""
    for i in range(torch.neuron.device_count()):
        _generator(i).manual_seed(int(seed))


def seed() -> None:
    """Seed the current device's generator with a random number."""
    _generator(None).seed()


def seed_all() -> None:
    """Seed all devices with one random number."""
    s = _generator(None).seed()
    for i in range(torch.neuron.device_count()):
        _generator(i).manual_seed(s)


def initial_seed() -> int:
    """The current device's seed."""
    return _generator(None).initial_seed()
