"""torchneuron: an open, emulated TorchNeuron — the native PyTorch backend for AWS Trainium.

After installation ``import torch`` alone makes the ``neuron`` device usable (entry point group
``torch.backends``; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off, then ``import
torchneuron`` does it). The device is emulated: NeuronCores whose HBM is host memory and whose
kernels run on the host CPU, shaped like the real part (see :mod:`torchneuron.platform`).

This module must stay cheap to import: it runs inside ``import torch``. Nothing here imports
Dynamo, Inductor or the NKI simulator.
"""

from __future__ import annotations


def _autoload() -> None:
    """Entry point run at the end of ``import torch`` (group ``torch.backends``).

    Defined before ``import torch`` below: when ``import torchneuron`` comes first, that import
    runs torch's autoload, which finds this module half-initialised; the registration then
    happens when this module's own import continues."""
    if "_register" in globals():
        _register()


import torch  # noqa: E402

from . import platform  # noqa: E402

try:
    from . import _C  # noqa: E402
except ImportError as _exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "torchneuron's C++ core (torchneuron._C) is not built or does not match this torch; "
        "run `make build` in the torchneuron checkout (or set TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
        f"to import torch without it): {_exc}") from _exc

__version__ = "0.1.0"
__all__ = [
    "platform",
    "get_executed_ops",
    "get_fallback_ops",
    "clear_op_tracking",
    "set_op_tracking",
]


def _configure_runtime() -> None:
    """Hand the emulated topology to the C++ runtime. A bad environment variable must not
    break ``import torch``: it is remembered and raised on first use of the device."""
    try:
        topo = platform.topology()
    except ValueError as exc:
        _C._configure([], f"neuron is not usable: {exc}")
        return
    _C._configure([topo.memory_per_device] * topo.device_count, "")


def _register() -> None:
    if getattr(torch, "neuron", None) is not None and torch._C._get_privateuse1_backend_name() == "neuron":
        return
    _configure_runtime()
    torch.utils.rename_privateuse1_backend("neuron")
    from . import neuron as _device_module

    torch._register_device_module("neuron", _device_module)
    torch.utils.generate_methods_for_privateuse1_backend(
        for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True
    )
    from .neuron import ipc as _ipc  # neuron tensors across processes (torch.multiprocessing)

    _ipc.install()
    from .neuron import comm as _comm  # torch.nn.DataParallel's device copies

    _comm.install()


def _patch_dlpack() -> None:
    """``Tensor.__dlpack_device__`` knows no PrivateUse1 device in torch 2.13, although
    ``to_dlpack``/``from_dlpack`` round-trip neuron tensors as ``kDLExtDev``. Teach it the same
    mapping so the protocol form (``torch.from_dlpack(tensor)``) works too."""
    original = torch.Tensor.__dlpack_device__
    if getattr(original, "_torchneuron", False):
        return

    def __dlpack_device__(self):
        if self.device.type == "neuron":
            from torch.utils.dlpack import DLDeviceType

            return (DLDeviceType.kDLExtDev, self.device.index)
        return original(self)

    __dlpack_device__._torchneuron = True
    torch.Tensor.__dlpack_device__ = __dlpack_device__


def _let_autograd_threads_finish() -> None:
    """At exit, give autograd's neuron device threads a moment to drop their last graph task.

    Backward on neuron runs on an autograd device thread. After finishing a graph task that
    thread still releases it, which takes the GIL; if the main thread has meanwhile reached
    interpreter shutdown, the thread is killed mid-destructor and the process aborts
    ("terminate called without an active exception"). Releasing the GIL briefly here lets
    it finish first."""
    import time

    time.sleep(0.005)


def _run_backward_on_calling_thread() -> None:
    """Run neuron backward passes on the thread that calls ``backward()`` (this thread).

    Autograd normally hands non-CPU work to a per-device thread. Neuron kernels run on the host
    CPU, so that thread would start its own OpenMP team next to the caller's: on a 2-core
    machine the two teams fight and a GPT training step got 25% slower than on CPU. The device
    executes synchronously, so nothing is lost by staying on the calling thread (autograd's own
    ``set_multithreading_enabled(False)``; a thread-local default, set for the importing thread).
    """
    torch._C._set_multithreading_enabled(False)


_register()
_patch_dlpack()
from . import _conv_layout  # noqa: E402

_conv_layout.install()
from . import kernels as _kernels  # noqa: E402  (Python kernels: CUDA-only ops and dtypes)

_kernels.register()
_run_backward_on_calling_thread()
# Eager FlexAttention on neuron: flex_attention's device allow-list is patched when that module
# is first imported (a cheap import hook; no Dynamo or Inductor import here).
from .compile import install_import_hooks as _install_compile_hooks  # noqa: E402

_install_compile_hooks()


def _register_distributed() -> None:
    """Register the ``neuron`` c10d backend (about 1 ms: ``import torch`` already loaded
    ``torch.distributed``). A failure here must not break ``import torch``."""
    try:
        from . import distributed as _distributed

        _distributed.register()
    except Exception as exc:  # pragma: no cover - only on a broken install
        import warnings

        warnings.warn(f"torchneuron: distributed backend 'neuron' not registered: {exc}")


_register_distributed()


def _install_profiler_callbacks() -> None:
    """Let the kineto plugin reach torchneuron.profiler (imported only when a profiler session
    records neuron activities, so ``import torch`` stays cheap)."""

    def on_start() -> None:
        from .profiler import _session

        _session.on_start()

    def on_stop() -> None:
        from .profiler import _session

        _session.on_stop()

    def annotate(items):
        from .profiler import _session

        return _session.annotate(items)

    _C._profiler_set_callbacks(on_start, on_stop, annotate)


_install_profiler_callbacks()
if __import__("os").environ.get("TORCHNEURON_NKI_SDPA") == "1":
    from .nkilib import sdpa as _nki_sdpa  # kernels load lazily: the import is cheap

    _nki_sdpa.enable()
if __import__("os").environ.get("TORCHNEURON_NKI_GROUPED_MM") == "1":
    from .nkilib import gmm_routing as _nki_gmm  # routes torch._grouped_mm on neuron to NKI

    _nki_gmm.enable()
if __import__("os").environ.get("TORCHNEURON_STREAM_SANITIZER", "0") != "0":
    from .neuron import _sanitizer as _stream_sanitizer  # as TORCH_CUDA_SANITIZER in torch

    _stream_sanitizer._enable_from_env()
import atexit as _atexit  # noqa: E402

_atexit.register(_let_autograd_threads_finish)


def get_executed_ops() -> dict[str, int]:
    """ATen ops executed on neuron since the last :func:`clear_op_tracking`, with call counts."""
    return dict(sorted(_C._executed_ops(False)))


def get_fallback_ops() -> dict[str, int]:
    """Ops that ran through the generic boxed path (no dedicated neuron kernel), with counts.

    Every op runs on the device; these are the ones a dedicated kernel would speed up."""
    return dict(sorted(_C._executed_ops(True)))


def clear_op_tracking() -> None:
    """Forget the ops recorded so far (ops still queued run first: counts start from here)."""
    _C._clear_op_tracking()


def set_op_tracking(enabled: bool) -> None:
    """Turn op tracking on or off (on by default; it costs one hash update per op)."""
    _C._set_op_tracking(bool(enabled))
