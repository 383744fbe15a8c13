#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// torchneuron._C: the Python face of the C++ core. Only what Python cannot reach otherwise;
// memory stats go through torch.accelerator (which reads our DeviceAllocator).
#include <torch/csrc/Generator.h>
#include <torch/csrc/Storage.h>
// torch/csrc/utils/pybind.h, not torch/extension.h: the latter pulls in the whole C++ frontend
// (torch/all.h), which more than doubles this unit's compile time.
#include <torch/csrc/utils/pybind.h>

#include "backend/allocator.h"
#include "backend/amx_gemm.h"
#include "backend/bf16_gemm.h"
#include "backend/fp8.h"
#include "backend/fusion.h"
#include "backend/fusion_interpreter.h"
#include "backend/cpu_features.h"
#include "backend/gemm.h"
#include "backend/generator.h"
#include "backend/gpu_trace.h"
#include "backend/ipc.h"
#include "backend/nested.h"
#include "backend/small_attention.h"
#include "backend/sync_debug.h"
#include "backend/sparse.h"
#include "backend/zero_copy.h"
#include "runtime/engine.h"
#include "runtime/runtime.h"

namespace torchneuron {
void register_hooks();
void bind_cpu_kernel_call(py::module& m);
void bind_compiled_kernels(py::module& m);
void bind_memory_history(py::module& m);
namespace prof {
void bind_profiler(py::module& m);
}
}  // namespace torchneuron

namespace {

std::string g_config_error;

void configure(const std::vector<size_t>& capacities, const std::string& error) {
  g_config_error = error;
  neuron::rt::configure(capacities);
}

void lazy_init() {
  if (!g_config_error.empty()) throw std::runtime_error(g_config_error);
  neuron::rt::lazy_init();
}

py::object default_generator(int device) {
  torchneuron::check_device_index(device);
  const at::Generator& gen = torchneuron::default_generator(static_cast<c10::DeviceIndex>(device));
  return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(gen));
}

// Moves src's memory into dst (same size): dst's tensors and views now read src's bytes, without
// a new storage object, a version-counter bump or a view to update. The graph replays of
// compiled code (torchneuron/compile/graphs.py) hand out outputs over storages that alias a
// graph's static memory, and give one still in use private memory before the next replay
// overwrites that. src is left empty.
void storage_take_data(py::handle dst, py::handle src) {
  TORCH_CHECK(THPStorage_Check(dst.ptr()) && THPStorage_Check(src.ptr()), "_storage_take_data expects two storages");
  c10::StorageImpl* d = THPStorage_Unpack(dst.ptr()).unsafeGetStorageImpl();
  c10::StorageImpl* s = THPStorage_Unpack(src.ptr()).unsafeGetStorageImpl();
  TORCH_CHECK(d != s && d->nbytes() == s->nbytes() && d->device() == s->device(),
              "_storage_take_data: storages of different sizes or devices");
  d->set_data_ptr_noswap(s->set_data_ptr(c10::DataPtr(nullptr, s->device())));
  s->set_nbytes(0);
}

py::tuple ipc_export(py::handle storage) {
  TORCH_CHECK(THPStorage_Check(storage.ptr()), "_ipc_export expects a torch.UntypedStorage");
  auto h = torchneuron::ipc_export(THPStorage_Unpack(storage.ptr()));
  return py::make_tuple(h.device, h.fd, h.offset, h.nbytes, h.counter_offset);
}

