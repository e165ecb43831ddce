// The 2:4 copy of a packed weight (docs/FORMAT.md "A 2:4 copy"), written on the device: the bytes
// nmcli.format.two_of_four_copy writes on the host. The dispatch stages it in a call's workspace
// where the sparse tensor cores read a large call faster as 2:4 than regrouped in every block
// (dispatch.cu, stages_copy).
#include "kernels.cuh"
#include "nm_matmul_cuda.h"

namespace nmcli {
namespace {

constexpr int kCopyThreads = 128;
constexpr int kCopyBlocksPerSm = 16;  // 2048 threads an SM: at most 32 registers a thread
constexpr size_t kCopyPartAlign = 256;  // the copy's offset words start this far into the buffer, at least

// Grids of these kernels: x along a weight row's words (or blocks) of the copy, y along the rows
// (a row per y index, striding by gridDim.y past 65535 rows).
dim3 copy_grid(int64_t per_row, int64_t rows) {
  return dim3(static_cast<unsigned>((per_row + kCopyThreads - 1) / kCopyThreads),
              static_cast<unsigned>(rows < 65535 ? rows : 65535));
}

// A block of 4 positions as the copy stores it, from the entries the weight holds there (found:
// 0, 1 or 2 of them, in position order, at offsets at0 < at1 with values value0, value1): filled
// up to two with the lowest free positions (value 0). Sets the two values (the first in the low
// half) and their 2-bit offsets (the first in the low bits).
__device__ __forceinline__ void copy_block(int found, uint32_t at0, uint32_t value0, uint32_t at1, uint32_t value1,
                                           uint32_t& pair, uint32_t& fields) {
  if (found == 1) {  // add the lowest free position, keeping the two in order
    const uint32_t free_at = at0 == 0 ? 1 : 0;
    if (free_at < at0) {
      at1 = at0, value1 = value0;
      at0 = free_at, value0 = 0;
    } else {
      at1 = free_at, value1 = 0;
    }
  } else if (found == 0) {
    at0 = 0, at1 = 1, value0 = value1 = 0;
  }
  pair = value0 | value1 << 16;
  fields = at0 | at1 << 2;
}

// kE consecutive 16-bit values starting at a multiple of kE entries (16-byte aligned rows), as words.
template <int kE>
__device__ __forceinline__ void load_entries(const uint16_t* at, uint32_t (&words)[(kE + 1) / 2]) {
  if constexpr (kE == 16) {
    const uint4 a = __ldg(reinterpret_cast<const uint4*>(at)), b = __ldg(reinterpret_cast<const uint4*>(at) + 1);
    words[0] = a.x, words[1] = a.y, words[2] = a.z, words[3] = a.w;
    words[4] = b.x, words[5] = b.y, words[6] = b.z, words[7] = b.w;
  } else if constexpr (kE == 8) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(at));
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else if constexpr (kE == 4) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(at));
    words[0] = v.x, words[1] = v.y;
  } else if constexpr (kE == 2) {
    words[0] = __ldg(reinterpret_cast<const uint32_t*>(at));
  } else {
    words[0] = __ldg(at);
  }
}

