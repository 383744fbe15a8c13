// ProcessGroupNeuron: the c10d backend of the `neuron` device.
//
// Why it looks like this: a neuron tensor's memory is host memory, so every collective can run
// over zero-copy CPU aliases of the neuron tensors. The transport is a gloo backend created in
// Python (the wheel ships no gloo headers, so we hold it as a plain c10d::Backend) and every op
// is forwarded to it. What this file adds on top of gloo:
//   * device semantics: Work results and Future values are the *neuron* tensors, the Future's
//     devices are the neuron devices (DDP comm hooks, funcol and FSDP2 rely on that);
//   * stream ordering: the producer stream is synchronised before the transport reads memory,
//     and the tensors stay stashed in the Work until it completes (allocator safety);
//   * things gloo lacks: coalescing, ReduceOp.AVG, fp8 (moved as bytes; reductions rejected),
//     Futures for send/recv/reduce-scatter (gloo throws "getFuture not implemented");
//   * fault handling: a watchdog thread that notices failed or stuck Works nobody waits for,
//     dumps a flight recorder of the last collectives and aborts (NCCL's async error handling).
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <array>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <fstream>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include "../backend/trace_api.h"

namespace torchneuron_dist {

using c10::intrusive_ptr;
using c10d::OpType;
using c10d::Work;
using Clock = std::chrono::steady_clock;

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return (v && *v) ? std::atoi(v) : fallback;
}

const char* op_name(OpType t) {
  switch (t) {
    case OpType::BROADCAST: return "broadcast";
    case OpType::ALLREDUCE: return "allreduce";
    case OpType::ALLREDUCE_COALESCED: return "allreduce_coalesced";
    case OpType::REDUCE: return "reduce";
    case OpType::ALLGATHER: return "allgather";
    case OpType::_ALLGATHER_BASE: return "_allgather_base";
    case OpType::ALLGATHER_COALESCED: return "allgather_coalesced";
    case OpType::GATHER: return "gather";
    case OpType::SCATTER: return "scatter";
    case OpType::REDUCE_SCATTER: return "reduce_scatter";
    case OpType::ALLTOALL_BASE: return "alltoall_base";
    case OpType::ALLTOALL: return "alltoall";
    case OpType::SEND: return "send";
    case OpType::RECV: return "recv";
    case OpType::RECVANYSOURCE: return "recv_anysource";
    case OpType::BARRIER: return "barrier";
    case OpType::_REDUCE_SCATTER_BASE: return "_reduce_scatter_base";
    case OpType::COALESCED: return "coalesced";
    case OpType::REDUCE_SCATTER_TENSOR_COALESCED: return "reduce_scatter_tensor_coalesced";
    default: return "unknown";
  }
}

// ---------------------------------------------------------------------------------------------
// Flight recorder: a process-wide ring of the last N collectives (NCCL's FlightRecorder, in the
// small). Dumped by the watchdog on a fault, and on request from Python.
struct FrEntry {
  uint64_t id = 0;  // position in the ring's history (monotonic)
  std::string pg;
  const char* op = "";
  const char* state = "scheduled";
  // Shapes are kept raw and formatted only when dumped: recording sits on every op's path.
  std::vector<std::vector<int64_t>> ins, outs;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  uint64_t seq = 0;
  int rank = -1;
  int64_t created_us = 0, completed_us = -1;

  static void shapes(std::ostream& os, const std::vector<std::vector<int64_t>>& v) {
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << c10::IntArrayRef(v[i]);
    os << "]";
  }
};

class FlightRecorder {
 public:
  static FlightRecorder& get() {
    static FlightRecorder fr;
    return fr;
  }
  uint64_t record(FrEntry e) {
    std::lock_guard<std::mutex> g(mu_);
    e.id = next_++;
    e.created_us = now_us();
    ring_.push_back(std::move(e));
    while (ring_.size() > capacity_) ring_.pop_front();
    return next_ - 1;
  }
  void complete(uint64_t id, const char* state) {
    std::lock_guard<std::mutex> g(mu_);
    if (ring_.empty() || id < ring_.front().id) return;  // already rotated out
    auto& e = ring_[id - ring_.front().id];
    e.state = state;
    e.completed_us = now_us();
  }
  void set_state(uint64_t id, const char* state) {
    std::lock_guard<std::mutex> g(mu_);
    if (ring_.empty() || id < ring_.front().id) return;
    ring_[id - ring_.front().id].state = state;
  }
  // JSON lines, oldest first: one object per collective.
  std::string dump() {
    std::lock_guard<std::mutex> g(mu_);
    std::ostringstream os;
    int64_t now = now_us();
    for (const auto& e : ring_) {
      os << "{\"record_id\": " << e.id << ", \"pg\": \"" << e.pg << "\", \"rank\": " << e.rank
         << ", \"seq\": " << e.seq << ", \"op\": \"" << e.op << "\", \"shapes\": \"";
      FrEntry::shapes(os, e.ins);
      os << " -> ";
      FrEntry::shapes(os, e.outs);
      os << "\", \"dtype\": \""
         << (e.dtype == c10::ScalarType::Undefined ? "" : c10::toString(e.dtype))
         << "\", \"state\": \"" << e.state
         << "\", \"age_ms\": " << (now - e.created_us) / 1000.0 << ", \"duration_ms\": "
         << (e.completed_us < 0 ? -1.0 : (e.completed_us - e.created_us) / 1000.0) << "}\n";
    }
    return os.str();
  }

 private:
  FlightRecorder() : capacity_(std::max(1, env_int("TORCH_NEURON_FR_BUFFER_SIZE", 256))) {}
  static int64_t now_us() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               Clock::now().time_since_epoch()).count();
  }
  std::mutex mu_;
  std::deque<FrEntry> ring_;
  uint64_t next_ = 0;
  size_t capacity_;
};

// torchneuron._C's device API for this extension (backend/trace_api.h): the profiler's entry
// points and the execution engine's drain. Null until registered.
const torchneuron::TraceApi* g_trace = nullptr;

