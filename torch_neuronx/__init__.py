"""``torch_neuronx``: AWS TorchNeuron's import name, provided by torchneuron.

Libraries that support Trainium look for this package to decide that a Neuron device is
present: accelerate (``utils.imports.is_neuron_available``), transformers
(``utils.import_utils.is_torch_neuron_available``, which also gates ``TrainingArguments(bf16=True)``
and picks ``torch_compile_backend="neuron"``), optimum (``is_neuronx_available``). After that they
use only ``torch.neuron`` and the ``neuron`` device, process-group backend and compile backend,
which torchneuron provides. Importing this package loads the backend (as ``import torch`` already
does through autoload) and re-exports the names AWS's package has at its top level, where
torchneuron has them; it holds no logic of its own. See docs/ecosystem.md.

``__version__`` follows torch-neuronx's ``<torch release>.<build version>`` form (code such as
optimum-neuron splits it as ``version.split(".", 3)``): torch 2.13.0 with torchneuron 0.1.0 gives
``"2.13.0.0.1.0"``.
"""

from __future__ import annotations

from typing import Any

import torch
import torchneuron
from torch.neuron import (Event, Stream, empty_cache, max_memory_allocated, max_memory_reserved,
                          mem_get_info, memory_allocated, memory_reserved, memory_snapshot,
                          memory_stats, memory_summary, reset_accumulated_memory_stats,
                          reset_peak_memory_stats)
from torchneuron import clear_op_tracking, get_executed_ops, get_fallback_ops

from . import neuron_dynamo_backend

__version__ = f"{torch.__version__.split('+')[0]}.{torchneuron.__version__}"

__all__ = [
    "__version__",
    # op tracking
    "get_executed_ops", "get_fallback_ops", "clear_op_tracking",
    # streams, events
    "Stream", "Event",
    # memory_* functions
    "memory_stats", "memory_allocated", "max_memory_allocated", "memory_reserved",
    "max_memory_reserved", "reset_peak_memory_stats", "reset_accumulated_memory_stats",
    "memory_summary", "memory_snapshot", "mem_get_info", "empty_cache",
    # NKI
    "nki_op",
    # compile
    "neuron_dynamo_backend",
]


def __getattr__(name: str) -> Any:
    # NKI's torch integration imports the NKI tracer and simulator (~60 ms): loaded on use.
    if name == "nki_op":
        from torchneuron.nki.torch_ops import nki_op

        return nki_op
    raise AttributeError(f"module 'torch_neuronx' has no attribute {name!r}")