// One word of the copy (32 positions from `first`) from its kE entries (`entries`, 16-bit values
// in words) and their offsets (`offsets`, in entry order): its 8 blocks' value pairs and their
// offset fields. kFull: the word lies wholly inside K (every word of a row but maybe its last),
// which takes the tests for positions past K out of the group walk.
template <int kN, int kM, bool kFull>
__device__ __forceinline__ void copy_word(const uint32_t (&entries)[(32 / kM * kN + 1) / 2], uint32_t offsets,
                                          int64_t first, const NMShape& shape, uint32_t (&pairs)[8], uint32_t& word) {
  constexpr int kGroups = 32 / kM, kBits = index_bits(kM);
  word = 0;
  if constexpr (kM <= 4) {  // a block of 4 positions holds two groups (1:2) or one (1:4)
#pragma unroll
    for (int b = 0; b < 8; ++b) {
      constexpr int kPerBlock = 4 / kM;  // entries a block: groups 2b and 2b + 1 (1:2), group b (1:4)
      int found = 0;
      uint32_t at0 = 0, at1 = 0, value0 = 0, value1 = 0;
#pragma unroll
      for (int s = 0; s < kPerBlock; ++s) {
        const int e = kPerBlock * b + s;
        const uint32_t at = kM == 2 ? 2 * s + (offsets >> e & 1u) : offsets >> (e * kBits) & 3u;
        const bool here = first + 4 * b + at < shape.k;
        const uint32_t value = entries[e / 2] >> (16 * (e % 2)) & 0xffffu;
        if (here && found == 0) at0 = at, value0 = value;
        if (here && found == 1) at1 = at, value1 = value;
        found += here;
      }
      uint32_t fields = 0;
      pairs[b] = 0;
      if (first + 4 * b < shape.k) copy_block(found, at0, value0, at1, value1, pairs[b], fields);  // else row padding
      word |= fields << (4 * b);
    }
  } else {
    // Group by group (M >= 8): its kN <= 2 entries (in position order) each fall in the block
    // their offset's high bits name, so each of its kM / 4 blocks holds both, one or none.
    // Session 60 (H200, scripts/two_of_four_copy_time.py): against walking every block's entries,
    // as 1:2 and 1:4 still do, 2:8 1.04-1.14x, 1:8 1.12-1.17x, 2:16 1.12-1.21x (2:8 from 41-71% to
    // 47-79% of the copy bandwidth); 1:4 ran 0.84-0.90x this way, so it keeps the block walk.
    constexpr int kBlocksPerGroup = kM / 4;
    const int64_t past = shape.k - first;  // positions of the word inside K: 0..32
    const uint32_t inside = kFull ? 32u : past <= 0 ? 0u : past >= 32 ? 32u : static_cast<uint32_t>(past);
#pragma unroll
    for (int g = 0; g < kGroups; ++g) {
      uint32_t at[2] = {0, 0}, value[2] = {0, 0};
      bool valid[2] = {false, false};
#pragma unroll
      for (int s = 0; s < kN; ++s) {
        const int e = g * kN + s;
        at[s] = offsets >> (e * kBits) & ((1u << kBits) - 1u);
        value[s] = entries[e / 2] >> (16 * (e % 2)) & 0xffffu;
        valid[s] = g * kM + at[s] < inside;  // entries of a partial last group past K hold nothing
      }
#pragma unroll
      for (int q = 0; q < kBlocksPerGroup; ++q) {  // selects, not branches: the cases diverge in a warp
        const int b = g * kBlocksPerGroup + q;
        const bool in0 = valid[0] && at[0] >> 2 == static_cast<uint32_t>(q);
        const bool in1 = kN == 2 && valid[1] && at[1] >> 2 == static_cast<uint32_t>(q);
        // copy_block's rule as selects: a lone entry at offset a pairs with position 1 (a = 0) or 0
        const uint32_t one_at = (in0 ? at[0] : at[1]) & 3, one_value = in0 ? value[0] : value[1];
        const uint32_t one_pair = one_at == 0 ? one_value : one_value << 16;
        const uint32_t one_fields = one_at == 0 ? 1u << 2 : one_at << 2;
        const bool padding = 4 * b >= static_cast<int>(inside);
        pairs[b] = padding ? 0u : in0 && in1 ? value[0] | value[1] << 16 : in0 || in1 ? one_pair : 0u;
        const uint32_t fields = in0 && in1 ? (at[0] & 3) | (at[1] & 3) << 2 : in0 || in1 ? one_fields : 1u << 2;
        word |= (padding ? 0u : fields) << (4 * b);
      }
    }
  }
}

