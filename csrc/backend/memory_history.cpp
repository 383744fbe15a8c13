#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
// Memory history: torch.neuron.memory._record_memory_history / _snapshot in the format of
// torch.cuda.memory._snapshot, so PyTorch's memory visualizer (torch.cuda._memory_viz,
// pytorch.org/memory_viz) renders neuron snapshots.
//
// Why C++: the allocator reports from inside its lock, per allocation; the recorder keeps a
// bounded ring of entries with captured stacks (CapturedTraceback: code objects only,
// symbolized in bulk when a snapshot is taken).
#include <c10/util/ApproximateClock.h>
#include <torch/csrc/profiler/combined_traceback.h>
// torch/csrc/utils/pybind.h, not torch/extension.h: the latter pulls in the whole C++ frontend
// (torch/all.h), which more than doubles this unit's compile time.
#include <torch/csrc/utils/pybind.h>

#include <deque>
#include <mutex>

#include "../runtime/runtime.h"
#include "allocator.h"

namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
}

namespace torchneuron {
namespace {

struct Entry {
  AllocAction action;
  int device;
  size_t address, size;
  int64_t stream;
  int64_t time_us;
  size_t device_free;  // OOM entries: free bytes on the device at the time
  std::shared_ptr<c10::GatheredContext> context;
};

const char* action_name(AllocAction a) {
  switch (a) {
    case AllocAction::Alloc: return "alloc";
    case AllocAction::FreeRequested: return "free_requested";
    case AllocAction::FreeCompleted: return "free_completed";
    case AllocAction::SegmentAlloc: return "segment_alloc";
    case AllocAction::SegmentFree: return "segment_free";
    case AllocAction::SegmentMap: return "segment_map";
    case AllocAction::SegmentUnmap: return "segment_unmap";
    case AllocAction::Oom: return "oom";
  }
  return "alloc";
}

class HistoryRecorder final : public AllocatorRecorder {
 public:
  void configure(bool keep_trace, bool ctx_alloc, bool ctx_free, bool cpp, size_t max_entries) {
    std::lock_guard<std::mutex> g(mu_);
    keep_trace_ = keep_trace;
    ctx_alloc_ = ctx_alloc;
    ctx_free_ = ctx_free;
    cpp_ = cpp;
    max_entries_ = max_entries;
    while (trace_.size() > max_entries_) trace_.pop_front();
  }

  std::shared_ptr<c10::GatheredContext> context(bool for_free) override {
    if (for_free ? !ctx_free_ : !ctx_alloc_) return nullptr;
    return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/cpp_);
  }

  void record(AllocAction action, int device, size_t address, size_t size, int64_t stream,
              const std::shared_ptr<c10::GatheredContext>& ctx) override {
    if (!keep_trace_) return;
    size_t free = 0;
    if (action == AllocAction::Oom) {
      const size_t cap = neuron::rt::capacity(device), used = neuron::rt::used(device);
      free = cap > used ? cap - used : 0;
    }
    std::lock_guard<std::mutex> g(mu_);
    trace_.push_back({action, device, address, size, stream, c10::getTime() / 1000, free, ctx});
    if (trace_.size() > max_entries_) trace_.pop_front();
  }

  std::vector<Entry> entries() {
    std::lock_guard<std::mutex> g(mu_);
    return {trace_.begin(), trace_.end()};
  }

  void clear() {
    std::lock_guard<std::mutex> g(mu_);
    trace_.clear();
  }

