// enqueue.h: the enqueueing Python stack is captured as code objects (CapturedTraceback, as the
// memory history does) and symbolized only if the kernel fails.
#include <torch/csrc/profiler/combined_traceback.h>
#include <torch/csrc/utils/pybind.h>

#if PY_VERSION_HEX >= 0x030B0000 && PY_VERSION_HEX < 0x030C0000
// The interpreter's frame layout, to read the calling thread's own frame chain without its lock
// (see interned_stack below). CPython 3.11's internal header; other versions gather every time.
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#define TORCHNEURON_READ_FRAMES 1
#endif

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include <ATen/Parallel.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <ATen/core/LegacyTypeDispatch.h>

#include "../runtime/runtime.h"
#include "enqueue.h"

namespace torch {
std::vector<pybind11::object> py_symbolize(std::vector<CapturedTraceback*>& to_symbolize);
void installCapturedTracebackPython();
}  // namespace torch

namespace torchneuron {
namespace {

std::string describe(const void* where) {
  auto* tb = const_cast<torch::CapturedTraceback*>(static_cast<const torch::CapturedTraceback*>(where));
  py::gil_scoped_acquire gil;
  std::vector<torch::CapturedTraceback*> tbs{tb};
  std::vector<py::object> symbolized = torch::py_symbolize(tbs);
  std::vector<std::string> lines;
  for (const auto& frame : symbolized.at(0)) {  // innermost first
    lines.push_back("  File \"" + frame["filename"].cast<std::string>() + "\", line " +
                    std::to_string(frame["line"].cast<int64_t>()) + ", in " + frame["name"].cast<std::string>());
  }
  std::reverse(lines.begin(), lines.end());
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

// The host waits for the queue without the interpreter's lock (engine.h, set_blocking_wait).
void wait_without_gil(const std::function<void()>& wait) {
  if (Py_IsInitialized() && PyGILState_Check()) {
    py::gil_scoped_release no_gil;
    wait();
  } else {
    wait();
  }
}

using Stack = std::shared_ptr<const torch::CapturedTraceback>;

Stack gather() { return torch::CapturedTraceback::gather(/*python=*/true, /*script=*/false, /*cpp=*/false); }

#ifdef TORCHNEURON_READ_FRAMES
// Interned stacks. Gathering a stack takes the interpreter's lock (the op's Python binding
// released it), walks the frames and increfs each code object: a quarter of a microsecond, a
// tenth of what a queued 16-element add costs the host. A training loop enqueues from the same
// few places over and over, so a stack seen before is shared instead. Its key is read without
// the lock: the addresses of the instructions the calling thread's frames are executing. Those
// frames are the thread's own and cannot change while it runs this C++ code. The interned
// traceback holds its code objects (the instructions live inside them), so no other code can
// take those addresses while the entry exists. Only a new stack is gathered, under the lock.
constexpr int kMaxDepth = 96;         // deeper stacks are gathered every time
constexpr size_t kMaxStacks = 4096;   // then new stacks are gathered every time, not interned

struct Interned {
  std::vector<const void*> key;
  Stack stack;
};

struct Interner {
  std::mutex mu;
  std::unordered_multimap<size_t, Interned> stacks;  // by the key's hash
};

// Never destroyed: its tracebacks hold code objects, which must not be released after the
// interpreter finalized.
Interner& interner() {
  static Interner* table = new Interner();
  return *table;
}

// The calling thread's frames, innermost first, as instruction addresses; -1 if unknown.
int read_frames(const void** out) {
  if (!Py_IsInitialized()) return -1;
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr) return 0;  // a thread Python never ran on (no frames: the empty stack)
  if (ts->cframe == nullptr) return -1;
  int n = 0;
  for (_PyInterpreterFrame* f = ts->cframe->current_frame; f != nullptr; f = f->previous) {
    if (n == kMaxDepth) return -1;
    out[n++] = f->prev_instr;
  }
  return n;
}

Stack interned_stack() {
  const void* frames[kMaxDepth];
  const int n = read_frames(frames);
  if (n < 0) return gather();
  auto same = [&](const Interned& i) {
    return i.key.size() == static_cast<size_t>(n) && std::equal(i.key.begin(), i.key.end(), frames);
  };
  // The last stack this thread enqueued from is compared first (a loop enqueues from one place);
  // interned entries are never erased, so the pointer stays valid.
  thread_local const Interned* last = nullptr;
  if (last != nullptr && same(*last)) return last->stack;
  size_t hash = static_cast<size_t>(n);
  for (int i = 0; i < n; ++i) hash = hash * 0x9E3779B97F4A7C15ull ^ reinterpret_cast<uintptr_t>(frames[i]);
  Interner& t = interner();
  {
    std::lock_guard<std::mutex> lock(t.mu);
    auto [first, end] = t.stacks.equal_range(hash);
    for (auto it = first; it != end; ++it) {
      if (same(it->second)) {
        last = &it->second;
        return last->stack;
      }
    }
  }
  Stack stack = gather();
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.stacks.size() < kMaxStacks) {
    // (not {frames, frames + n}: a braced list of two pointers would be the key's two elements)
    last = &t.stacks.emplace(hash, Interned{std::vector<const void*>(frames, frames + n), stack})->second;
  }
  return stack;
}
#else
Stack interned_stack() { return gather(); }
#endif

}  // namespace