// Patterns whose groups tile a word of the copy (M in {2, 4, 8, 16, 32}: 32 / M whole groups, kE
// entries): one thread per word, which loads its entries and their offsets in one or two reads
// each and writes 16 values and one offset word. With M = 2 (1:2) a block of 4 positions holds
// two groups, one entry each (session 41: 94% of the copy bandwidth on 4096 x 4096, where a thread
// per block ran too slowly to stage); with M >= 4 a group holds kM / 4 blocks. The rows hold enough
// entries: a row of the copy has 2 * ceil(K / 64) words, whose entries 64 * N / M * ceil(K / 64)
// never pass the stored row length round_up(ceil(K / M) * N, 32).
// Session 65 (H200, scripts/two_of_four_copy_time.py; Nsight Compute had the SM issuing on 80% of
// its cycles, L2 80% busy, 43 registers a thread and so 62% occupancy for 2:8), for M >= 8 three
// changes together (kWarpRuns): 32 registers a thread (kCopyBlocksPerSm), the full-word group walk
// (copy_word<kFull>) and each warp's values leaving through shared memory in two 512-byte runs,
// not 16-byte pieces 32 bytes apart: 2:8 1.21-1.55x (57-80% of the copy bandwidth to 88-98%), 2:16
// 1.42-1.65x, 2:32 1.41-1.74x, 1:8 1.00-1.16x on 4096 x 4096, 4096 x 14336, 14336 x 4096 and 4096
// x 1024. 1:4 and 1:2 ran 0.97-1.05x that way (and 1:4's staged calls 0.97-1.00x), so they keep
// the plain form, in the same PTX as before (a minimum of 0 blocks leaves ptxas its own budget).
template <int kN, int kM>
__global__ void __launch_bounds__(kCopyThreads, kM >= 8 ? kCopyBlocksPerSm : 0)
    two_of_four_copy_words(const uint16_t* values, const uint32_t* indices, NMShape shape, int words_per_row,
                           uint32_t* copy_values, uint32_t* copy_indices) {
  constexpr int kGroups = 32 / kM, kE = kGroups * kN, kBits = index_bits(kM);
  constexpr bool kWarpRuns = kM >= 8;
  static_assert(kM >= 8 || kN == 1, "of M = 2 and 4, 1:2 and 1:4 (2:4 takes no copy)");
  __shared__ uint4 warp_values[kWarpRuns ? 2 * kCopyThreads : 1];  // each warp's 32 words of values, in order
  allow_next_kernel();  // the sparse tensor cores' kernel may set up while the copy runs
  const int w = blockIdx.x * kCopyThreads + threadIdx.x;
  const int lane = threadIdx.x & 31, warp_first = w - lane;
  const bool live = w < words_per_row;  // with kWarpRuns, lanes past the row still take part in the stores
  if (!kWarpRuns && !live) return;
  const int pieces = 2 * (words_per_row - warp_first);  // 16-byte pieces of values the warp writes (of 64)
  uint4* staged = warp_values + 2 * (threadIdx.x - lane);
  const int64_t first = 32 * static_cast<int64_t>(w);  // the word's first position
  for (int64_t col = blockIdx.y; col < shape.nout; col += gridDim.y) {
    uint32_t pairs[8] = {}, word = 0;
    if (live) {
      uint32_t entries[(kE + 1) / 2];
      load_entries<kE>(values + col * shape.row_len + static_cast<int64_t>(w) * kE, entries);
      const uint32_t offsets = read_bits(indices + col * shape.index_words, first / kM * kN * kBits, kE * kBits);
      if (kM >= 8 && shape.k - first >= 32)
        copy_word<kN, kM, true>(entries, offsets, first, shape, pairs, word);
      else
        copy_word<kN, kM, false>(entries, offsets, first, shape, pairs, word);
    }
    if constexpr (kWarpRuns) {
      __syncwarp();  // the warp's stores of the previous row have read its values
      staged[2 * lane] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      staged[2 * lane + 1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
      __syncwarp();
    }
    wait_for_previous_kernel();  // the workspace may still be read by the kernel before (the last call's)
    uint32_t* row = copy_values + col * (8 * static_cast<int64_t>(words_per_row));
    if constexpr (kWarpRuns) {
      uint4* pieces_out = reinterpret_cast<uint4*>(row);
      if (lane < pieces) pieces_out[2 * warp_first + lane] = staged[lane];
      if (lane + 32 < pieces) pieces_out[2 * warp_first + 32 + lane] = staged[lane + 32];
    } else {
      uint4* out = reinterpret_cast<uint4*>(row + 8 * w);
      out[0] = make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
      out[1] = make_uint4(pairs[4], pairs[5], pairs[6], pairs[7]);
    }
    if (live) copy_indices[col * words_per_row + w] = word;
  }
}

// Every other pattern that fits 2:4 (N = 1 with M not a power of two, or N = 2 with M a multiple
// of 4 that is not: 1:3, 1:5, 2:12, ...): one thread per block of 4 positions, which
// reads the entries of the one or two groups that meet it. Each 8 consecutive threads (8 blocks,
// 32 positions) hold one offset word; they OR their fields together and the first writes it.
__global__ void __launch_bounds__(kCopyThreads)
    two_of_four_copy_blocks(const uint16_t* values, const uint32_t* indices, NMShape shape, int blocks_per_row,
                            uint32_t* copy_values, uint32_t* copy_indices) {
  allow_next_kernel();
  const int block = blockIdx.x * kCopyThreads + threadIdx.x;  // rows hold whole words: 8 | blocks_per_row
  const bool live = block < blocks_per_row;
  const int m = shape.m;
  const int64_t first = 4 * static_cast<int64_t>(block);
  for (int64_t col = blockIdx.y; col < shape.nout; col += gridDim.y) {
    uint32_t pair = 0, fields = 0;
    if (live && first < shape.k) {
      const uint16_t* row = values + col * shape.row_len;
      const uint32_t* row_words = indices + col * shape.index_words;
      const int64_t last = first + 3 < shape.k ? first + 3 : shape.k - 1;  // positions past K hold no entry
      int found = 0;
      uint32_t at0 = 0, at1 = 0, value0 = 0, value1 = 0;  // registers, not an array indexed by `found`
      for (int64_t g = first / m; g <= last / m; ++g) {  // at most 2 groups meet a block
        for (int s = 0; s < shape.n; ++s) {
          const int64_t j = g * shape.n + s;
          const int64_t k = g * m + read_offset(row_words, j, shape.bits);
          if (k < first || k > last || found == 2) continue;  // offsets increase: entries come in position order
          const uint32_t at = static_cast<uint32_t>(k - first), value = __ldg(row + j);
          if (found++ == 0)
            at0 = at, value0 = value;
          else
            at1 = at, value1 = value;
        }
      }
      copy_block(found, at0, value0, at1, value1, pair, fields);
    }
    uint32_t word = fields << (4 * (threadIdx.x & 7));
    for (int o = 1; o < 8; o <<= 1) word |= __shfl_xor_sync(0xffffffffu, word, o);
    wait_for_previous_kernel();
    if (live) {
      copy_values[col * blocks_per_row + block] = pair;
      if ((block & 7) == 0) copy_indices[col * (blocks_per_row / 8) + block / 8] = word;
    }
  }
}

// Bytes from the start of a copy's buffer to its offset words: the values, rounded up to kCopyPartAlign.
size_t copy_values_span(const NMShape& copy) {
  const size_t values = static_cast<size_t>(copy.nout * copy.row_len) * 2;
  return (values + kCopyPartAlign - 1) / kCopyPartAlign * kCopyPartAlign;
}

}  // namespace