// ---------------------------------------------------------------------------------------------
// Tensors: neuron -> zero-copy CPU alias. The deleter holds the Storage, so the alias keeps the
// neuron memory alive for as long as the transport uses it.
bool is_fp8(at::ScalarType t) { return at::isFloat8Type(t); }

at::Tensor host_alias(const at::Tensor& t, bool fp8_as_bytes) {
  if (!t.defined()) return t;
  if (t.device().is_cpu()) return t;  // mixed use: CPU tensors pass through untouched
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1,
              "neuron process group: expected neuron (or CPU) tensors, got a tensor on ",
              t.device());
  at::ScalarType dtype = t.scalar_type();
  if (is_fp8(dtype)) {
    // gloo has no fp8 ("Invalid scalar type"); moving bytes is exact for any 1-byte type.
    TORCH_CHECK(fp8_as_bytes, "neuron process group: reductions of ", dtype,
                " are not supported (gloo cannot add fp8); upcast to bfloat16 or float32 "
                "before reducing, or use a data-movement collective");
    dtype = at::kByte;
  }
  if (g_trace != nullptr) g_trace->drain();  // queued kernels may still be writing it
  c10::Storage storage = t.storage();
  return at::from_blob(
      t.data_ptr(), t.sizes(), t.strides(), [storage](void*) {},
      at::TensorOptions().dtype(dtype).device(at::kCPU));
}

// all_gather_into_tensor accepts what NCCL accepts: any contiguous output of the input's dtype
// holding world_size times the input's elements ([world*n], [world, n], [1, world*n] for an input
// of n elements; SyncBatchNorm gathers [2C+1] into [1, world*(2C+1)]). gloo, the transport, wants
// the output to chunk along dim 0 into world_size pieces shaped like the input, so the host alias
// of the output is handed over as [world * input.size(0), *input.sizes()[1:]] over the same bytes.
at::Tensor gather_output_view(const at::Tensor& out_alias, const at::Tensor& out, const at::Tensor& in,
                              int world) {
  TORCH_CHECK_TYPE(out.scalar_type() == in.scalar_type(), "neuron process group: all_gather_into_tensor: the output "
                   "tensor must have the same dtype as the input, got ", out.scalar_type(), " and ", in.scalar_type());
  TORCH_CHECK_VALUE(out.numel() == in.numel() * world, "neuron process group: all_gather_into_tensor: the output "
                    "must hold world_size times the input's elements (", world, " x ", in.numel(), " = ",
                    in.numel() * world, "), got an output of shape ", out.sizes(), " (", out.numel(),
                    " elements); allocate it as [world_size * n] or [world_size, n]");
  TORCH_CHECK(out.is_contiguous() && in.is_contiguous(), "neuron process group: all_gather_into_tensor: input and "
              "output must be contiguous (as on NCCL); call .contiguous() on them first");
  // gloo chunks the output along dim 0: [world * in.size(0), in.size(1), ...] chunks into pieces of
  // the input's shape (a 0-dim input travels as [1], gather_input_view).
  std::vector<int64_t> shape(in.sizes().begin(), in.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape[0] *= world;
  return out_alias.view(shape);
}

at::Tensor gather_input_view(const at::Tensor& in_alias) { return in_alias.dim() == 0 ? in_alias.view({1}) : in_alias; }

std::vector<at::Tensor> host_alias(const std::vector<at::Tensor>& ts, bool bytes) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(host_alias(t, bytes));
  return out;
}

std::vector<std::vector<at::Tensor>> host_alias(const std::vector<std::vector<at::Tensor>>& ts,
                                                bool bytes) {
  std::vector<std::vector<at::Tensor>> out;
  for (const auto& v : ts) out.push_back(host_alias(v, bytes));
  return out;
}

// Stream ordering: the transport reads memory on its own thread, so whatever the current neuron
// stream has queued for these tensors must be finished first (CUDA's rule: the communication
// stream waits for the current stream). host_alias then runs every other stream's queued
// kernels too, so a collective never reads memory a queued kernel is still to write
// (tests/device/test_engine.py).
void sync_producers(const std::vector<c10::Device>& devices) {
  if (devices.empty()) return;
  c10::impl::VirtualGuardImpl impl(c10::DeviceType::PrivateUse1);
  for (const auto& d : devices) {
    c10::Stream stream = impl.getStream(d);
    if (impl.queryStream(stream)) continue;  // nothing queued: nothing to wait for
    c10::Event ev(c10::DeviceType::PrivateUse1);
    ev.record(stream);
    ev.synchronize();
  }
}

void collect_devices(const at::Tensor& t, std::vector<c10::Device>& devs) {
  if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1) return;
  for (const auto& d : devs)
    if (d == t.device()) return;
  devs.push_back(t.device());
}

// ---------------------------------------------------------------------------------------------
// Profiler: a collective is one device activity on the device's communication queue, from
// issue to completion (recorded through torchneuron._C's trace API, g_trace).

const char* cc_kernel_name(OpType t) {
  // NCCL-style names: trace tools (Holistic Trace Analysis) classify "nccl*Kernel*" kernels as
  // communication.
  switch (t) {
    case OpType::BROADCAST: return "ncclKernel_Broadcast (neuron)";
    case OpType::ALLREDUCE:
    case OpType::ALLREDUCE_COALESCED: return "ncclKernel_AllReduce (neuron)";
    case OpType::REDUCE: return "ncclKernel_Reduce (neuron)";
    case OpType::ALLGATHER:
    case OpType::_ALLGATHER_BASE:
    case OpType::ALLGATHER_COALESCED: return "ncclKernel_AllGather (neuron)";
    case OpType::GATHER: return "ncclKernel_Gather (neuron)";
    case OpType::SCATTER: return "ncclKernel_Scatter (neuron)";
    case OpType::REDUCE_SCATTER:
    case OpType::_REDUCE_SCATTER_BASE:
    case OpType::REDUCE_SCATTER_TENSOR_COALESCED: return "ncclKernel_ReduceScatter (neuron)";
    case OpType::ALLTOALL:
    case OpType::ALLTOALL_BASE: return "ncclKernel_AllToAll (neuron)";
    case OpType::SEND: return "ncclKernel_Send (neuron)";
    case OpType::RECV:
    case OpType::RECVANYSOURCE: return "ncclKernel_Recv (neuron)";
    case OpType::BARRIER: return "ncclKernel_Barrier (neuron)";
    default: return "ncclKernel_Collective (neuron)";
  }
}

