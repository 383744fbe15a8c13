"""``NeuronPlatform``: vLLM's view of the ``neuron`` device.

A real device platform (like vLLM's XPU one), not a CPU platform in disguise: ``device_type``
is ``"neuron"``, so weights, KV cache and activations are ``neuron:N`` tensors, vLLM's own
``torch.ops.vllm.*`` ops register under ``PrivateUse1``, and vLLM's ``is_cpu()`` branches
(oneDNN linears, CPU-keyed ``_C`` kernels) are off: custom ops run their ``forward_native``
torch code on the device. Memory figures are the emulated HBM's (``torch.neuron``), not host
RAM.

What this platform chooses, and why:

* attention: torchneuron's paged-attention backend ``NEURON_ATTN`` (default), or vLLM's
  ``CPU_ATTN`` kernels as a fallback (they read device memory through host pointers, which
  is valid because the emulated HBM is host memory and execution is synchronous);
* compilation: vLLM's ``DYNAMO_TRACE_ONCE`` mode with torchneuron's ``neuron`` torch.compile
  backend instead of ``VLLM_COMPILE`` (whose Inductor pipeline is CUDA-graph oriented);
  ``enforce_eager=True`` runs eagerly;
* graphs: unless ``enforce_eager=True``, vLLM's full decode graphs (``FULL_DECODE_ONLY``; other
  modes are lowered to it): every uniform decode batch size vLLM captures is a
  ``torch.neuron.NeuronGraph`` of the whole forward, replayed over vLLM's persistent input,
  block-table, length and slot buffers (the model runner maps vLLM's ``torch.cuda`` graph calls;
  ``NEURON_ATTN`` and torchneuron's vLLM kernels are queued, hence capturable). Mixed
  prefill/decode batches run eagerly; with more than one worker, graphs are off;
* distributed: the ``neuron`` c10d backend for device groups (gloo for vLLM's CPU groups);
* workers start with ``spawn``: the neuron runtime, like CUDA's, refuses use in a forked child
  of an initialised parent;
* no async scheduling: measured with the execution engine (the model runner's torch.cuda event
  and stream mapped at sampling), it gave the same tokens and no gain on a 2-core host (the
  host thread preparing step n + 1 competes with the device thread running step n):
  bench/serving.py with decode graphs 0.74 of vLLM's CPU platform against 0.86 without.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from vllm.logger import init_logger
from vllm.platforms.interface import DeviceCapability, Platform, PlatformEnum

from . import ATTENTION_BACKEND

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kernel import IrOpPriorityConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

__all__ = ["NeuronPlatform"]

logger = init_logger(__name__)

_ATTN_CLASS = "torchneuron.vllm.attention.NeuronAttentionBackend"
_WORKER_CLASS = "torchneuron.vllm.worker.NeuronWorker"


def _register_attention_backend() -> None:
    """Make ``NEURON_ATTN`` a member of vLLM's attention-backend registry (idempotent)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if ATTENTION_BACKEND not in AttentionBackendEnum.__members__:
        register_backend(ATTENTION_BACKEND, _ATTN_CLASS)


_register_attention_backend()


# Whether vLLM's replacements of its Triton kernels are registered in this process.
_triton_overrides_registered = False