// A queued kernel runs below autograd, as a kernel does inside its op: autograd already ran at
// the call, and the thread that drains the queue may be in another mode than the caller was
// (its CPU aliases of tensors made under inference_mode are inference tensors, which an
// in-place CPU op outside inference_mode would refuse).
void run_below_autograd(const neuron::rt::engine::Work& work) {
  at::AutoDispatchBelowADInplaceOrView below;
  work();
}

// A kernel that failed asynchronously is a device error, as CUDA's at a synchronization:
// torch.AcceleratorError (a RuntimeError), code 1 (the Neuron runtime's NRT_FAILURE).
[[noreturn]] void raise_device_error(const std::string& message) {
  throw c10::AcceleratorError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, 1, message);
}

std::string error_text(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return c10_error->what_without_backtrace();
  return e.what();
}

void enqueue_kernel(int device, const char* name, std::function<void()> work, neuron::rt::engine::Record record,
                    neuron::rt::engine::TracePayload tensors) {
  static const bool installed = (torch::installCapturedTracebackPython(),
                                 neuron::rt::engine::set_blocking_wait(&wait_without_gil),
                                 neuron::rt::engine::set_error_text(&error_text),
                                 neuron::rt::engine::set_describe(&describe),
                                 neuron::rt::engine::set_raise(&raise_device_error),
                                 neuron::rt::engine::set_run_work(&run_below_autograd),
                                 neuron::rt::engine::set_current_where([]() -> neuron::rt::engine::Where {
                                   return interned_stack();
                                 }),
                                 true);
  (void)installed;
  static const bool stacks = [] {
    const char* v = std::getenv("TORCHNEURON_ASYNC_STACKS");
    return v == nullptr || std::string(v) != "0";
  }();
  neuron::rt::engine::enqueue(device, neuron::rt::current_stream(device), name, std::move(work),
                              stacks ? interned_stack() : nullptr, std::move(record), std::move(tensors));
}

namespace {
// The executor thread's intra-op parallelism is the host's (torch.set_num_threads when it
// started): kernels whose results depend on the thread count (reductions split across
// threads, layer norm's weight gradients) then give the host's bits. A thread's OpenMP team
// size is set by ATen at its first parallel call, from ATen's setting: that is the one taken.
void executor_thread_init() { (void)at::get_num_threads(); }
const bool g_executor_init = (neuron::rt::engine::set_executor_thread_init(&executor_thread_init), true);
}  // namespace

void copy_result(const char* op, const at::Tensor& out, const at::Tensor& r) {
  TORCH_INTERNAL_ASSERT(out.sizes() == r.sizes() && out.strides() == r.strides() && out.scalar_type() == r.scalar_type(),
                        op, ": the queued kernel's result (", r.sizes(), ", strides ", r.strides(), ", ",
                        r.scalar_type(), ") is not the one allocated at the call (", out.sizes(), ", strides ",
                        out.strides(), ", ", out.scalar_type(), "); please report this torchneuron bug");
  at::Tensor(out).copy_(r);
}

}  // namespace torchneuron
