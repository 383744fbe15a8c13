// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11), the
// counter-based generator behind curand and CUDA's PyTorch generator.
//
// Word layout (curand's): the word at (seed, subsequence j, offset p) is lane p % 4 of the block
// Philox(key = (seed lo, seed hi), counter = ((p / 4) lo, (p / 4) hi, j, 0)). Random kernels give
// element i of an op at generator offset o the words at offset o + i, subsequence 0, 1, ... so an
// element's value depends only on (seed, o + i): any slice of a random tensor is the same op run
// at offset o + (slice start), which is what DTensor's sharded random ops rely on.
#pragma once

#include <cstdint>

namespace torchneuron::philox {

constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;  // round multipliers
constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;  // key schedule (golden ratio, sqrt(3)-1)

// One block: counter c (in/out: becomes the 4 output words), key (k0, k1).
inline void block(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int r = 0; r < 10; ++r) {
    const uint64_t p0 = static_cast<uint64_t>(kM0) * c[0];
    const uint64_t p1 = static_cast<uint64_t>(kM1) * c[2];
    const uint32_t n0 = static_cast<uint32_t>(p1 >> 32) ^ c[1] ^ k0;
    const uint32_t n2 = static_cast<uint32_t>(p0 >> 32) ^ c[3] ^ k1;
    c[0] = n0;
    c[1] = static_cast<uint32_t>(p1);
    c[2] = n2;
    c[3] = static_cast<uint32_t>(p0);
    k0 += kW0;
    k1 += kW1;
  }
}

// The word at (seed, subsequence, offset position p).
inline uint32_t word(uint64_t seed, uint32_t subsequence, uint64_t p) {
  const uint64_t b = p / 4;
  uint32_t c[4] = {static_cast<uint32_t>(b), static_cast<uint32_t>(b >> 32), subsequence, 0};
  block(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return c[p % 4];
}

// words[4 * i + l] = lane l of block (first_block + i) of `subsequence`, for i < nblocks:
// the words of positions 4 * first_block ... 4 * (first_block + nblocks) - 1. Vectorized (AVX2,
// 8 blocks per step) when the CPU has it.
void fill(uint64_t seed, uint64_t first_block, uint32_t subsequence, int64_t nblocks, uint32_t* words);

}  // namespace torchneuron::philox