struct CollectiveTrace {
  const char* name;
  int device;
  uint64_t external;
  int32_t tid;
  int64_t launch_start, launch_end;
  int64_t bytes;
  std::string meta;
  std::vector<int64_t> tensors;
};

// ---------------------------------------------------------------------------------------------
// Work: wraps one or more inner Works. Shared state lives in State so the inner futures'
// callbacks can complete it without holding a reference to the Work itself.
struct State {
  std::mutex mu;
  bool done = false;
  std::exception_ptr error;
  intrusive_ptr<c10::ivalue::Future> future;
  std::vector<at::Tensor> outputs;        // Work::result() and the Future's value
  std::vector<at::Tensor> stash;          // every tensor the transport touches
  std::function<void()> post;             // runs on success before completion (e.g. AVG divide)
  uint64_t fr_id = UINT64_MAX;
  std::unique_ptr<CollectiveTrace> trace;  // set only while a profiler records

  void finish(std::exception_ptr e) {
    std::unique_lock<std::mutex> g(mu);
    if (done) return;
    if (!e && post) {
      try {
        post();
      } catch (...) {
        e = std::current_exception();
      }
    }
    done = true;
    error = e;
    g.unlock();
    if (fr_id != UINT64_MAX) FlightRecorder::get().complete(fr_id, e ? "failed" : "completed");
    if (trace && !e && g_trace) {
      const auto& t = *trace;
      g_trace->record_collective(t.name, t.device, 0, t.external, t.tid, t.launch_start,
                                 t.launch_end, t.launch_end, g_trace->now_ns(), t.bytes,
                                 t.meta.c_str(), &t.tensors);
    }
    if (e)
      future->setErrorIfNeeded(e);
    else
      future->markCompleted(c10::IValue(outputs));
    stash.clear();  // memory may be reused once the collective is done
  }
};

class Completer;

class NeuronWork : public Work {
 public:
  // `no_future`: the backend's per-op-type memory that the inner Works have no Future, so the
  // check below throws once per op type instead of once per call (c10::Error captures a stack
  // trace: ~6 us of CPU per reduce-scatter, which two ranks on two cores feel as latency).
  NeuronWork(int rank, OpType op, uint64_t seq, std::vector<intrusive_ptr<Work>> inner,
             std::shared_ptr<State> st, std::atomic<bool>* no_future = nullptr)
      : Work(rank, op), inner_(std::move(inner)), st_(std::move(st)), seq_(seq),
        start_(Clock::now()) {
    // Ask every inner Work for its Future; gloo's send/recv/reduce-scatter Works have none (and
    // only make progress visible through wait()), so those are completed by the backend's
    // completer thread, the only caller of their wait().
    std::vector<intrusive_ptr<c10::ivalue::Future>> futs;
    lazy_ = no_future && no_future->load(std::memory_order_relaxed);
    for (auto& w : inner_) {
      if (lazy_) break;
      try {
        futs.push_back(w->getFuture());
      } catch (const std::exception&) {
        lazy_ = true;
        if (no_future) no_future->store(true, std::memory_order_relaxed);
      }
    }
    if (inner_.empty()) {
      st_->finish(nullptr);
    } else if (!lazy_) {
      auto remaining = std::make_shared<std::atomic<int>>(static_cast<int>(futs.size()));
      auto st = st_;
      for (auto& f : futs) {
        f->addCallback([remaining, st](c10::ivalue::Future& fut) {
          if (fut.hasError()) st->finish(fut.exception_ptr());
          else if (--*remaining == 0) st->finish(nullptr);
        });
      }
    }
  }

  // Not a hand-over point: c10d polls isCompleted() right before wait(). A lazy Work that is
  // only polled is handed to the completer by the watchdog after 50 ms.
  bool isCompleted() override {
    std::lock_guard<std::mutex> g(st_->mu);
    return st_->done;
  }
  bool isSuccess() const override {
    std::lock_guard<std::mutex> g(st_->mu);
    return st_->done && !st_->error;
  }
  std::exception_ptr exception() const override {
    std::lock_guard<std::mutex> g(st_->mu);
    return st_->error;
  }
  int sourceRank() const override { return inner_.size() == 1 ? inner_[0]->sourceRank() : -1; }
  std::vector<at::Tensor> result() override { return st_->outputs; }
  uint64_t getSequencenumber() const override { return seq_; }
  // A lazy Work's Future needs the completer thread; hand it over only when somebody can
  // observe completion without calling wait() (getFuture, or the watchdog for old unwaited
  // Works), so a plain blocking call costs no thread hand-off.
  intrusive_ptr<c10::ivalue::Future> getFuture() override {
    ensure_completer();
    return st_->future;
  }
  void set_completer(std::shared_ptr<Completer> c) { completer_ = std::move(c); }
  void ensure_completer();

  bool wait(std::chrono::milliseconds timeout) override {
    observed_ = true;
    waiters_++;
    struct Dec { std::atomic<int>& n; ~Dec() { n--; } } dec{waiters_};
    // Exactly one thread may wait on a lazy inner Work (gloo's p2p buffers do not support two
    // waiters): whoever claims it first, this caller or the completer thread.
    bool mine = !lazy_ || !claimed_.exchange(true);
    if (mine) {
      if (!lazy_) spin_until_done();
      try {
        for (auto& w : inner_) w->wait(timeout);
      } catch (...) {
        st_->finish(std::current_exception());
        throw;
      }
      // Complete here rather than waiting for the inner futures' callbacks: they run on the
      // transport thread after it has woken this one, so waiting for them costs a second
      // sleep and wake-up per op (20-50 us with two ranks on two cores). finish() is
      // idempotent, so the callback that comes later is a no-op.
      st_->finish(nullptr);
    }
    // Another thread may own a lazy inner Work; wait() on our Future also makes the current
    // neuron stream wait for the recorded completion events.
    st_->future->wait();
    if (st_->error) std::rethrow_exception(st_->error);
    return true;
  }