size_t two_of_four_copy_bytes(const NMShape& shape) {
  const NMShape copy = NMShape::make(shape.k, shape.nout, 2, 4);
  return copy_values_span(copy) + static_cast<size_t>(copy.nout * copy.index_words) * 4;
}

TwoOfFourCopy two_of_four_copy_parts(void* buffer, const NMShape& shape) {
  auto* base = static_cast<uint8_t*>(buffer);
  return {base, reinterpret_cast<uint32_t*>(base + copy_values_span(NMShape::make(shape.k, shape.nout, 2, 4)))};
}

bool two_of_four_copy_by_words(int n, int m) {
  return fits_two_of_four(n, m) && (m == 2 || m % 4 == 0) && 32 % m == 0;
}

int two_of_four_copy_cuda(const void* values, const uint32_t* indices, const NMShape& shape, TwoOfFourCopy copy,
                          void* stream) {
  if (!fits_two_of_four(shape.n, shape.m) || reinterpret_cast<uintptr_t>(values) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(copy.values) % 16 != 0 || reinterpret_cast<uintptr_t>(copy.indices) % 4 != 0)
    return static_cast<int>(cudaErrorInvalidValue);
  const int64_t words = NMShape::make(shape.k, shape.nout, 2, 4).index_words;  // per row of the copy
  if (shape.nout == 0) return static_cast<int>(cudaSuccess);
  if (8 * words > 0x7fffffff) return static_cast<int>(cudaErrorInvalidValue);
  const auto cast = static_cast<cudaStream_t>(stream);
  const auto* v = static_cast<const uint16_t*>(values);
  auto* out = static_cast<uint32_t*>(copy.values);
  // Programmatic dependent launches (launch_split_k): the weight is a constant, so a copy's reads go
  // out while the kernel before it drains, and its writes wait for it (wait_for_previous_kernel).
  cudaError_t e = cudaSuccess;
  const auto by_words = [&](auto kernel) {
    e = launch_split_k(kernel, copy_grid(words, shape.nout), kCopyThreads, 0, cast, 1, true, v, indices, shape,
                       static_cast<int>(words), out, copy.indices);
  };
  switch (shape.n * 64 + shape.m) {  // the eight patterns two_of_four_copy_by_words names
    case 1 * 64 + 2: by_words(two_of_four_copy_words<1, 2>); break;
    case 1 * 64 + 4: by_words(two_of_four_copy_words<1, 4>); break;
    case 1 * 64 + 8: by_words(two_of_four_copy_words<1, 8>); break;
    case 2 * 64 + 8: by_words(two_of_four_copy_words<2, 8>); break;
    case 1 * 64 + 16: by_words(two_of_four_copy_words<1, 16>); break;
    case 2 * 64 + 16: by_words(two_of_four_copy_words<2, 16>); break;
    case 1 * 64 + 32: by_words(two_of_four_copy_words<1, 32>); break;
    case 2 * 64 + 32: by_words(two_of_four_copy_words<2, 32>); break;
    default:
      e = launch_split_k(two_of_four_copy_blocks, copy_grid(8 * words, shape.nout), kCopyThreads, 0, cast, 1, true, v,
                         indices, shape, static_cast<int>(8 * words), out, copy.indices);
  }
  return static_cast<int>(e);
}

}  // namespace nmcli