py::object ipc_import(int device, int fd, size_t offset, size_t nbytes, size_t counter_offset) {
  c10::Storage storage = torchneuron::ipc_import({device, fd, offset, nbytes, counter_offset});
  return py::reinterpret_steal<py::object>(THPStorage_Wrap(std::move(storage)));
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "torchneuron C++ core: emulated Neuron runtime and PyTorch PrivateUse1 glue";
  torchneuron::register_hooks();

  m.def("_configure", &configure, py::arg("capacities"), py::arg("error") = "",
        "Set the visible devices' HBM capacities (bytes); a non-empty error is raised on use.");
  m.def("_graph_pool_handle", []() { return std::make_tuple(torchneuron::new_graph_pool_id(), uint64_t{0}); },
        "A fresh graph memory pool id, (id, 0), for captures to share (allocator.h).");
  m.def("_mem_pool_create", [](bool no_split, bool use_on_oom, uintptr_t alloc_fn, uintptr_t free_fn,
                               bool remappable) {
    torchneuron::MemPoolOptions options;
    options.no_split = no_split;
    options.use_on_oom = use_on_oom;
    options.remappable = remappable;
    options.alloc_fn = reinterpret_cast<torchneuron::MemPoolOptions::AllocFn>(alloc_fn);
    options.free_fn = reinterpret_cast<torchneuron::MemPoolOptions::FreeFn>(free_fn);
    return torchneuron::create_mem_pool(options);
  }, py::arg("no_split"), py::arg("use_on_oom") = false, py::arg("alloc_fn") = 0, py::arg("free_fn") = 0,
     py::arg("remappable") = false,
     "A MemPool's id (allocator.h, MemPoolOptions; the functions as addresses, 0 for none).");
  m.def("_mem_pool_sleep", &torchneuron::sleep_mem_pool, py::arg("pool"), py::arg("offload"));
  m.def("_mem_pool_wake", &torchneuron::wake_mem_pool, py::arg("pool"));
  m.def("_caching_allocator_enable", &torchneuron::set_caching_enabled, py::arg("value"));
  m.def("_caching_allocator_is_enabled", &torchneuron::caching_enabled);
  m.def("_mem_pool_begin", &torchneuron::begin_mem_pool, py::arg("device"), py::arg("pool"));
  m.def("_mem_pool_end", &torchneuron::end_mem_pool, py::arg("device"), py::arg("pool"));
  m.def("_mem_pool_release", &torchneuron::release_mem_pool, py::arg("pool"));
  m.def("_conv_memory_format", &torchneuron::gemm::conv_memory_format, py::arg("input"), py::arg("weight"),
        "The layout of a 4-d/5-d convolution's result and gradients on neuron (gemm.h).");
  m.def("_precision_routes", []() {
    // How this host runs the GEMM family per dtype (docs/architecture.md, Precision).
    py::dict d;
    d["bf16_cpu_kernels"] = torchneuron::gemm::cpu_fast_bf16() && !torchneuron::gemm::bf16_half_rate();
    d["bf16_cpu_products_below_rows"] =
        torchneuron::gemm::bf16_half_rate() ? torchneuron::gemm::kBf16RoutedRows : int64_t{0};
    d["fp16_cpu_product_kernels"] = torchneuron::gemm::cpu_fast_fp16();
    d["lowp_gemm"] = std::string(torchneuron::gemm::lowp_route());
    d["fp8_cast_vectorized"] = torchneuron::fp8::vectorized();
    d["bf16_fp32_gemm_avx512"] = torchneuron::bf16_gemm::available();
    d["cpu_avx512_bf16"] = torchneuron::cpu_features::avx512bf16();
    d["amx_bf16_gemm"] = torchneuron::gemm::amx_bf16();
    d["amx_fp8_kernel"] = torchneuron::amx_gemm::available();
    d["bf16_mm_amx_rows"] = torchneuron::amx_gemm::available() ? torchneuron::gemm::kAmxMmRows : 0;
    d["fp32_small_attention"] = torchneuron::small_attention::available();
    return d;
  }, "Host paths of the precision routing: whether bf16 runs CPU's kernels (oneDNN with native "
     "bf16 dot products at full rate, cpu_avx512_bf16 without bf16_cpu_products_below_rows), below how "
     "many rows bf16 products keep them where bf16 is otherwise routed (0: all or none; gemm.h, "
     "bf16_half_rate), whether fp16 products do (oneDNN's fp16 kernels, "
     "AVX512-FP16), the fp16/bf16 GEMM route (onednn-fp32 or mkl-mixed), whether fp8 casts are vectorized, whether fp8 "
     "GEMMs run on the AVX512-BF16 kernel (bf16_gemm.h; tensor-wise -> bf16 excepted), whether "
     "bf16 accumulators (fp8 GEMMs) run on MKL's AMX GEMM (amx_bf16_gemm, ahead of that kernel), "
     "whether fp8 GEMMs with B column-major run on the AMX kernel (amx_fp8_kernel, amx_gemm.h; ahead of both), "
     "up to how many rows a bf16 mm with B column-major runs on it too (bf16_mm_amx_rows, 0: never), "
     "and whether fp32 attention of short sequences runs small_attention.h's kernel (fp32_small_attention).");
  m.def("_set_small_attention_enabled", &torchneuron::small_attention::set_enabled, py::arg("enabled"),
        "Testing and measurement: False runs every attention on CPU's flash kernel (small_attention.h), True back.");
  m.def("_set_bf16_half_rate", &torchneuron::gemm::set_bf16_half_rate, py::arg("value"),
        "Testing: 1 routes bf16 as a host whose bf16 dot products run at half fp32's rate (gemm.h, "
        "bf16_half_rate; needs AVX512-BF16), 0 as one where they do not, -1 as this host is.");
  m.def("_set_bf16_gemm_enabled", &torchneuron::bf16_gemm::set_enabled, py::arg("enabled"),
        "Testing: False routes fp8 GEMMs as on a host without AVX512-BF16 (bf16_gemm.h), True back.");
  m.def("_set_amx_gemm_enabled", &torchneuron::gemm::set_amx_enabled, py::arg("enabled"),
        "Testing: False routes bf16 accumulators and fp8 GEMMs as on a host without AMX, True back.");
  m.def("_lazy_init", &lazy_init);
  m.def("_is_initialized", &neuron::rt::is_initialized);
  m.def("_in_bad_fork", &neuron::rt::in_bad_fork);
  m.def("_device_count", &neuron::rt::device_count);
  m.def("_current_device", &neuron::rt::current_device);
  m.def("_set_device", [](int d) {
    lazy_init();
    torchneuron::check_device_index(d);
    neuron::rt::set_current_device(d);
  });
  m.def("_check_device", &torchneuron::check_device_index,
        "Raise RuntimeError naming the valid range if the index is not a visible device.");
  m.def("_device_capacity", [](int d) {
    torchneuron::check_device_index(d);
    return neuron::rt::capacity(d);
  });
  m.def("_set_memory_fraction", [](double fraction, int d) {
    torchneuron::check_device_index(d);
    neuron::rt::set_memory_fraction(d, fraction);
  });
  m.def("_memory_fraction", [](int d) {
    torchneuron::check_device_index(d);
    return neuron::rt::memory_fraction(d);
  });
  m.def("_device_used", [](int d) {
    torchneuron::check_device_index(d);
    return neuron::rt::used(d);
  });
  m.def("_stream_priority", &neuron::rt::stream_priority);
  // GPU trace hooks for the stream sanitizer (csrc/backend/gpu_trace.h).
  m.def("_gpu_trace_set_enabled", &torchneuron::gpu_trace::set_enabled);
  m.def("_gpu_trace_details", []() {
    auto d = torchneuron::gpu_trace::details();
    return py::make_tuple(d.device, d.nbytes);
  }, "(device, bytes) of the trace hook running on this thread: its device synchronization, "
     "allocation or deallocation.");
  m.def("_get_default_generator", &default_generator);
  m.def("_host_stats", []() {
    // The pinned host allocator's statistics, nested as torch.cuda's _cuda_getHostMemoryStats.
    auto s = torchneuron::host_allocator()->get_stats();
    auto stat = [](const c10::CachingAllocator::Stat& st) {
      py::dict d;
      d["current"] = st.current;
      d["peak"] = st.peak;
      d["allocated"] = st.allocated;
      d["freed"] = st.freed;
      return d;
    };
    auto duration = [](const c10::CachingAllocator::DurationStat& st) {
      py::dict d;
      d["total"] = st.total;
      d["max"] = st.max;
      d["min"] = st.min;
      d["count"] = st.count;
      d["avg"] = st.count == 0 ? 0 : st.total / st.count;
      return d;
    };
    py::dict d;
    d["num_host_alloc"] = s.num_host_alloc;
    d["num_host_free"] = s.num_host_free;
    d["allocations"] = stat(s.allocations);
    d["allocated_bytes"] = stat(s.allocated_bytes);
    d["active_requests"] = stat(s.active_requests);
    d["active_bytes"] = stat(s.active_bytes);
    d["host_alloc_time"] = duration(s.host_alloc_time);
    d["host_free_time"] = duration(s.host_free_time);
    return d;
  });
  m.def("_host_reset_peak_stats", []() { torchneuron::host_allocator()->reset_peak_stats(); });
  m.def("_host_reset_accumulated_stats", []() { torchneuron::host_allocator()->reset_accumulated_stats(); });
  m.def("_executed_ops", [](bool fallback_only) { return torchneuron::executed_ops(fallback_only); },
        py::arg("fallback_only") = false);
  m.def("_clear_op_tracking", &torchneuron::clear_op_tracking);
  m.def("_scalar_type_names", []() {
    // ScalarType index -> name, to decode the profiler's tensor records.
    std::vector<std::string> names;
    for (int i = 0; i < static_cast<int>(c10::ScalarType::NumOptions); ++i) {
      names.emplace_back(c10::toString(static_cast<c10::ScalarType>(i)));
    }
    return names;
  });
  torchneuron::prof::bind_profiler(m);
  torchneuron::bind_memory_history(m);
  m.def("_set_op_tracking", &torchneuron::set_op_tracking);
  // The execution engine (runtime/engine.h; torchneuron.neuron.engine wraps these).
  m.def("_engine_set_enabled", &neuron::rt::engine::set_enabled, py::arg("on"));
  m.def("_engine_set_executor_thread", &neuron::rt::engine::set_executor_thread, py::arg("on"));
  m.def("_engine_executor_thread", &neuron::rt::engine::executor_thread);
  m.def("_engine_configured", &neuron::rt::engine::configured);
  // Also the synchronization point compiled code calls before each of its C++ kernels: one
  // atomic comparison when nothing is queued.
  m.def("_engine_drain", []() {
    if (!neuron::rt::engine::pending()) return;
    py::gil_scoped_release no_gil;
    neuron::rt::engine::drain();
  });
  m.def("_engine_pending", &neuron::rt::engine::pending);
  m.def("_engine_capturing", &neuron::rt::engine::capturing);  // a graph capture is open (graph.cpp)
  m.def("_engine_stats", []() {
    const auto s = neuron::rt::engine::stats();
    const auto f = torchneuron::fusion::stats();
    return py::dict(py::arg("enqueued") = s.enqueued, py::arg("executed") = s.executed,
                    py::arg("drains") = s.drains, py::arg("fused") = s.fused, py::arg("regions") = s.regions,
                    py::arg("kernels_compiled") = f.compiled, py::arg("kernels_failed") = f.failed,
                    py::arg("kernels_requested") = f.requested, py::arg("tiled") = f.tiled, py::arg("gemm") = f.gemm,
                    py::arg("interpreted") = f.interpreted);
  });
  // Adaptive Eager (backend/fusion.h; torchneuron/compile/eager_fusion.py compiles).
  m.def("_fusion_set_enabled", &torchneuron::fusion::set_enabled, py::arg("on"));
  m.def("_fusion_interpreter_available", &torchneuron::fusion_interpreter::available);
  m.def("_fusion_enabled", &torchneuron::fusion::enabled);
  m.def("_fusion_set_tiles_enabled", &torchneuron::fusion::set_tiles_enabled, py::arg("on"));
  m.def("_fusion_tiles_enabled", &torchneuron::fusion::tiles_enabled);
  m.def("_fusion_install", [](const py::bytes& signature, uintptr_t kernel) {
    torchneuron::fusion::install(std::string(signature), kernel);
  });
  m.def("_fusion_fail_after", &torchneuron::fusion::fail_after, py::arg("groups"));  // tests only
  torchneuron::bind_cpu_kernel_call(m);
  torchneuron::bind_compiled_kernels(m);
  m.def("_storage_take_data", &storage_take_data, py::arg("dst"), py::arg("src"));  // (compile/graphs.py)
  // Interprocess sharing (torchneuron/neuron/ipc.py).
  m.def("_ipc_export", &ipc_export,
        "Share a neuron storage: (device, heap fd, offset, nbytes, counter offset).");
  m.def("_ipc_import", &ipc_import, "Map a storage another process exported.");
  m.def("_ipc_release_counter", &torchneuron::ipc_release_counter);
  m.def("_ipc_collect", &torchneuron::ipc_collect);
  m.def("_ipc_limbo_size", &torchneuron::ipc_limbo_size);
  m.def("_sparse_generic_ops", &torchneuron::sparse_generic_ops,
        "Sparse ops run by their CPU kernel directly on neuron tensors (metadata only).");
  m.def("_set_sync_debug_mode", &torchneuron::sync_debug::set_mode);
  m.def("_get_sync_debug_mode", &torchneuron::sync_debug::mode);
  m.def("_nested_generic_ops", &torchneuron::nested_generic_ops,
        "Nested ops run by their CPU kernel directly on neuron tensors (device-generic kernels).");
}