  // Poll (yielding the core) for up to TORCH_NEURON_WAIT_SPIN_US before the blocking wait,
  // like NCCL's busy-waiting: a thread that sleeps on a condition variable must be woken by
  // the transport thread, and on a VM whose idle vCPUs halt that wake-up costs 0.2-1 ms, several
  // times a small collective's own time. Lazy inner Works only progress inside wait(), so they
  // are not polled.
  void spin_until_done() const {
    static const auto budget = std::chrono::microseconds(env_int("TORCH_NEURON_WAIT_SPIN_US", 2000));
    if (budget.count() <= 0) return;
    const auto until = Clock::now() + budget;
    auto all_done = [&] {
      for (const auto& w : inner_)
        if (!w->isCompleted()) return false;
      return true;
    };
    while (!all_done() && Clock::now() < until) std::this_thread::yield();
  }

  void abort() override {
    for (auto& w : inner_) w->abort();
    st_->finish(std::make_exception_ptr(std::runtime_error("neuron process group: work aborted")));
  }

  // Completer thread: block on the inner Works (gloo enforces its timeout there).
  void complete_blocking() {
    if (claimed_.exchange(true)) return;  // a caller of wait() owns it
    try {
      for (auto& w : inner_) w->wait();
    } catch (...) {
      st_->finish(std::current_exception());
      return;
    }
    st_->finish(nullptr);
  }
  bool lazy() const { return lazy_; }
  bool done() {
    std::lock_guard<std::mutex> g(st_->mu);
    return st_->done;
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> g(st_->mu);
    return st_->error;
  }
  void fail(const std::string& why) {
    st_->finish(std::make_exception_ptr(std::runtime_error(why)));
  }
  Clock::time_point start() const { return start_; }
  bool observed() const { return observed_; }
  int waiters() const { return waiters_; }
  uint64_t fr_id() const { return st_->fr_id; }

  Clock::time_point failed_seen{};  // when the watchdog first saw it fail (grace period)

 private:
  std::vector<intrusive_ptr<Work>> inner_;
  std::shared_ptr<State> st_;
  uint64_t seq_;
  Clock::time_point start_;
  bool lazy_ = false;
  std::shared_ptr<Completer> completer_;
  std::atomic<bool> queued_{false};
  std::atomic<bool> claimed_{false};
  std::atomic<bool> observed_{false};
  std::atomic<int> waiters_{0};
};

// ---------------------------------------------------------------------------------------------
// Completer: one thread per backend that waits, in issue order, on the Works gloo gives no
// Future for, so their Futures complete without anyone calling wait(). FIFO order cannot
// deadlock: gloo posts sends/receives when they are issued and its transport progresses on its
// own threads; wait() only observes completion. The thread owns its queue through a shared_ptr
// and is detached at shutdown, since it may be blocked in a wait until gloo's timeout.
// Retired: where background threads leave the Works they are done with. The last reference to
// a Work can free tensors whose Python objects need the GIL, and a thread that takes the GIL
// while the interpreter finalizes is ended by pthread_exit in the middle of that destructor
// (std::terminate, seen at exit of scripts that never destroy their process group). So the
// watchdog and the completer never drop a Work themselves: the thread that issues the next
// collective, or the backend's destructor, releases them.
class Retired {
 public:
  void put(intrusive_ptr<NeuronWork> w) {
    std::lock_guard<std::mutex> g(mu_);
    ws_.push_back(std::move(w));
  }
  void put_all(std::vector<intrusive_ptr<NeuronWork>>& ws) {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& w : ws) ws_.push_back(std::move(w));
    ws.clear();
  }
  void release() {
    std::vector<intrusive_ptr<NeuronWork>> ws;
    {
      std::lock_guard<std::mutex> g(mu_);
      ws.swap(ws_);
    }
  }  // destroyed here, outside the lock (a destructor may take the GIL)

 private:
  std::mutex mu_;
  std::vector<intrusive_ptr<NeuronWork>> ws_;
};

