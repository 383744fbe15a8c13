// Transposing copies at memory speed.
//
// `x.t().contiguous()` (or any copy between a row-major and a column-major layout of the last two
// dims) is a staple of training code: torchao casts every fp8 operand of _scaled_mm into the
// layout the GEMM wants, attention and GEMM backward transpose their operands. CPU's copy kernel
// walks the strided side one element at a time, and at power-of-two leading dimensions its column
// reads collide in the same cache sets: 1.2 ms for a 1024 x 2048 bf16 transpose, 14x a plain copy.
// Here the copy goes through small tiles staged in L1, so both sides stream through whole cache
// lines. Element order is all that changes, so the bytes are exactly those of CPU's copy.
#pragma once

#include <ATen/core/Tensor.h>

namespace torchneuron::transpose {

// dst.copy_(src) for two dense tensors of one dtype (1, 2 or 4 bytes an element, no conjugate or
// negative bit) and one shape whose memory orders differ by a rotation after common outer dims:
// src is batch x (P x Q) in memory and dst batch x (Q x P) (`x.t().contiguous()`, stacked
// matrices, NCHW <-> NHWC), with no byte in common. The tensors are CPU tensors (aliases of
// device memory). Returns false, doing nothing, otherwise (and when P or Q is below 16
// elements, too small to gain). 8-byte elements stay with CPU's copy: 64 x 64 tiles of them
// overflow L1 and smaller ones measured no faster than CPU.
bool try_copy(const at::Tensor& dst, const at::Tensor& src);

}  // namespace torchneuron::transpose
