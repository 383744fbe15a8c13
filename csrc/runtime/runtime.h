// The emulated Neuron runtime: a small device API in the shape of a CUDA/Neuron runtime.
//
// It knows nothing of PyTorch (no ATen, no c10 types): devices are logical NeuronCores whose
// "HBM" is host memory with a capacity, streams are ordered queues, events are timestamps.
// Execution is synchronous unless the execution engine (engine.h) queued work: then a stream
// or event is complete when the work enqueued on it before has run, and query / synchronize
// observe or wait for that. A real runtime could replace this file without touching the
// layers above it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace neuron::rt {

constexpr int kMaxDevices = 512;
constexpr int kStreamsPerPool = 32;  // pool streams per priority, like CUDA
constexpr int kNumPriorities = 2;    // priority 0 (low) and -1 (high)

// --- devices ---------------------------------------------------------------------------
// Called once by the Python layer with the capacity of each visible device (bytes).
void configure(const std::vector<size_t>& capacities);
int device_count() noexcept;
size_t capacity(int device);
void check_device(int device);  // throws std::out_of_range with a helpful message
// What this process may hold on the device (torch.neuron.set_per_process_memory_fraction, as
// CUDA's: a fraction of the capacity, 1 by default); reserve() enforces it.
void set_memory_fraction(int device, double fraction);
double memory_fraction(int device);
size_t memory_limit(int device);

// Thread-local current device (default 0).
int current_device() noexcept;
void set_current_device(int device);

// Lazy initialisation and CUDA's fork rule: the runtime initialises on first real use;
// a child forked after that cannot use it.
void lazy_init();  // throws std::runtime_error in a bad fork
bool is_initialized() noexcept;
bool in_bad_fork() noexcept;

// --- device memory (HBM) ---------------------------------------------------------------
// Raw segment allocation with the device's capacity enforced; returns nullptr when the
// device is full. reserve/release account bytes that were allocated elsewhere (adopted).
//
// A device's memory is one shareable file per process (a memfd, the "heap file"), mapped
// piece by piece: every segment is a page-aligned range of it. That is what makes device
// memory exportable to other processes (the emulated counterpart of CUDA IPC handles): a
// byte of device memory is (heap file, offset), and another process that holds the file
// descriptor maps the same pages.
void* malloc(int device, size_t nbytes);
void free(int device, void* ptr, size_t nbytes) noexcept;
bool reserve(int device, size_t nbytes) noexcept;
void release(int device, size_t nbytes) noexcept;
size_t used(int device) noexcept;

// Expandable segments (PYTORCH_ALLOC_CONF expandable_segments:True), CUDA's
// cuMemAddressReserve / cuMemMap / cuMemUnmap: a range of address space backed, byte for byte,
// by a range of the heap file whose pages are mapped and unmapped in place, so a segment grows
// and shrinks without moving. Reserving takes no capacity; mapping takes capacity for what it
// maps and fails (false) past the device's limit; unmapping drops the pages and returns their
// capacity. Ranges are page multiples inside a reservation. reserve_address_space returns
// nullptr when the host has no address space or file room left.
void* reserve_address_space(int device, size_t nbytes);
bool map_pages(int device, void* ptr, size_t nbytes) noexcept;
// `keep`: leave the pages in the file (the most recent, up to the same 64 MiB per device that
// freed segments keep), so mapping them again costs no page faults; they hold stale bytes then.
void unmap_pages(int device, void* ptr, size_t nbytes, bool keep = false) noexcept;
void release_address_space(int device, void* ptr) noexcept;

// --- interprocess sharing ----------------------------------------------------------------
struct SharedRange {
  int fd;         // the device's heap file (owned by the runtime: dup it to pass it on)
  size_t offset;  // of the byte in that file
};
// Where `ptr` lives in this process's heap file of `device`; false if the runtime did not
// allocate it (memory adopted from the host allocator).
bool find_shared(int device, const void* ptr, SharedRange* out);
// Memory in the heap file outside the device's capacity, for the runtime's own bookkeeping
// that other processes must see (IPC reference counters). Throws std::runtime_error.
void* malloc_aux(int device, size_t nbytes);
// Map bytes [offset, offset + nbytes) of another process's heap file (an fd received from
// it); returns the address of `offset`. Throws std::runtime_error.
void* map_shared(int fd, size_t offset, size_t nbytes);
void unmap_shared(void* ptr, size_t nbytes) noexcept;

// --- streams ---------------------------------------------------------------------------
// A stream id is 0 for the default stream, else 1 + priority_slot * kStreamsPerPool + idx.
int64_t default_stream_id() noexcept;
int64_t pool_stream_id(int device, int priority) noexcept;  // round-robin over the pool
int stream_priority(int64_t stream_id) noexcept;
int64_t current_stream(int device) noexcept;
void set_current_stream(int device, int64_t stream_id) noexcept;
// A stream is idle once the work the engine queued on it has run (always, without the
// engine). query and synchronize also let the host *observe* that (see below). The
// synchronizations throw the error of a kernel that failed asynchronously (engine.h).
bool query_stream(int device, int64_t stream_id) noexcept;
void synchronize_stream(int device, int64_t stream_id);
void synchronize_device(int device);

// --- host-observed progress ------------------------------------------------------------
// Work is complete when submitted, but memory reuse across streams must follow the rules of
// an asynchronous device, or code that is only correct here would corrupt data on Trainium:
// a block the caching allocator freed while another stream still used it (record_stream) is
// reused only once the host has *observed* that stream past the free. Each stream numbers
// its marks (event records, the allocator's free-time marks); the host's watermark per
// stream advances when it synchronizes the stream, the device, or an event, queries a stream
// or event (true: complete), or waits for a device-to-host copy on the stream.
// Streams outside the known id range (0 .. 2 * kStreamsPerPool) count as always observed.
uint64_t mark_stream(int device, int64_t stream_id) noexcept;  // a new mark; its number
bool observed(int device, int64_t stream_id, uint64_t mark) noexcept;
void observe(int device, int64_t stream_id, uint64_t mark) noexcept;  // watermark >= mark
void observe_stream(int device, int64_t stream_id) noexcept;  // every mark so far

// --- events ----------------------------------------------------------------------------
struct Event {
  int device = -1;
  int64_t stream_id = 0;
  bool recorded = false;
  bool timing = false;
  int64_t time_ns = 0;  // steady-clock time at which all prior work on the stream completed
  uint64_t mark = 0;    // the stream's mark at the record (host-observed progress)
  uint64_t seq = 0;     // the engine's work the event waits for (0: none was pending)
};
void record_event(Event* event, int device, int64_t stream_id) noexcept;
// Host waits for the event (traced as a sync); throws an asynchronous kernel error.
void synchronize_event(const Event* event);
// Whether the event has completed (the work queued before its record has run); if so the
// host observes it.
bool query_event(const Event* event) noexcept;
// Future work on (device, stream_id) waits for the event: a wait marker in the engine's queue
// when the event is behind queued work (traced for the profiler's timeline).
void wait_event(const Event* event, int device, int64_t stream_id) noexcept;
// Milliseconds from start to end, measured when the work before each record completed
// (device-side time); throws std::invalid_argument if either is unusable (not timing, not
// recorded, not completed yet, or recorded on different devices).
double elapsed_ms(const Event& start, const Event& end);
int64_t now_ns() noexcept;

}  // namespace neuron::rt