class Completer : public std::enable_shared_from_this<Completer> {
 public:
  explicit Completer(std::shared_ptr<Retired> retired) : retired_(std::move(retired)) {}
  void push(const intrusive_ptr<NeuronWork>& w) {
    std::lock_guard<std::mutex> g(mu_);
    if (!started_) {
      started_ = true;
      auto self = shared_from_this();
      std::thread([self] { self->loop(); }).detach();
    }
    q_.push_back(w);
    cv_.notify_one();
  }
  void stop() {
    std::lock_guard<std::mutex> g(mu_);
    stop_ = true;
    cv_.notify_one();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> g(mu_);
    while (true) {
      cv_.wait(g, [&] { return stop_ || !q_.empty(); });
      if (q_.empty()) return;  // stopped and drained
      auto w = q_.front();
      q_.pop_front();
      g.unlock();
      // Leave a blocking caller, which calls wait() right after issuing, a moment to claim the
      // Work itself: that saves a thread hand-off per send/recv/reduce-scatter.
      auto age = Clock::now() - w->start();
      if (age < std::chrono::milliseconds(1)) std::this_thread::sleep_for(std::chrono::milliseconds(1) - age);
      w->complete_blocking();
      retired_->put(std::move(w));
      g.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<intrusive_ptr<NeuronWork>> q_;
  std::shared_ptr<Retired> retired_;
  bool started_ = false, stop_ = false;
};

void NeuronWork::ensure_completer() {
  if (!lazy_ || !completer_ || claimed_ || queued_.exchange(true)) return;
  completer_->push(c10::intrusive_ptr<NeuronWork>::reclaim_copy(this));
}

class ProcessGroupNeuron : public c10d::Backend {
 public:
  ProcessGroupNeuron(intrusive_ptr<c10d::Backend> inner, int rank, int size, double timeout_s,
                     std::string group_name)
      : Backend(rank, size), inner_(std::move(inner)),
        timeout_(static_cast<int64_t>(timeout_s * 1000)), group_name_(std::move(group_name)),
        handling_(env_int("TORCH_NEURON_ASYNC_ERROR_HANDLING", 1)) {
    if (env_int("TORCH_NEURON_ENABLE_MONITORING", 1)) watchdog_ = std::thread([this] { watch(); });
  }
  ~ProcessGroupNeuron() override {
    stop_watchdog();
    completer_->stop();
  }

  const std::string getBackendName() const override { return "neuron"; }
  bool supportsCoalescing() const override { return true; }

  void setTimeout(std::chrono::milliseconds t) override {
    timeout_ = t;
    inner_->setTimeout(t);
  }
  void setGroupUid(const std::string& uid) override {
    Backend::setGroupUid(uid);
    inner_->setGroupUid(uid);
  }
  void setSequenceNumberForGroup() override { inner_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return seq_; }
  c10d::ErrorType getError() override { return error_; }
  void abort() override {
    abort_inflight("process group aborted");
  }
  void shutdown() override { stop_watchdog(); }

  // ---- coalescing: ops run as issued; endCoalescing returns one Work over all of them.
  void startCoalescing() override {
    TORCH_CHECK(!coalescing_, "neuron process group: startCoalescing called twice");
    coalescing_ = true;
    coalesced_.clear();
  }
  intrusive_ptr<Work> endCoalescing() override {
    TORCH_CHECK(coalescing_, "neuron process group: endCoalescing without startCoalescing");
    coalescing_ = false;
    std::vector<intrusive_ptr<Work>> works(coalesced_.begin(), coalesced_.end());
    std::vector<at::Tensor> outs;
    std::vector<c10::Device> devs;
    for (auto& w : works)
      for (auto& t : w->result()) {
        outs.push_back(t);
        collect_devices(t, devs);
      }
    coalesced_.clear();
    auto st = make_state(outs, {}, devs);
    return c10::make_intrusive<NeuronWork>(getRank(), OpType::COALESCED, seq_, std::move(works),
                                           st);
  }

  // ---- collectives
  intrusive_ptr<Work> broadcast(std::vector<at::Tensor>& ts,
                                const c10d::BroadcastOptions& opts) override {
    return run(OpType::BROADCAST, ts, ts, [&] {
      auto a = host_alias(ts, true);
      return inner_->broadcast(a, opts);
    });
  }
  intrusive_ptr<Work> allreduce(std::vector<at::Tensor>& ts,
                                const c10d::AllreduceOptions& opts) override {
    auto a = host_alias(ts, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    return run(OpType::ALLREDUCE, ts, ts, [&] {
      premul_in_place(a, fix);
      return inner_->allreduce(a, o);
    }, fix.avg ? divider(a) : nullptr);
  }
  intrusive_ptr<Work> allreduce_coalesced(std::vector<at::Tensor>& ts,
                                          const c10d::AllreduceCoalescedOptions& opts) override {
    auto a = host_alias(ts, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    return run(OpType::ALLREDUCE_COALESCED, ts, ts, [&] {
      premul_in_place(a, fix);
      return inner_->allreduce_coalesced(a, o);
    }, fix.avg ? divider(a) : nullptr);
  }
  intrusive_ptr<Work> reduce(std::vector<at::Tensor>& ts,
                             const c10d::ReduceOptions& opts) override {
    auto a = host_alias(ts, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    bool root = opts.rootRank == getRank();
    return run(OpType::REDUCE, ts, ts, [&] {
      premul_in_place(a, fix);
      return inner_->reduce(a, o);
    }, fix.avg && root ? divider(a) : nullptr);
  }
  intrusive_ptr<Work> allgather(std::vector<std::vector<at::Tensor>>& outs,
                                std::vector<at::Tensor>& ins,
                                const c10d::AllgatherOptions& opts) override {
    return run(OpType::ALLGATHER, flat(outs), ins, [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      return inner_->allgather(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                      const c10d::AllgatherOptions& opts) override {
    return run(OpType::_ALLGATHER_BASE, {out}, {in}, [&] {
      auto ai = gather_input_view(host_alias(in, true));
      auto ao = gather_output_view(host_alias(out, true), out, in, getSize());
      return inner_->_allgather_base(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outs,
                                          std::vector<at::Tensor>& ins,
                                          const c10d::AllgatherOptions& opts) override {
    return run(OpType::ALLGATHER_COALESCED, flat(outs), ins, [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      return inner_->allgather_coalesced(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outs,
                                                      std::vector<at::Tensor>& ins,
                                                      const c10d::AllgatherOptions& opts) override {
    TORCH_CHECK_VALUE(outs.size() == ins.size(), "neuron process group: allgather_into_tensor_coalesced: ",
                      outs.size(), " outputs for ", ins.size(), " inputs");
    return run(OpType::ALLGATHER_COALESCED, outs, ins, [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      for (size_t i = 0; i < ao.size(); ++i) {
        ao[i] = gather_output_view(ao[i], outs[i], ins[i], getSize());
        ai[i] = gather_input_view(ai[i]);
      }
      return inner_->allgather_into_tensor_coalesced(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> gather(std::vector<std::vector<at::Tensor>>& outs,
                             std::vector<at::Tensor>& ins,
                             const c10d::GatherOptions& opts) override {
    return run(OpType::GATHER, flat(outs), ins, [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      return inner_->gather(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> scatter(std::vector<at::Tensor>& outs,
                              std::vector<std::vector<at::Tensor>>& ins,
                              const c10d::ScatterOptions& opts) override {
    return run(OpType::SCATTER, outs, flat(ins), [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      return inner_->scatter(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> reduce_scatter(std::vector<at::Tensor>& outs,
                                     std::vector<std::vector<at::Tensor>>& ins,
                                     const c10d::ReduceScatterOptions& opts) override {
    auto ao = host_alias(outs, false);
    auto ai = host_alias(ins, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    return run(OpType::REDUCE_SCATTER, outs, flat(ins), [&] {
      if (fix.premul)
        for (auto& v : ai) v = premul_copy(v, fix);
      return inner_->reduce_scatter(ao, ai, o);
    }, fix.avg ? divider(ao) : nullptr);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& opts) override {
    auto ao = host_alias(out, false);
    auto ai = host_alias(in, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    return run(OpType::_REDUCE_SCATTER_BASE, {out}, {in}, [&] {
      if (fix.premul) ai = ai.mul(*fix.premul);
      return inner_->_reduce_scatter_base(ao, ai, o);
    }, fix.avg ? divider({ao}) : nullptr);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
      const c10d::ReduceScatterOptions& opts) override {
    auto ao = host_alias(outs, false);
    auto ai = host_alias(ins, false);
    auto o = opts;
    auto fix = fix_op(o.reduceOp);
    return run(OpType::REDUCE_SCATTER_TENSOR_COALESCED, outs, ins, [&] {
      ai = premul_copy(ai, fix);
      return inner_->reduce_scatter_tensor_coalesced(ao, ai, o);
    }, fix.avg ? divider(ao) : nullptr);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                    std::vector<int64_t>& out_splits,
                                    std::vector<int64_t>& in_splits,
                                    const c10d::AllToAllOptions& opts) override {
    return run(OpType::ALLTOALL_BASE, {out}, {in}, [&] {
      auto ao = host_alias(out, true);
      auto ai = host_alias(in, true);
      return inner_->alltoall_base(ao, ai, out_splits, in_splits, opts);
    });
  }
  intrusive_ptr<Work> alltoall(std::vector<at::Tensor>& outs, std::vector<at::Tensor>& ins,
                               const c10d::AllToAllOptions& opts) override {
    return run(OpType::ALLTOALL, outs, ins, [&] {
      auto ao = host_alias(outs, true);
      auto ai = host_alias(ins, true);
      return inner_->alltoall(ao, ai, opts);
    });
  }
  intrusive_ptr<Work> send(std::vector<at::Tensor>& ts, int dst, int tag) override {
    return run(OpType::SEND, {}, ts, [&] {
      auto a = host_alias(ts, true);
      return inner_->send(a, dst, tag);
    });
  }
  intrusive_ptr<Work> recv(std::vector<at::Tensor>& ts, int src, int tag) override {
    return run(OpType::RECV, ts, {}, [&] {
      auto a = host_alias(ts, true);
      return inner_->recv(a, src, tag);
    });
  }
  intrusive_ptr<Work> recvAnysource(std::vector<at::Tensor>& ts, int tag) override {
    return run(OpType::RECVANYSOURCE, ts, {}, [&] {
      auto a = host_alias(ts, true);
      return inner_->recvAnysource(a, tag);
    });
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& opts) override {
    return run(OpType::BARRIER, {}, {}, [&] { return inner_->barrier(opts); });
  }
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override {
    inner_->monitoredBarrier(opts, wait_all_ranks);
  }

  std::string dump() { return FlightRecorder::get().dump(); }
  int inflight() {
    std::lock_guard<std::mutex> g(wd_mu_);
    return static_cast<int>(inflight_.size());
  }

 private:
  static std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& v) {
    std::vector<at::Tensor> out;
    for (const auto& x : v) out.insert(out.end(), x.begin(), x.end());
    return out;
  }
  // gloo has neither AVG nor PREMUL_SUM: both run as SUM. AVG divides the result by the group
  // size before the Work completes (divider). PREMUL_SUM(f) (FSDP2 with a gradient divide
  // factor) multiplies each rank's input by that rank's f before the sum, as NCCL does: in place
  // for allreduce and reduce, whose buffer the result overwrites anyway, and on a scaled copy for
  // the reduce-scatters, whose input must stay untouched.
  struct OpFix {
    bool avg = false;
    std::optional<double> premul;
  };
  OpFix fix_op(c10d::ReduceOp& op) {
    OpFix f;
    if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
      auto* s = dynamic_cast<c10d::PreMulSumSupplement*>(op.supplement_.get());
      TORCH_CHECK(s != nullptr, "neuron process group: ReduceOp.PREMUL_SUM without a factor");
      f.premul = s->tensor_factor.defined() ? s->tensor_factor.item<double>() : s->double_factor;
    } else if (op.op_ != c10d::ReduceOp::AVG) {
      return f;
    } else {
      f.avg = true;
    }
    op = c10d::ReduceOp(c10d::ReduceOp::SUM);
    return f;
  }
  static void premul_in_place(const std::vector<at::Tensor>& a, const OpFix& f) {
    if (f.premul)
      for (auto t : a) t.mul_(*f.premul);
  }
  static std::vector<at::Tensor> premul_copy(const std::vector<at::Tensor>& a, const OpFix& f) {
    if (!f.premul) return a;
    std::vector<at::Tensor> out;
    for (const auto& t : a) out.push_back(t.mul(*f.premul));
    return out;
  }
  std::function<void()> divider(std::vector<at::Tensor> aliases) {
    int64_t n = getSize();
    return [aliases, n] {
      for (auto t : aliases) {
        if (at::isIntegralType(t.scalar_type(), /*includeBool=*/true))
          t.div_(n, "floor");
        else
          t.div_(n);
      }
    };
  }

  std::shared_ptr<State> make_state(const std::vector<at::Tensor>& outs,
                                    const std::vector<at::Tensor>& ins,
                                    const std::vector<c10::Device>& devs) {
    auto st = std::make_shared<State>();
    st->outputs = outs;
    st->stash = outs;
    st->stash.insert(st->stash.end(), ins.begin(), ins.end());
    st->future = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()), devs);
    return st;
  }

  static std::vector<std::vector<int64_t>> sizes_of(const std::vector<at::Tensor>& v) {
    std::vector<std::vector<int64_t>> out;
    for (size_t i = 0; i < v.size() && i < 8; ++i) out.push_back(v[i].sizes().vec());
    return out;
  }

  // Profiling: what the collective's device activity will carry (completed in State::finish).
  void begin_trace(State& st, OpType op, uint64_t seq, const std::vector<at::Tensor>& outs,
                   const std::vector<at::Tensor>& ins, const std::vector<c10::Device>& devs) {
    auto t = std::make_unique<CollectiveTrace>();
    t->name = cc_kernel_name(op);
    t->device = devs.empty() ? 0 : devs[0].index();
    t->external = g_trace->current_correlation();
    t->tid = g_trace->thread_id();
    t->launch_start = g_trace->now_ns();
    int64_t in_bytes = 0, out_bytes = 0;
    for (const auto& x : ins) {
      in_bytes += static_cast<int64_t>(x.numel()) * x.element_size();
      g_trace->encode_tensor(t->tensors, x, 0);
    }
    for (const auto& x : outs) {
      out_bytes += static_cast<int64_t>(x.numel()) * x.element_size();
      g_trace->encode_tensor(t->tensors, x, 1);
    }
    t->bytes = std::max(in_bytes, out_bytes);
    int64_t issue_stream = 0;
    if (!devs.empty()) {
      c10::impl::VirtualGuardImpl impl(devs[0].type());
      issue_stream = impl.getStream(devs[0]).id();
    }
    const std::string pg = getGroupUid().empty() ? group_name_ : getGroupUid();
    auto add = [&t](const std::string& k, const std::string& v) {
      t->meta += k + '\x1f' + v + '\x1e';
    };
    add("op", std::string("\"") + op_name(op) + "\"");
    add("pg", "\"" + pg + "\"");
    add("seq", std::to_string(seq));
    add("group_size", std::to_string(getSize()));
    add("group_rank", std::to_string(getRank()));
    add("total_bytes", std::to_string(t->bytes));
    add("issue_stream", std::to_string(issue_stream));
    const auto& any = !ins.empty() ? ins : outs;
    if (!any.empty()) add("cc_dtype", std::string("\"") + c10::toString(any[0].scalar_type()) + "\"");
    st.trace = std::move(t);
  }

  template <typename F>
  intrusive_ptr<Work> run(OpType op, const std::vector<at::Tensor>& outs,
                          const std::vector<at::Tensor>& ins, F&& launch,
                          std::function<void()> post = nullptr) {
    std::vector<c10::Device> devs;
    for (const auto& t : outs) collect_devices(t, devs);
    for (const auto& t : ins) collect_devices(t, devs);
    sync_producers(devs);
    auto st = make_state(outs, ins, devs);
    st->post = std::move(post);
    uint64_t seq = ++seq_;
    FrEntry e;
    e.pg = getGroupUid().empty() ? group_name_ : getGroupUid();
    e.op = op_name(op);
    e.seq = seq;
    e.rank = getRank();
    e.ins = sizes_of(ins);
    e.outs = sizes_of(outs);
    const auto& any = !ins.empty() ? ins : outs;
    if (!any.empty()) e.dtype = any[0].scalar_type();
    st->fr_id = FlightRecorder::get().record(std::move(e));
    if (g_trace && g_trace->active()) begin_trace(*st, op, seq, outs, ins, devs);
    intrusive_ptr<Work> inner;
    try {
      inner = launch();
    } catch (...) {
      FlightRecorder::get().complete(st->fr_id, "failed");
      throw;
    }
    if (st->trace) st->trace->launch_end = g_trace->now_ns();
    auto w = c10::make_intrusive<NeuronWork>(getRank(), op, seq,
                                             std::vector<intrusive_ptr<Work>>{inner}, st,
                                             &no_future_[static_cast<uint8_t>(op)]);
    if (coalescing_) coalesced_.push_back(w);
    if (w->lazy()) w->set_completer(completer_);
    if (watchdog_.joinable()) {
      std::lock_guard<std::mutex> g(wd_mu_);
      inflight_.push_back(w);
    }
    retired_->release();
    // No notify: the watchdog polls every 100 ms; waking it per op costs a context switch.
    return w;
  }

  // ---- watchdog
  // Polls in-flight Works. A Work that failed or outlived the timeout while nobody waits for it
  // (an async op never waited on, or a blocking op whose transport is stuck past the timeout)
  // is a fault: log it, dump the flight recorder, then act on TORCH_NEURON_ASYNC_ERROR_HANDLING
  // (NCCL's values): 0 none, 1 tear down (abort in-flight work, then abort the process),
  // 2 clean up only (fail in-flight work, keep the process), 3 tear down without cleanup.
  // A Work somebody is waiting on gets its error in that thread instead (gloo enforces the
  // timeout), so the watchdog does not race the user's exception.
  void watch() {
    const auto grace = std::chrono::milliseconds(env_int("TORCH_NEURON_WATCHDOG_GRACE_MS", 2000));
    std::unique_lock<std::mutex> g(wd_mu_);
    while (!stop_) {
      wd_cv_.wait_for(g, std::chrono::milliseconds(100));
      if (stop_) break;
      auto now = Clock::now();
      std::vector<intrusive_ptr<NeuronWork>> keep, gone;
      intrusive_ptr<NeuronWork> fault;
      std::string why;
      for (auto& w : inflight_) {
        if (w->done()) {
          if (!w->error() || w->observed()) {  // success, or reported to a waiter
            gone.push_back(w);
            continue;
          }
          if (w->failed_seen == Clock::time_point{}) w->failed_seen = now;
          // A failure past the timeout (gloo's own timeout) is acted on at once; an early one
          // gets a grace period so a blocking caller can reach wait() and take the error.
          if ((now - w->start() >= timeout_ || now - w->failed_seen > grace) && !fault) {
            fault = w;
            why = "failed while no one was waiting for it";
          }
          keep.push_back(w);
          continue;
        }
        auto age = now - w->start();
        if (w->waiters() == 0 && age > std::chrono::milliseconds(50)) w->ensure_completer();
        bool stuck = w->waiters() == 0 ? age > timeout_ : age > timeout_ + grace;
        if (stuck && !fault) {
          fault = w;
          why = "timed out";
        }
        keep.push_back(w);
      }
      if (fault)  // reported once; the Work itself carries the error from here on
        keep.erase(std::remove(keep.begin(), keep.end(), fault), keep.end());
      inflight_.swap(keep);
      keep.clear();  // the old list: every Work in it is now in inflight_, gone or fault
      retired_->put_all(gone);
      if (fault) {
        g.unlock();
        on_fault(fault, why);
        retired_->put(std::move(fault));
        g.lock();
      }
    }
  }

  void on_fault(const intrusive_ptr<NeuronWork>& w, const std::string& why) {
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(Clock::now() - w->start());
    std::ostringstream msg;
    msg << "[torchneuron rank " << getRank() << "] watchdog: collective "
        << op_name(w->retrieveOpType()) << " (SeqNum=" << w->getSequencenumber()
        << ", pg=" << (getGroupUid().empty() ? group_name_ : getGroupUid()) << ") " << why
        << " after " << ms.count() << " ms (timeout " << timeout_.count() << " ms)";
    if (auto e = w->error()) {
      try {
        std::rethrow_exception(e);
      } catch (const std::exception& ex) {
        msg << ": " << ex.what();
      } catch (...) {
      }
    }
    error_ = why == "timed out" ? c10d::ErrorType::TIMEOUT : c10d::ErrorType::COMM_ERROR;
    FlightRecorder::get().set_state(w->fr_id(), why == "timed out" ? "timed_out" : "failed");
    std::string dump = FlightRecorder::get().dump();
    std::fprintf(stderr, "%s\n[torchneuron rank %d] flight recorder (oldest first):\n%s",
                 msg.str().c_str(), getRank(), dump.c_str());
    if (const char* prefix = std::getenv("TORCH_NEURON_FR_DUMP_FILE")) {
      std::ofstream f(std::string(prefix) + std::to_string(getRank()));
      f << "# " << msg.str() << "\n" << dump;
    }
    std::fflush(stderr);
    switch (handling_) {
      case 0:
        w->fail(msg.str());
        break;
      case 2:
        abort_inflight(msg.str());
        break;
      case 3:
        std::abort();
      default:  // 1: tear down
        abort_inflight(msg.str());
        std::fprintf(stderr, "[torchneuron rank %d] aborting the process "
                     "(TORCH_NEURON_ASYNC_ERROR_HANDLING=1)\n", getRank());
        std::fflush(stderr);
        std::abort();
    }
  }

  void abort_inflight(const std::string& why) {
    std::vector<intrusive_ptr<NeuronWork>> ws;
    {
      std::lock_guard<std::mutex> g(wd_mu_);
      ws.swap(inflight_);
    }
    for (auto& w : ws) {
      try {
        w->abort();
      } catch (...) {
      }
      w->fail(why);
    }
    retired_->put_all(ws);  // may run on the watchdog thread
  }

  void stop_watchdog() {
    {
      std::lock_guard<std::mutex> g(wd_mu_);
      stop_ = true;
    }
    wd_cv_.notify_all();
    if (watchdog_.joinable() && watchdog_.get_id() != std::this_thread::get_id()) watchdog_.join();
  }

  intrusive_ptr<c10d::Backend> inner_;
  std::shared_ptr<Retired> retired_ = std::make_shared<Retired>();
  std::shared_ptr<Completer> completer_ = std::make_shared<Completer>(retired_);
  std::array<std::atomic<bool>, 256> no_future_{};  // by OpType: inner Works lack a Future
  std::chrono::milliseconds timeout_;
  std::string group_name_;
  int handling_;
  std::atomic<uint64_t> seq_{0};
  std::atomic<c10d::ErrorType> error_{c10d::ErrorType::SUCCESS};
  bool coalescing_ = false;
  std::vector<intrusive_ptr<Work>> coalesced_;
  std::mutex wd_mu_;
  std::condition_variable wd_cv_;
  std::vector<intrusive_ptr<NeuronWork>> inflight_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace torchneuron_dist

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using torchneuron_dist::ProcessGroupNeuron;
  // Base class c10d::Backend is torch._C._distributed_c10d.Backend (pybind type sharing).
  py::module::import("torch.distributed");
  // The profiler's trace API from the device extension (see backend/trace_api.h).
  try {
    py::object cap = py::module::import("torchneuron._C").attr("_trace_api");
    auto* api = static_cast<const torchneuron::TraceApi*>(
        PyCapsule_GetPointer(cap.ptr(), "torchneuron._trace_api"));
    if (api && api->version == torchneuron::kTraceApiVersion) torchneuron_dist::g_trace = api;
  } catch (py::error_already_set&) {
    PyErr_Clear();  // no device extension: collectives are simply not traced
  }
  py::class_<ProcessGroupNeuron, c10d::Backend, c10::intrusive_ptr<ProcessGroupNeuron>>(
      m, "ProcessGroupNeuron")
      .def(py::init<c10::intrusive_ptr<c10d::Backend>, int, int, double, std::string>(),
           py::arg("inner"), py::arg("rank"), py::arg("size"), py::arg("timeout_s"),
           py::arg("group_name") = "", py::call_guard<py::gil_scoped_release>())
      .def("_inflight", &ProcessGroupNeuron::inflight)
      .def("_dump_flight_recorder", &ProcessGroupNeuron::dump);
  m.def("_dump_flight_recorder", [] { return torchneuron_dist::FlightRecorder::get().dump(); });
}
