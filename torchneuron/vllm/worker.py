"""``NeuronWorker``: one vLLM worker process driving one ``neuron:N`` device.

vLLM's GPU worker does the rest (model loading, memory profiling, KV-cache sizing, execution):
the KV cache gets ``gpu_memory_utilization`` of the device's HBM (``torch.neuron`` memory
statistics: capacity from the platform table or ``TORCHNEURON_DEVICE_MEMORY``) minus weights
and the profiled activation peak, as on a GPU. What differs here:

* device binding: ``neuron:<local_rank>``, ``LOCAL_RANK`` exported for torchneuron's c10d
  backend, which binds the process to that core;
* tensor parallelism through the ``neuron`` c10d backend (registered before vLLM creates its
  groups);
* sleep mode through neuron's remappable memory pools (sleep.py) instead of CUDA's
  CuMemAllocator, and no CUDA allocator settings;
* the emulated HBM is host memory, so a KV cache that the device could hold but the host
  cannot is refused with an error naming the knobs, instead of swapping the machine to death.
"""

from __future__ import annotations

import contextlib
import gc
import os

import psutil
import torch
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot, format_gib
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker.gpu_worker import Worker, init_worker_distributed_environment
from vllm.v1.worker.worker_base import CompilationTimes
from vllm.v1.worker.utils import request_memory

from .model_runner import NeuronModelRunner
from .sleep import NeuronSleepModeBackend, release_sleep_allocator, sleep_allocator

__all__ = ["NeuronWorker"]

logger = init_logger(__name__)


class NeuronWorker(Worker):
    """vLLM worker for one NeuronCore (``neuron:<local_rank>``)."""

    def init_device(self) -> None:
        import torchneuron.distributed as tnd

        from . import moe, ops, quantization

        moe.register()  # before the model is built
        ops.register()
        quantization.register()
        count = torch.neuron.device_count()
        if self.local_rank >= count:
            raise RuntimeError(
                f"neuron: worker local_rank {self.local_rank} needs neuron:{self.local_rank}, but "
                f"{count} device(s) are visible; lower tensor_parallel_size or expose more cores "
                "(NEURON_RT_VISIBLE_CORES, NEURON_LOGICAL_NC_CONFIG, TORCHNEURON_NUM_CHIPS)")
        self.device = torch.device("neuron", self.local_rank)
        # torchneuron's c10d backend binds the process to neuron:LOCAL_RANK
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(self.parallel_config.world_size)
        torch.neuron.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        tnd.register()
        init_worker_distributed_environment(self.vllm_config, self.rank,
                                            self.distributed_init_method, self.local_rank,
                                            current_platform.dist_backend)
        set_random_seed(self.model_config.seed)

        gc.collect()
        torch.neuron.empty_cache()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        logger.debug("neuron worker init memory snapshot: %r", self.init_snapshot)
        self._init_workspace_and_model_runner()

    def _make_model_runner(self) -> NeuronModelRunner:
        return NeuronModelRunner(self.vllm_config, self.device)

    def _maybe_get_memory_pool_context(self, tag: str) -> contextlib.AbstractContextManager:
        # sleep mode: each tag's allocations in a pool that can give its pages back (sleep.py)
        if self.vllm_config.model_config.enable_sleep_mode:
            return sleep_allocator().use_memory_pool(tag)
        return contextlib.nullcontext()

    def shutdown(self) -> None:
        super().shutdown()
        if self.vllm_config.model_config.enable_sleep_mode:
            release_sleep_allocator()  # a later engine of the process gets the memory back

    @property
    def sleep_mode_backend(self) -> NeuronSleepModeBackend:
        if self._sleep_mode_backend is None:
            self._sleep_mode_backend = NeuronSleepModeBackend()
        return self._sleep_mode_backend

    @contextlib.contextmanager
    def _scoped_allocator_max_split(self, max_split_size_mb: int):
        # CUDA allocator setting; torchneuron's allocator never splits large blocks for small
        # requests across size classes, so there is nothing to scope
        yield

    def compile_or_warm_up_model(self) -> CompilationTimes:
        """Warm up the model and sampler at the largest decode batch, then capture the decode
        graphs unless ``enforce_eager`` (vLLM's GPU worker does the same, with CUDA-only kernel
        warm-ups that do not apply)."""
        from vllm.config.compilation import CUDAGraphMode

        runner = self.model_runner
        max_num_reqs = min(self.scheduler_config.max_num_seqs,
                           self.scheduler_config.max_num_batched_tokens)
        hidden, last_hidden = runner._dummy_run(num_tokens=max_num_reqs, skip_eplb=True,
                                                cudagraph_runtime_mode=CUDAGraphMode.NONE)
        if runner.is_pooling_model:
            runner._dummy_pooler_run(hidden)
        else:
            runner._dummy_sampler_run(hidden_states=last_hidden)
        if not self.model_config.enforce_eager:
            runner.capture_model()
        # profiling and warm-up must not change what a seeded engine samples
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(language_model=self.compilation_config.compilation_time,
                                encoder=self.compilation_config.encoder_compilation_time)

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        host = psutil.virtual_memory().available
        if available > host * 0.9:
            raise RuntimeError(
                f"neuron: the KV cache would take {format_gib(available)} GiB of neuron:"
                f"{self.local_rank}'s emulated HBM, but the emulated HBM is host memory and only "
                f"{format_gib(host)} GiB are available; lower gpu_memory_utilization, set "
                "kv_cache_memory_bytes, or shrink the emulated device with "
                "TORCHNEURON_DEVICE_MEMORY (e.g. TORCHNEURON_DEVICE_MEMORY=2GiB)")
        return available