 private:
  std::mutex mu_;
  std::deque<Entry> trace_;
  size_t max_entries_ = 100000;
  bool keep_trace_ = true, ctx_alloc_ = true, ctx_free_ = false, cpp_ = false;
};

HistoryRecorder& recorder() {
  static HistoryRecorder* r = new HistoryRecorder();  // leaked: the allocator may outlive statics
  return *r;
}

// enabled: None (stop and forget), "state" (stacks of live blocks only), "all" (plus the trace
// of actions). context: None, "state", "alloc", "all" (which actions get a stack).
void record_memory_history(std::optional<std::string> enabled, std::optional<std::string> context,
                           const std::string& stacks, size_t max_entries) {
  if (!enabled) {
    set_allocator_recorder(nullptr);
    recorder().clear();
    return;
  }
  TORCH_CHECK(*enabled == "state" || *enabled == "all",
              "_record_memory_history: enabled must be None, 'state' or 'all', got '", *enabled, "'");
  const std::string ctx = context.value_or("");
  TORCH_CHECK(!context || ctx == "state" || ctx == "alloc" || ctx == "all",
              "_record_memory_history: context must be None, 'state', 'alloc' or 'all', got '", ctx, "'");
  TORCH_CHECK(stacks == "python" || stacks == "all",
              "_record_memory_history: stacks must be 'python' or 'all', got '", stacks, "'");
  TORCH_CHECK(max_entries > 0, "_record_memory_history: max_entries must be positive");
  const bool ctx_alloc = context.has_value();
  const bool ctx_free = ctx == "all";
  recorder().configure(*enabled == "all", ctx_alloc, ctx_free, stacks == "all", max_entries);
  set_allocator_recorder(&recorder());
}

py::dict memory_snapshot_full() {
  auto segments = device_allocator()->snapshot();
  auto entries = recorder().entries();
  // Symbolize every context once, in one batch.
  std::vector<torch::CapturedTraceback*> tbs;
  auto add_ctx = [&tbs](const std::shared_ptr<c10::GatheredContext>& c) -> int64_t {
    if (!c) return -1;
    auto* tb = dynamic_cast<torch::CapturedTraceback*>(c.get());
    if (!tb) return -1;
    tbs.push_back(tb);
    return static_cast<int64_t>(tbs.size() - 1);
  };
  std::vector<std::vector<int64_t>> block_idx(segments.size());
  for (size_t i = 0; i < segments.size(); ++i)
    for (const auto& b : segments[i].blocks) block_idx[i].push_back(add_ctx(b.context));
  std::vector<int64_t> entry_idx;
  for (const auto& e : entries) entry_idx.push_back(add_ctx(e.context));
  std::vector<py::object> frames = torch::py_symbolize(tbs);
  auto frames_of = [&frames](int64_t i) -> py::object {
    return i < 0 ? py::object(py::list()) : frames[static_cast<size_t>(i)];
  };

  py::list segs;
  for (size_t i = 0; i < segments.size(); ++i) {
    const auto& s = segments[i];
    py::dict seg;
    seg["device"] = s.device;
    seg["address"] = s.address;
    seg["total_size"] = s.total_size;
    seg["allocated_size"] = s.allocated_size;
    seg["active_size"] = s.active_size;
    seg["requested_size"] = s.requested_size;
    seg["stream"] = s.stream;
    seg["segment_type"] = s.is_large ? "large" : "small";
    // A MemPool's id is (0, n), a graph pool's (n, 0), as CUDA's.
    const uint64_t none = 0;
    seg["segment_pool_id"] = py::make_tuple(s.graph ? s.mem_pool : none, s.graph ? none : s.mem_pool);
    seg["is_expandable"] = s.is_expandable;
    seg["frames"] = py::list();
    py::list blocks;
    for (size_t j = 0; j < s.blocks.size(); ++j) {
      const auto& b = s.blocks[j];
      py::dict blk;
      blk["address"] = b.address;
      blk["size"] = b.size;
      blk["requested_size"] = b.requested_size;
      blk["state"] = b.allocated ? "active_allocated" : b.pending ? "active_pending_free" : "inactive";
      blk["frames"] = frames_of(block_idx[i][j]);
      blocks.append(blk);
    }
    seg["blocks"] = blocks;
    segs.append(seg);
  }
  py::list traces;
  for (int d = 0; d < neuron::rt::device_count(); ++d) traces.append(py::list());
  for (size_t k = 0; k < entries.size(); ++k) {
    const auto& e = entries[k];
    if (e.device < 0 || e.device >= neuron::rt::device_count()) continue;
    py::dict t;
    t["action"] = action_name(e.action);
    t["addr"] = e.address;
    t["size"] = e.size;
    t["stream"] = e.stream;
    t["time_us"] = e.time_us;
    t["frames"] = frames_of(entry_idx[k]);
    if (e.action == AllocAction::Oom) t["device_free"] = e.device_free;
    traces[e.device].cast<py::list>().append(t);
  }
  py::dict out;
  out["segments"] = segs;
  out["device_traces"] = traces;
  py::dict settings;
  settings["device"] = "neuron";
  out["allocator_settings"] = settings;
  return out;
}

}  // namespace

void bind_memory_history(py::module& m) {
  m.def("_memory_record_history", &record_memory_history, py::arg("enabled"), py::arg("context"),
        py::arg("stacks"), py::arg("max_entries"));
  m.def("_memory_snapshot_full", &memory_snapshot_full);
}

}  // namespace torchneuron