class NeuronPlatform(Platform):
    """vLLM platform for torchneuron's ``neuron`` device (PrivateUse1)."""

    _enum = PlatformEnum.OOT
    device_name: str = "neuron"
    device_type: str = "neuron"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "neuron_cores"
    device_control_env_var: str = "NEURON_RT_VISIBLE_CORES"
    dist_backend: str = "neuron"
    # small helpers vLLM compiles by itself (sampler ops, some custom ops); the model's own
    # compilation is configured in check_and_update_config
    simple_compile_backend: str = "neuron"
    supported_quantization: list[str] = []

    @property
    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    # ---- device ---------------------------------------------------------------------------
    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.neuron.get_device_name(device_id)

    @classmethod
    def get_device_uuid(cls, device_id: int = 0) -> str:
        props = torch.neuron.get_device_properties(device_id)
        return f"neuron-{props.platform}-chip{props.chip}-core{props.logical_core}"

    @classmethod
    def get_device_capability(cls, device_id: int = 0) -> DeviceCapability | None:
        # None, as vLLM's CPU and TPU platforms: vLLM compares capabilities with CUDA SM
        # versions (quantization methods' minimum capability, kernel choices), which a
        # NeuronCore version (torch.neuron.get_device_capability, 3.0 on trn2) is not; as "30"
        # it refused FP8 ("minimum capability 75")
        return None

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        """HBM capacity of the (emulated) device, from the platform table or
        ``TORCHNEURON_DEVICE_MEMORY``."""
        return torch.neuron.get_device_properties(device_id).total_memory

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        torch.neuron.reset_peak_memory_stats(device)
        return torch.neuron.max_memory_allocated(device)

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.neuron.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.neuron.manual_seed_all(seed)

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"neuron: model dtype {dtype} is not supported; use bfloat16, "
                             "float16 or float32")

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        # torch.neuron.NeuronGraph captures the engine's kernels (csrc/backend/graph.cpp)
        return True

    @classmethod
    def get_static_graph_wrapper_cls(cls) -> str:
        # vLLM's wrapper; NeuronModelRunner.capture_model maps its torch.cuda graph calls
        return "vllm.compilation.cuda_graph.CUDAGraphWrapper"

    def is_sleep_mode_available(self) -> bool:
        # remappable memory pools (torchneuron/vllm/sleep.py)
        return True

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        # host and device memory are the same memory: a pinned staging buffer buys nothing
        return False

    @classmethod
    def num_compute_units(cls, device_id: int = 0) -> int:
        return torch.neuron.get_device_properties(device_id).multi_processor_count

    # ---- kernels and attention ------------------------------------------------------------
    @classmethod
    def import_kernels(cls) -> None:
        # vLLM's CPU kernels (CPU_ATTN fallback, slot-mapping helpers): host code over host
        # pointers, valid on the emulated device whose memory is host memory once the device's
        # queued kernels have run (host_kernels.py)
        from vllm.platforms.cpu import CpuPlatform

        from .host_kernels import order_after_queue

        CpuPlatform.import_kernels()
        order_after_queue()

    @classmethod
    def import_ir_kernels(cls) -> None:
        super().import_ir_kernels()
        from .ops import register_ir_kernels

        register_ir_kernels()

    @classmethod
    def get_default_ir_op_priority(cls, vllm_config: "VllmConfig") -> "IrOpPriorityConfig":
        # RMSNorm as one neuron kernel call, eager and compiled alike: under the `neuron`
        # backend the IR op stays an opaque node that dispatches at run time
        from vllm.config.kernel import IrOpPriorityConfig

        from .ops import IR_PROVIDER

        norm = [IR_PROVIDER, "native"]
        return IrOpPriorityConfig.with_default(["native"], rms_norm=norm, fused_add_rms_norm=norm)

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # no Triton here: vLLM's C++ replacements of its Triton kernels (slot mapping,
        # rejection sampling) operate on host pointers, as CPU_ATTN does, after the device's
        # queued kernels (host_kernels.py: wrapped before vLLM registers them)
        from vllm.platforms.cpu import CpuPlatform

        from .host_kernels import order_after_queue

        global _triton_overrides_registered
        order_after_queue()
        # Once per process: the replacements stay bound (modules imported later take them from
        # their defining modules), and vLLM's registration rescans every module, which fails
        # once numba is loaded (vLLM's n-gram proposer: llvmlite's library object answers any
        # attribute, __dict__ included), so a second engine in the process could not start.
        if not _triton_overrides_registered:
            CpuPlatform.register_triton_kernel_overrides()
            _triton_overrides_registered = True

    @classmethod
    def get_attn_backend_cls(cls, selected_backend: "AttentionBackendEnum | None",
                             attn_selector_config: "AttentionSelectorConfig",
                             num_heads: int | None = None) -> str:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError(
                "neuron: MLA and sparse attention are not implemented by torchneuron's vLLM "
                "platform; serve a model with standard (GQA/MHA) attention")
        name = None if selected_backend is None else selected_backend.name
        if name in (None, ATTENTION_BACKEND):
            logger.info_once("Using torchneuron's %s attention backend.", ATTENTION_BACKEND)
            return _ATTN_CLASS
        if selected_backend == AttentionBackendEnum.CPU_ATTN:
            logger.info_once("Using vLLM's CPU_ATTN kernels on neuron memory.")
            return AttentionBackendEnum.CPU_ATTN.get_path()
        raise ValueError(
            f"neuron: attention backend {name!r} is not available on the neuron platform; "
            f"use {ATTENTION_BACKEND!r} (default) or 'CPU_ATTN'")

    @classmethod
    def opaque_attention_op(cls) -> bool:
        # attention stays one custom op in compiled graphs: the paged-KV loop is eager code
        return True

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return "torchneuron.vllm.communicator.NeuronCommunicator"

    @classmethod
    def get_punica_wrapper(cls) -> str:
        # vLLM's PyTorch-native multi-LoRA ops (index_select, einsum, index_add over the
        # batch's adapter indices), as on its CPU platform: they run on neuron as any torch code
        return "vllm.lora.punica_wrapper.punica_cpu.PunicaWrapperCPU"

    # ---- configuration ---------------------------------------------------------------------
    @classmethod
    def check_and_update_config(cls, vllm_config: "VllmConfig") -> None:
        from vllm.config import CompilationMode
        from vllm.config.compilation import CUDAGraphMode

        if vllm_config.scheduler_config is not None:
            vllm_config.scheduler_config.async_scheduling = False

        parallel_config = vllm_config.parallel_config
        if parallel_config.worker_cls == "auto":
            parallel_config.worker_cls = _WORKER_CLASS
        if parallel_config.enable_dbo:
            logger.warning_once("neuron: dual-batch overlap is not supported; disabled.")
            parallel_config.enable_dbo = False

        compilation_config = vllm_config.compilation_config
        if vllm_config.lora_config is not None:
            # Multi-LoRA serving runs vLLM's PyTorch-native punica ops (get_punica_wrapper), which
            # branch in Python on prefill vs decode and on per-step sizes (a model traced once
            # would keep the first step's branch and sizes: wrong tokens), and whose prefill
            # path has data-dependent shapes (repeat_interleave by sequence lengths: not
            # capturable). As vLLM's CPU platform: model code eager, no graphs.
            if compilation_config.mode != CompilationMode.NONE or compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
                logger.info_once("neuron: LoRA serving runs the model eagerly (no compilation, no graphs)")
            compilation_config.mode = CompilationMode.NONE
            compilation_config.cudagraph_mode = CUDAGraphMode.NONE
        if compilation_config.cudagraph_mode != CUDAGraphMode.NONE:
            if parallel_config.world_size > 1:
                # vLLM's graph_capture() takes CUDA/XPU communicators only, and the neuron
                # c10d backend's collectives are not captured by NeuronGraph
                logger.warning_once("neuron: decode graphs need one worker (got %d); running "
                                    "eagerly", parallel_config.world_size)
                compilation_config.cudagraph_mode = CUDAGraphMode.NONE
            elif compilation_config.cudagraph_mode != CUDAGraphMode.FULL_DECODE_ONLY:
                # PIECEWISE needs vLLM's own Inductor pipeline (VLLM_COMPILE), and NEURON_ATTN's
                # graphs hold uniform single-token decode batches only
                logger.info_once("neuron: cudagraph_mode %s -> FULL_DECODE_ONLY",
                                 compilation_config.cudagraph_mode.name)
                compilation_config.cudagraph_mode = CUDAGraphMode.FULL_DECODE_ONLY
        if compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
            compilation_config.cudagraph_capture_sizes = []
        if compilation_config.mode == CompilationMode.VLLM_COMPILE:
            # one Dynamo trace of the whole model (dynamic token count), compiled by the
            # `neuron` backend; the attention custom op stays a graph break-free opaque node
            compilation_config.mode = CompilationMode.DYNAMO_TRACE_ONCE
            compilation_config.backend = "neuron"

        # The neuron runtime refuses use in a forked child of an initialised parent (CUDA's
        # rule), so workers are spawned.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        # vLLM would run shared MoE experts on a side CUDA stream
        os.environ.setdefault("VLLM_DISABLE_SHARED_EXPERTS_STREAM", "1")
