// Sharing neuron storages between processes (torch.multiprocessing), with CUDA's rules.
//
// Device memory is a shareable file per device (runtime.h), so a storage is exported as
// (device, heap file, offset, size) and the receiving process maps the same pages: nothing
// is copied, and writes on either side are seen by the other.
//
// Lifetime, as CUDA IPC (torch/csrc/CudaIPCTypes.cpp): every export gets a reference
// counter in shared memory (in the same heap file), set to 1. The producer's storage is put
// behind a "sent" DataPtr that owns the original allocation; when the producer drops the
// storage while a consumer still holds it (counter > 0), the block stays allocated in a
// limbo list instead of returning to the caching allocator, where it would be reused and
// overwritten. The consumer decrements the counter when its storage dies; the limbo is
// collected whenever another sent block is freed, on ipc_collect(), and before the
// allocator reports out-of-memory.
#pragma once

#include <c10/core/Storage.h>

#include <cstddef>

namespace torchneuron {

struct IpcHandle {
  int device;
  int fd;                 // the producer's heap file for the device (dup it before sending)
  size_t offset;          // of the storage's first byte in that file
  size_t nbytes;
  size_t counter_offset;  // of the storage's reference counter in that file
};

// Producer: export a (non-empty) neuron storage. Memory adopted from the host allocator
// (a CPU kernel's fresh result) is first moved into device memory, in place, as CPU tensors
// move into shared memory on their first share.
IpcHandle ipc_export(const c10::Storage& storage);

// Consumer: map an exported storage on the same device index (not resizable, and, as CUDA's
// IPC memory, not counted by this process's allocator: the producer owns and counts it).
c10::Storage ipc_import(const IpcHandle& handle);

// Consumer: give back the reference of a storage that was already imported (a storage sent
// twice maps once).
void ipc_release_counter(int fd, size_t counter_offset);

// Producer: free the blocks in limbo whose consumers have all released them.
// Returns whether anything was freed.
bool ipc_collect();
size_t ipc_limbo_size();

}  // namespace torchneuron
