// Sparse warpgroup path (Hopper, sm_90a) for 2:4, 1:4, 2:8 and 1:8 weights in fp16/bf16: the
// sparse tensor cores (wgmma.mma_async.sp) do half the multiplies of a dense tile, and the weight
// is never expanded. 2:4 goes to the instruction as stored (wgmma_sp_kernel); the sparser
// patterns are regrouped into 2:4 form in shared memory first (wgmma_regroup_kernel, below).
//
// Y^T = W^T X^T as in wgmma.cu, but A = the weight stays packed: a 2:4 row of the packed format
// (docs/FORMAT.md) is exactly the instruction's A operand, 2 stored values per group of 4 in
// order, and one 32-bit word of its offsets is exactly the metadata of one row for 32 K
// positions (two 2-bit offsets per group, the first in the low bits). So a step copies the
// packed values straight into a 64-byte-swizzled shared-memory tile (one TMA tensor copy) and
// the offset words next to them; each thread then picks the halves of two offset words that the
// instruction wants from it (lanes 4g and 4g + 1 of a warp, rows g and g + 8; wgmma_ops.cuh) --
// no expansion at all. The activation tile, block shape and epilogue are the ones of wgmma.cu
// (wgmma_tile.cuh); the consumers keep one half group of MMAs in flight while they read the next
// half's metadata into other registers (consume). Measured (BENCHMARKS.md): 0.93-1.12x cuBLAS
// dense at 4096 rows on the LLaMA shapes, 1.27-1.51x the kernel before it (session 17); 0.98-1.21x
// with the offset words by tensor copy (session 20); 1.02-1.13x with the halves (session 24). At
// 4096 rows it then moves about as many bytes out of L2 as bulk copies into every SM can
// (kernels/bench/mma_rate_probe.cu), while its MMAs alone could run about twice as fast; but
// those bytes are not the whole limit (below).
// Measured and not kept: clusters of 2 weight tiles sharing one activation tile by TMA multicast
// (session 17: a few % slower than unshared tiles; clusters of 4: 0.5-1.0x of 2) -- multicast
// copies land no more bytes per SM than plain ones (session 24's probe); a tile of 256 weight x
// 128 activation rows (session 25: 17% fewer bytes out of L2 per MMA than 128 x 256, and 0.82-0.91x
// at 512-4096 rows); two steps' values in one tile of 128-byte rows, half the tensor-copy box rows
// (session 25: 0.83-1.01x at 17-4096 rows); blocks of 3 or 4 consumer warpgroups, 192 x 192, 192 x
// 160, 256 x 128 and 192 x 128 tiles with 4-19% fewer bytes out of L2 per FLOP (session 52:
// 0.51-0.97x at 1024-4096 rows, so those bytes do not bind); 2 steps a half group in a ring of 4
// stages for the 160-, 192- and 256-row tiles (session 52: 0.72-0.92x, the copies lose their lead);
// 3 steps of MMAs in flight instead of 2 on those tiles (session 52: 0.77-1.03x).
// Grids of more short tiles than SMs run persistent (wgmma_sp_persistent_kernel, session 61): a
// block per SM walks tile after tile through one ring and stores each tile by tensor copy, so the
// next tile's first copies and MMAs overlap this one's epilogue (1.01-1.18x at K = 4096-5120).
// Padding groups past the stored length carry offsets (0, 0), a value the hardware leaves
// undefined; their values and activations are zero, so any valid pair gives the same result,
// and valid_metadata() (common.cuh) rewrites them to (0, 1).
#include <algorithm>
#include <type_traits>

#include "wgmma_feed.cuh"

namespace nmcli {
namespace {

using sm90::kBK;
using sm90::kProducerThreads;
using sm90::kThreads;
using sm90::kTileW;
using sm90::offset_rows_aligned;
using sm90::offsets_map;
using sm90::produce;
using sm90::tile_map;
using sm90::TileMaps;

constexpr int kStored = kBK / 2;        // stored values per weight row per step
constexpr int kMetaWords = kBK / 32;    // offset words per weight row per step (one per MMA)

// A 2:4 step in shared memory: the activation tile [kRows x 64] (128-byte swizzle) and the stored
// values [128 x 32] (64-byte swizzle); a ring of kStages steps, then the offset words in kSlots
// slots of kBox steps (kMeta bytes a step): steps [kBox j, kBox j + kBox) of the call keep theirs in
// slot j % kSlots, a 32-byte row of words a weight row (its kMetaWords words of the kBox steps: one
// tensor-copy box) under the 32-byte swizzle (offset_bytes_in_box); then one "full" and one "empty"
// barrier per stage.
// A slot is written again kSlots boxes later, once the consumers have released a stage that they
// release only after reading every step of the slot's last box.
template <int kRows>
struct SpLayout {
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;
  static constexpr size_t kA = static_cast<size_t>(kTileW) * kStored * 2;
  static constexpr size_t kMeta = static_cast<size_t>(kTileW) * kMetaWords * 4;
  static constexpr size_t kStage = (kX + kA + 1023) / 1024 * 1024;  // swizzle atoms stay 1024-aligned
  // Steps per group (consume issues a group in two halves, waiting and releasing stages once a
  // half): 4, or 2 for the 160-, 192- and 256-row tiles, whose stages are large enough that 4
  // would leave the ring too few to copy into (session 52: 4 in rings of 4 stages, 0.72-0.92x).
  static constexpr int kGroup = kRows >= 160 ? 2 : 4;
  static constexpr int kStages = static_cast<int>(216 * 1024 / (kStage + kMeta)) / kGroup * kGroup;
  // Steps whose offset words one tensor copy brings: 4 for every tile. Until session 52 the 160-,
  // 192- and 256-row tiles brought a group's (2 steps) at a time; with 4 the 2:4 kernel ran 1.04-1.20x
  // as fast at 17 of 24 points at 300-4096 rows on the LLaMA projections and 8192 x 8192, the rest
  // 1.00-1.03x, and 0.99-1.02x at 150 rows (the 128-row tile with groups of 2 had shown the cost,
  // 0.83-0.93x of its groups of 4). kSlots: enough that the copies, kStages steps ahead, never
  // overwrite a box not yet read.
  static constexpr int kBox = 4;
  static constexpr int kSlots = std::max(2, (kStages + kBox - 1) / kBox);
  static_assert(kGroup == kBox || kStages <= 6,
                "groups of 2 may begin mid-box: copies up to 6 steps ahead stay off boxes being read");
  static constexpr size_t kWords = kStages * kStage;
  static constexpr size_t kBarriers = kWords + kSlots * kBox * kMeta;
  static constexpr size_t kBytes = kBarriers + 2 * kStages * 8 + 1024;  // + slack to align the ring
  static constexpr uint32_t kTensorBytes = static_cast<uint32_t>(kX + kA);  // what the tensor copies bring per stage
  static constexpr uint32_t kBoxWordBytes = static_cast<uint32_t>(kBox * kMeta);  // + a box of offset words
  // Where step t's box of offset words lies, in bytes from the ring's start (box_base: the boxes
  // of a persistent block's earlier tiles), and where row r's words of step t lie in it, in words.
  __host__ __device__ static constexpr uint32_t box_at(int t, int box_base = 0) {
    return static_cast<uint32_t>(kWords + (box_base + t / kBox) % kSlots * kBox * kMeta);
  }
  // Row r's kMetaWords words of step t, in bytes from its box: 32-byte rows, whose 16-byte halves
  // rows 4-7 of every 8 hold swapped (the tensor map's 32-byte swizzle; the cp.async copies follow
  // it). A consumer warp reads rows g and g + 8 for g = 0..7 (consume_tile): unswizzled, rows g and
  // g + 4 lay 128 bytes apart, in the same banks, and each 4-byte read took two wavefronts (Nsight
  // Compute, BENCHMARKS.md session 60: 9.5% of the kernel's shared-memory wavefronts at 4096^3).
  // Swizzled, a step's two words of the 8 rows fill 16 banks: one 8-byte read, one wavefront.
  // Session 64 (H200, ab_kernels against session 63's build, LLaMA projections with 4096 x 1024):
  // 2:4 1.01-1.04x at 64-256 rows, 0.98-1.10x at 640-1024 (geometric mean 1.04x), 1.02-1.09x at
  // 2048-4096; 2:8 on its staged copy 1.02-1.08x at 2048-4096.
  static_assert(kBox * kMetaWords * 4 == 32, "a box row is one 32-byte swizzle span");
  __host__ __device__ static constexpr uint32_t offset_bytes_in_box(int r, int t) {
    return static_cast<uint32_t>(r * 32 + ((t % kBox * kMetaWords * 4) ^ ((r >> 2 & 1) << 4)));
  }
  // Where stage s's activation tile and 2:4 tile lie, in bytes from the ring's start, and how far
  // apart those of consecutive stages of a group lie (consume, issue_steps).
  __host__ __device__ static constexpr uint32_t x_at(int s) { return static_cast<uint32_t>(s * kStage); }
  __host__ __device__ static constexpr uint32_t a_at(int s) { return x_at(s) + static_cast<uint32_t>(kX); }
  static constexpr uint32_t kXStride = static_cast<uint32_t>(kStage), kAStride = kXStride;
  static_assert(kStages >= 2 * kGroup, "a group of steps in the MMAs while the next group's copies fly");
  static_assert(sm90::kFinishBytes<kRows> <= kBarriers, "finish_tile's scratch fits in the ring");
  static_assert(kBytes >= sm90::kWholeSmBytes, "one block per SM, as launch_split's waves count them");
};

// Threads that regroup the tiles of a 1:4, 2:8 or 1:8 kernel (BENCHMARKS.md, sessions 18 and 25).
// With the 256-row tile, whose MMAs need 168 registers, at most three warps (384 threads leave
// them that; 416, allocated as 512, only 128): three for 1:4 and 1:8 (1.00-1.05x as fast as
// two warps at 512 and 4096 rows), two for 2:8 (three ran 0.97-1.01x of two). With 64- and
// 128-row tiles: two warps for 2:8, where a warpgroup ran 0.93-0.96x of the old kernel at 64
// rows against 0.99-1.04x, a warpgroup for 1:4 and 1:8 (0.92-0.99x there, against 0.81-0.92x
// with two warps). The 192-row tile takes the 256-row tile's (ptxas: 126 registers, no spills; a
// warpgroup was not tried), the 160-row tile the 128-row tile's (ptxas: 110 registers, no spills; a
// warpgroup for 2:8 ran 0.95-1.01x of two warps at 150-640 rows, session 53). kSlots (a kernel
// whose ring takes slots of a group, RegroupLayout): 2:8 on the 160-row tile then takes a warpgroup
// (session 57: 0.99-1.08x two warps' 4 stages where the offset words go by tensor copy).
template <int kN, int kRows, bool kSlots>
constexpr int kRegroupThreads = kRows >= 192   ? (kN == 1 ? 96 : 64)
                                : kN == 2      ? (kSlots && kRows == 160 ? 128 : 64)
                                               : 128;

// Issues a consumer warpgroup's MMAs for kSteps steps from stage s on (of ring layout L at `ring`)
// with their metadata, as one commit group; the caller waits for it (wgmma_wait) before it writes
// `meta` again.
template <typename L, int kSteps, int kRows, bool kBf16>
__device__ __forceinline__ void issue_steps(float (&acc)[kRows / 2], uint32_t ring, int s, int wg,
                                            const uint32_t (&meta)[kSteps][kMetaWords]) {
  const uint64_t x_desc = sm90::sw128_desc(ring + L::x_at(s));
  const uint64_t a_desc = sm90::sw64_desc(ring + L::a_at(s) + wg * 64 * kStored * 2);
  sm90::fence_operands(acc);
  sm90::wgmma_fence();
#pragma unroll
  for (int g = 0; g < kSteps; ++g) {
#pragma unroll
    for (int k = 0; k < kMetaWords; ++k)
      sm90::wgmma_sp<kRows, kBf16>(acc, sm90::desc_plus(a_desc, g * L::kAStride + k * 32),
                                   sm90::desc_plus(x_desc, g * L::kXStride + k * 64), meta[g][k]);
  }
  sm90::wgmma_commit();
  sm90::fence_operands(acc);
}

// One arrive per warp on each of kSteps stages' "empty" barriers (8-byte barriers in a row).
template <int kSteps>
__device__ __forceinline__ void release_steps(uint32_t empty, int lane) {
  __syncwarp();
  if (lane == 0) {
#pragma unroll
    for (int g = 0; g < kSteps; ++g) sm90::mbarrier_arrive(empty + g * 8);
  }
}

// A consumer warpgroup's main loop over steps [begin, end) (whole groups of L::kGroup steps, at
// least one) of ring layout L. wgmma reads its metadata register operand asynchronously (writing
// it with its MMA in flight gave wrong results in session 17), and ptxas serializes the MMAs
// (C7513) when a metadata register is written while an MMA that reads it is in flight. So each
// group is issued in two halves with their own registers: a half's MMAs stay in flight while the
// next half's metadata is read (read_step(words, group_stage, g, phase, step) waits for step g of
// the group at group_stage, step `step` of the call, and fills its kMetaWords words) and its MMAs
// are issued; then the warpgroup waits for the older half only and releases its stages. Until
// session 24 each group drained all its MMAs before the next group's metadata was read (the
// halves: 1.01-1.11x at 128-4096 rows on 17 of 18 points, BENCHMARKS.md). ptxas also serializes
// (C7518) when a wait sits under a branch, hence the first group outside the loop.
template <typename L, int kRows, bool kBf16, typename ReadStep>
__device__ __forceinline__ sm90::RingSlot<L::kStages> consume(float (&acc)[kRows / 2], int begin, int end,
                                                              uint32_t ring, uint32_t empty0, int wg, int lane,
                                                              ReadStep&& read_step,
                                                              sm90::RingSlot<L::kStages> group = {}) {
  constexpr int G = L::kGroup, H = G / 2;
  static_assert(G % 2 == 0, "groups of two halves");
  // `group`: the group's first stage (step begin's: the ring's start unless stream_k's earlier
  // steps left it elsewhere). Groups never wrap around the ring (S is a multiple of G).
  uint32_t meta[2][H][kMetaWords];
  // Reads the metadata of a half of the group whose first step is `first`, issues its MMAs.
  auto start = [&](uint32_t (&m)[H][kMetaWords], int half, int first) {
#pragma unroll
    for (int i = 0; i < H; ++i) read_step(m[i], group.slot, half * H + i, group.phase, first + half * H + i);
    issue_steps<L, H, kRows, kBf16>(acc, ring, group.slot + half * H, wg, m);
  };
  auto retire = [&](int stage, auto pending) {  // the half at `stage`, once `pending` halves are left in flight
    sm90::wgmma_wait<decltype(pending)::value>();
    sm90::fence_operands(acc);
    release_steps<H>(empty0 + stage * 8, lane);
  };
  using One = std::integral_constant<int, 1>;
  if (begin >= end) return group;  // never while a cluster has no more blocks than groups (split_steps); no hang
  start(meta[0], 0, begin);
  start(meta[1], 1, begin);
  retire(group.slot, One{});
  int last = group.slot + H;  // the stage of the previous group's second half
  group.template advance<G>();
  for (int t = begin + G; t < end; t += G) {
    start(meta[0], 0, t);
    retire(last, One{});
    start(meta[1], 1, t);
    retire(group.slot, One{});
    last = group.slot + H;
    group.template advance<G>();
  }
  retire(last, std::integral_constant<int, 0>{});
  return group;
}


// A 2:4 block's ring and barriers, and its copies and metadata reads for one tile (weight rows from
// w0, activation rows `rows`, steps [begin, end)), shared by wgmma_sp_kernel (a tile a block) and
// wgmma_sp_persistent_kernel (tile after tile through one ring). `box_base`: the boxes of offset
// words the block's earlier tiles took (SpLayout::box_at), so that the slots go round as in one run.
template <typename T, int kRows>
struct TwoOfFourBlock {
  using L = SpLayout<kRows>;
  static constexpr int S = L::kStages;
  uint8_t* smem;
  uint32_t ring;
  bool tensor_offsets;  // else the producer's lanes copy the offset words

  __device__ __forceinline__ TwoOfFourBlock(uint8_t* smem_raw, const PathParams<T>& p)
      : smem(smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023)),  // swizzle atoms: 1024-aligned
        ring(sm90::smem_addr(smem)),
        tensor_offsets(offset_rows_aligned(p)) {}

  __device__ __forceinline__ uint32_t stage_at(int s) const { return ring + static_cast<uint32_t>(s * L::kStage); }
  __device__ __forceinline__ uint32_t full(int s) const { return ring + static_cast<uint32_t>(L::kBarriers) + s * 8; }
  __device__ __forceinline__ uint32_t empty(int s) const { return full(S) + s * 8; }

  // Thread 0 sets up the barriers, then the block meets.
  __device__ __forceinline__ void init_barriers() const {
    if (threadIdx.x == 0) {
      for (int s = 0; s < S; ++s) {
        // The expected bytes, then each lane's offset words where they go by cp.async.
        sm90::mbarrier_init(full(s), 1 + (tensor_offsets ? 0 : kProducerThreads));
        sm90::mbarrier_init(empty(s), kThreads / 32);  // every consumer warp
      }
      sm90::fence_barrier_init();
    }
    __syncthreads();
  }

  // The producer warp's copies of the tile's steps, from ring slot `slot` on; returns the slot after.
  template <bool kEarly>
  __device__ __forceinline__ sm90::RingSlot<S> produce_tile(const PathParams<T>& p, const TileMaps& maps, int64_t w0,
                                                            sm90::RowTile rows, int begin, int end, int lane,
                                                            int box_base, sm90::RingSlot<S> slot = {}) const {
    constexpr int kMetaRows = kTileW / 32;  // weight rows whose offset words each lane copies
    const uint32_t* meta[kMetaRows];
    bool meta_ok[kMetaRows];
#pragma unroll
    for (int j = 0; j < kMetaRows; ++j) {
      const int64_t w = w0 + lane + 32 * j;
      meta_ok[j] = w < p.nout;
      meta[j] = p.indices + (meta_ok[j] ? w * p.index_words : 0);
    }
    auto activations = [&](int s, int t) {
      sm90::tma_load_2d(stage_at(s), &maps.x, t * kBK, static_cast<int>(rows.from), full(s));
    };
    // Step t's offset words go to its box's slot (SpLayout). Where rows of them may be tensor
    // tiles, one box of kTileW rows brings kBox steps' words; else each lane copies its rows' words
    // per step. Per row and step they cost 208 ns a step in kernels/bench/copy_probe.cu, whole
    // groups' in 16-byte pieces 33-41 ns (BENCHMARKS.md, session 19); one box instead of those
    // pieces made the kernel 1.00-1.16x faster at 17-64 rows and 1.05-1.11x at 4096 (session 20).
    // Steps past a row's stored entries (the rounding up to whole groups) read zeros.
    auto values = [&](int s, int t) {
      // A box of offset words with the block's first step and every kBox-th step of the call (a box
      // starts at a multiple of kBox steps, so on a 16-byte boundary, as a box must); its bytes are
      // expected before the values' copy goes out, so the stage cannot complete without them.
      const bool box = tensor_offsets && (t % L::kBox == 0 || t == begin);
      if (box) sm90::mbarrier_expect_tx(full(s), L::kBoxWordBytes);
      sm90::tma_load_2d(stage_at(s) + static_cast<uint32_t>(L::kX), &maps.values, t * kStored, static_cast<int>(w0),
                        full(s));
      if (box)
        sm90::tma_load_2d(ring + L::box_at(t, box_base), &maps.offsets, t / L::kBox * L::kBox * kMetaWords * 2,
                          static_cast<int>(w0), full(s));
    };
    auto offsets = [&](int s, int t) {
      if (tensor_offsets) return;
      const bool in_row = static_cast<int64_t>(t) * kMetaWords < p.index_words;
#pragma unroll
      for (int j = 0; j < kMetaRows; ++j) {
        const bool ok = meta_ok[j] && in_row;
        sm90::cp_async8(ring + L::box_at(t, box_base) + L::offset_bytes_in_box(lane + 32 * j, t),
                        ok ? meta[j] + t * kMetaWords : p.indices, ok);
      }
      sm90::cp_async_arrive(full(s));
    };
    const uint32_t tensor_bytes = L::kTensorBytes - sm90::activation_shortfall<kRows>(p);
    auto bytes = [&](int) { return tensor_bytes; };
    return produce<S, kEarly>(
        begin, end, lane, bytes, [&](int s) { return full(s); }, [&](int s) { return empty(s); }, activations, values,
        offsets, slot);
  }

  // A consumer warpgroup's MMAs over the tile's steps into acc (consume), from ring slot `group` on;
  // returns the slot after. `row`: the thread's rows g and g + 8 of its warp's 16, in the block's tile.
  __device__ __forceinline__ sm90::RingSlot<S> consume_tile(float (&acc)[kRows / 2], int begin, int end, int wg,
                                                            int lane, int row, int box_base,
                                                            sm90::RingSlot<S> group = {}) const {
    // Lane 4g supplies the offsets of K positions 0..15 of an MMA (the low halves of the two rows'
    // words), lane 4g + 1 those of 16..31 (the high halves); lanes 4g + 2, 4g + 3 are not read.
    const uint32_t halves = (lane & 1) ? 0x7632u : 0x5410u;
    auto read_step = [&](uint32_t (&m)[kMetaWords], int group_stage, int g, uint32_t phase, int t) {
      // Steps are read in order, so the box of step t landed with an earlier (or this) stage.
      sm90::mbarrier_wait(full(group_stage + g), phase);
      static_assert(kMetaWords == 2, "a row's words of a step: one 8-byte read");
      const uint8_t* box = smem + L::box_at(t, box_base);
      const uint2 low = *reinterpret_cast<const uint2*>(box + L::offset_bytes_in_box(row, t));
      const uint2 high = *reinterpret_cast<const uint2*>(box + L::offset_bytes_in_box(row + 8, t));
      m[0] = valid_metadata(__byte_perm(low.x, high.x, halves));
      m[1] = valid_metadata(__byte_perm(low.y, high.y, halves));
    };
    return consume<L, kRows, std::is_same_v<T, __nv_bfloat16>>(acc, begin, end, ring, empty(0), wg, lane, read_step,
                                                                group);
  }
};

// One block computes a [128 weight rows x kRows activation rows] tile. Warps 0-7 (two
// warpgroups, 64 weight rows each) only multiply; warp 8 only copies: per step one thread issues
// two tensor copies (TMA: the activation tile and the stored values, zero-filled past every edge)
// and, per group of steps, one of the 128 rows' offset words (where offset_rows_aligned(p); else
// the warp's 32 lanes copy them with cp.async per step); all of it completes on the stage's
// "full" barrier. The copies run up to kStages steps ahead, bounded only by the
// "empty" barriers the consumer warps arrive on when their MMAs are done with a stage: no block
// barrier in the loop, and the two warpgroups run apart, so one issues MMAs while the other waits
// for its own. (Until session 17 every thread issued 5 cp.async per step with 64-bit address
// arithmetic -- about 85 instructions per step -- and both warpgroups met at a block barrier per
// group of steps: BENCHMARKS.md.)
// The consumer warpgroups' loop is consume(): a group's metadata words are read from shared memory
// a half group at a time, into registers no MMA in flight reads.
// kEarly: launched as a programmatic dependent (grids of one wave, sm90::launch_early_or_not);
// the next kernel may start at once, and this one copies its first weight tiles before it waits
// for the previous one (produce). At 17-64 rows that made back-to-back calls 1.03-1.17x faster
// (BENCHMARKS.md, session 19); the time there goes to each block's copies, not to the bandwidth.
template <typename T, int kRows, bool kEarly>
__global__ void __launch_bounds__(kThreads + kProducerThreads, 1)
    wgmma_sp_kernel(PathParams<T> p, const __grid_constant__ TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t smem_raw[];
  const TwoOfFourBlock<T, kRows> block(smem_raw, p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const bool consumer = warp < kThreads / 32;
  const int row = sm90::consumer_row(warp, lane);
  const sm90::BlockTile tile = sm90::block_tile<kRows>(p);
  int begin, end;  // this block's steps
  sm90::split_steps<SpLayout<kRows>::kGroup>(p.groups * 4, begin, end);
  block.init_barriers();
  if constexpr (kEarly) allow_next_kernel();  // the next kernel's blocks may take idle SMs and copy their weights

  float acc[kRows / 2];
#pragma unroll
  for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
  sm90::fence_operands(acc);

  if (!consumer) {
    if (lane == 0) maps.prefetch(block.tensor_offsets);
    // A weight the kernel before wrote (the call's staged 2:4 copy) is copied only once it is done.
    if constexpr (kEarly)
      if (p.weight_from_stream) wait_for_previous_kernel();
    block.template produce_tile<kEarly>(p, maps, tile.w0, tile.rows, begin, end, lane, 0);
  } else {
    block.consume_tile(acc, begin, end, wg, lane, row, 0);
  }
  if constexpr (kEarly) wait_for_previous_kernel();  // before any write (and the residual's read); long passed
  sm90::finish_tile<T, kRows>(p, acc, block.smem, consumer, tile.w0, tile.rows, row, lane & 3);
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

// The persistent kernel's epilogue scratch: per consumer warpgroup one box of the output tile,
// [kStoreRows activation rows x 64 weight rows] of 16-bit outputs in 128-byte rows (128-byte
// swizzle, as the output's tensor map lays a box out), after the ring and its barriers.
constexpr int kStoreRows = 128;
template <int kRows>
struct PersistentLayout {
  using L = SpLayout<kRows>;
  static constexpr size_t kBoxBytes = kStoreRows * 128;
  static constexpr size_t kScratch = (L::kBarriers + 2 * L::kStages * 8 + 1023) / 1024 * 1024;
  static constexpr size_t kBytes = kScratch + 2 * kBoxBytes + 1024;  // + slack to align the ring
  static_assert(kRows % kStoreRows == 0, "whole boxes a tile");
  static_assert(kBytes <= 227 * 1024, "shared memory per block");
};

// A consumer warpgroup's part of the persistent kernel's tile, its 64 weight rows from w0 + 64 wg
// by the kRows activation rows from r0, to the output: alpha and bias applied in registers, rounded
// to T and written by stmatrix into `box` (PersistentLayout) kStoreRows rows at a time, each box
// then stored by one tensor copy (the map `out` clips rows and columns past the output's). The
// warpgroup's first thread waits until its previous copy has read the box (possibly the previous
// tile's last) before anyone writes it again; the copies themselves drain while the next tile's
// MMAs run. Accumulator i*4 + h*2 + e of lane l holds weight row 16 warp + l / 4 + 8h, activation
// row 8i + 2 (l % 4) + e: matrix (i, h) of an MMA fragment, which stmatrix stores transposed. A last
// row tile that overlaps the one before (sm90::RowTile) writes the shared rows again, which a
// tensor copy cannot skip: the same products summed in the same order as that tile's.
template <typename T, int kRows>
__device__ __forceinline__ void store_tile_by_tma(const PathParams<T>& p, const float (&acc)[kRows / 2],
                                                  const CUtensorMap* out, uint32_t box, int64_t w0, int64_t r0,
                                                  int wg, int warp, int lane) {
  const bool leader = warp == 0 && lane == 0;
  const int64_t w = w0 + wg * 64 + warp * 16 + (lane >> 2);
  const float bias0 = p.bias != nullptr && w < p.nout ? to_f32(p.bias[w]) : 0.f;
  const float bias1 = p.bias != nullptr && w + 8 < p.nout ? to_f32(p.bias[w + 8]) : 0.f;
  // Lane 8m + j gives row j of matrix m of a store: activation row 8 (m / 2) + j of the store's 16,
  // weight rows 8 (m % 2) on of the warp's 16 (16-byte chunk 2 warp + m % 2 of the 128-byte row,
  // swizzled by the row: j).
  const int m = lane >> 3, j = lane & 7;
  const uint32_t at = box + static_cast<uint32_t>((8 * (m >> 1) + j) * 128 + (((2 * warp + (m & 1)) ^ j) << 4));
  const float alpha = p.alpha;
#pragma unroll
  for (int c = 0; c < kRows / kStoreRows; ++c) {
    if (leader) sm90::bulk_wait_read();
    sm90::named_barrier_sync<128>(2 + wg);
#pragma unroll
    for (int i = 0; i < kStoreRows / 8; i += 2) {
      const float* a = acc + (c * kStoreRows / 8 + i) * 4;
      sm90::stmatrix_x4_trans(at + i * 8 * 128, sm90::pack2<T>(alpha * a[0] + bias0, alpha * a[1] + bias0),
                              sm90::pack2<T>(alpha * a[2] + bias1, alpha * a[3] + bias1),
                              sm90::pack2<T>(alpha * a[4] + bias0, alpha * a[5] + bias0),
                              sm90::pack2<T>(alpha * a[6] + bias1, alpha * a[7] + bias1));
    }
    sm90::fence_async_proxy();  // the generic proxy's writes, before the tensor copy reads them
    sm90::named_barrier_sync<128>(2 + wg);
    if (leader) {
      sm90::tma_store_2d(out, box, static_cast<int>(w0 + wg * 64), static_cast<int>(r0 + c * kStoreRows));
      sm90::bulk_commit();
    }
  }
}

// Tile t of a persistent grid over all of a call's tiles where the weight has more tiles than half
// the grid's blocks: in groups of kRasterRowTiles activation tiles, the group's activation
// tile fastest, so that the tiles running at once (one a block, in order) share 4 activation tiles
// and read each weight tile in reach 4 times. In the plain order (weight tile fastest, as
// wgmma_sp_kernel's grids run) they would share one or two activation tiles and read each weight
// tile once: a weight larger than L2 then comes from memory once an activation tile. Session 61
// (H200, in one process against the plain order): on 4096 x 11008 and 4096 x 14336 1.04-1.11x at
// 640-1024 rows (2:4), 0.99-1.06x at 2048-4096 (2:4, and 2:8 and 1:4 on their staged copies); but
// on N = 4096 (32 weight tiles, whose plain order already shares 4 activation tiles) 0.95-0.98x for
// 2:4, hence the bound. A grid over part of the
// tiles (p.first_tile, p.tile_count: the whole waves before a split last one) keeps the plain
// order, which the other launch's tiles follow.
constexpr int kRasterRowTiles = 4;
template <int kRows, typename T>
__device__ __forceinline__ sm90::BlockTile raster_tile_at(const PathParams<T>& p, int64_t t) {
  const int64_t weight_tiles = (p.nout + kTileW - 1) / kTileW, row_tiles = (p.rows + kRows - 1) / kRows;
  if (p.first_tile != 0 || p.tile_count != weight_tiles * row_tiles || weight_tiles * 2 <= gridDim.x)
    return sm90::tile_at<kRows>(p, t);
  const int64_t group = t / (kRasterRowTiles * weight_tiles), in_group = t % (kRasterRowTiles * weight_tiles);
  const int64_t group_rows = min(int64_t{kRasterRowTiles}, row_tiles - group * kRasterRowTiles);
  const int64_t row_tile = group * kRasterRowTiles + in_group % group_rows;
  return sm90::tile_at<kRows>(p, row_tile * weight_tiles + in_group / group_rows);
}

// wgmma_sp_kernel's tiles, tile after tile on one block per SM: tiles blockIdx.x, + gridDim.x, ...
// of the p.tile_count from p.first_tile, unsplit. The producer warp goes on to the next tile's
// copies as soon as the consumers release the stages of the last, so the next tile's first steps
// land while the consumers store this one, and they store it by tensor copy (store_tile_by_tma),
// which drains while the next tile's MMAs run. A block of wgmma_sp_kernel instead waits for its
// first steps after the block before it on its SM has written its whole tile (on the H100 at
// 4096^3, per-block clock stamps: first step 1.8 us, main loop 31 us, epilogue about 4.3 us;
// BENCHMARKS.md, session 42). Taken by grids of more tiles than SMs (persistent_grid).
template <typename T, int kRows>
__global__ void __launch_bounds__(kThreads + kProducerThreads, 1)
    wgmma_sp_persistent_kernel(PathParams<T> p, const __grid_constant__ TileMaps maps,
                               const __grid_constant__ CUtensorMap out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = SpLayout<kRows>;
  extern __shared__ uint8_t smem_raw[];
  const TwoOfFourBlock<T, kRows> block(smem_raw, p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  int begin, end;  // every step of a tile: the grid does not split K
  sm90::split_steps<L::kGroup>(p.groups * 4, begin, end);
  const int boxes = (end + L::kBox - 1) / L::kBox;  // box slots a tile's offset words take
  block.init_barriers();
  // Launched as a programmatic dependent (launch_persistent): the set-up above, and a constant
  // weight's first copies below, overlap the kernel before, whose outputs (the activations, a
  // staged weight) are read only after the wait.
  allow_next_kernel();
  const int64_t first = p.first_tile + blockIdx.x, last = p.first_tile + p.tile_count;
  if (warp >= kThreads / 32) {
    if (lane == 0) maps.prefetch(block.tensor_offsets);
    sm90::RingSlot<L::kStages> slot{};
    int box_base = 0;
    for (int64_t t = first; t < last; t += gridDim.x, box_base += boxes) {
      const sm90::BlockTile tile = raster_tile_at<kRows>(p, t);
      if (t == first && !p.weight_from_stream) {
        // The weights are constants: the first tile's first ring of weight tiles goes out before
        // the wait, which produce<kEarly> makes before the activations' copies (session 64, H200:
        // 0.99-1.07x at the persistent points of the A/B above, geometric mean 1.016x, against
        // 1.004x where the build runs the same code).
        slot = block.template produce_tile<true>(p, maps, tile.w0, tile.rows, begin, end, lane, box_base);
      } else {
        if (t == first) wait_for_previous_kernel();  // a staged weight, too, is the kernel before's output
        slot = block.template produce_tile<false>(p, maps, tile.w0, tile.rows, begin, end, lane, box_base, slot);
      }
    }
    return;
  }
  wait_for_previous_kernel();  // before any write
  const int row = sm90::consumer_row(warp, lane);
  const uint32_t box = block.ring + static_cast<uint32_t>(PersistentLayout<kRows>::kScratch +
                                                          wg * PersistentLayout<kRows>::kBoxBytes);
  sm90::RingSlot<L::kStages> group{};
  int box_base = 0;
  for (int64_t t = first; t < last; t += gridDim.x, box_base += boxes) {
    float acc[kRows / 2];
#pragma unroll
    for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
    sm90::fence_operands(acc);
    group = block.consume_tile(acc, begin, end, wg, lane, row, box_base, group);
    const sm90::BlockTile tile = raster_tile_at<kRows>(p, t);
    store_tile_by_tma<T, kRows>(p, acc, &out, box, tile.w0, tile.rows.from, wg, warp & 3, lane);
  }
  if ((threadIdx.x & 127) == 0) sm90::bulk_wait();  // the last tile's copies out before the block ends
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

// ---------------------------------------------------------------------------------------------
// 1:4, 2:8 and 1:8 on the same instruction: N <= 2 with M a multiple of 4 puts at most 2 entries
// in every 4 consecutive K positions, so each step's packed tile is regrouped in shared memory
// into the 2:4 form above (2 values per 4 positions, a zero where a block holds fewer entries,
// offsets as metadata). The tensor cores then do the work of 2:4 -- half a dense tile -- and the
// regrouping writes half the bytes the expanding kernel (wgmma.cu) writes for a dense tile.
// Measured (BENCHMARKS.md, session 10): 1.35-1.9x the expanding kernel at 128-4096 rows on the
// LLaMA shapes. Session 18 (regrouping warps of their own, below): 0.76-0.89x cuBLAS dense at 4096
// rows for 2:8, against 0.93-1.12x for 2:4 as stored.

// A chunk: one 16-position run (a 16-byte chunk of the 2:4 tile) of two rows of a step.
template <int kN, int kM>
struct Regroup {
  using F = sm90::Family<kN, kM>;
  static constexpr int kChunkGroups = 16 / kM;           // packed groups in a chunk
  static constexpr int kChunkEntries = kChunkGroups * kN;
  static constexpr int kChunkBits = kChunkEntries * F::kBits;
  static constexpr int kBlocks = kM / 4;                 // 4-position blocks of a group
  static constexpr int kCodes = 1 << F::kGroupBits;      // a group's offset bits, as a table index
  // Groups a table entry covers: 2 where a group is one block (1:4: their two selectors fill x, and
  // their entries one value word), else 1. Session 53 (BENCHMARKS.md): with pairs, 1:4's regrouping
  // loop went from 197 to 157 instructions (28 to 20 shared loads) and the kernel ran 1.04-1.06x as
  // fast at 150-640 rows on the LLaMA shapes, 0.98-1.02x at 4096. 1:8's groups are two blocks: a
  // pair would need four selectors an entry.
  static constexpr int kEntryGroups = kBlocks == 1 ? 2 : 1;
  static constexpr int kEntryValues = kEntryGroups * kN;         // stored entries an entry covers
  static constexpr int kLookups = kChunkGroups / kEntryGroups;   // table reads per chunk row
  static constexpr int kEntryCodes = 1 << (F::kGroupBits * kEntryGroups);
  // Lookup g's stored values lie in bytes 2 g kEntryValues.. of the chunk's: word g where an entry
  // covers a whole value word; for 1:8 (half a word) the half of word 0 at byte 2g, which variant
  // g % kVariants of the table points its selectors at, instead of shifting the word.
  static constexpr int kVariants = kEntryValues == 1 ? kLookups : 1;
  // A warp's 8-byte lookups go to shared memory a half-warp at a time, and two lanes of one reading
  // different entries in the same banks wait for each other. A copy's entries in at most 128 bytes
  // never do that (1:4, 1:8); 2:8's 64 are 512 bytes, so the table holds one copy a lane of the
  // half-warp (8 KB), entry e of lane l's at 8 (16 e + l), all of lane l's in banks 2l, 2l + 1.
  // Session 54 (BENCHMARKS.md): 2:8's shared-load bank conflicts went from 2.1 million to 31
  // thousand a call (640 x 11008 x 4096, ncu) and the kernel ran 1.03-1.07x as fast at 150-640
  // rows; 16-byte entries (both selectors unshifted) had doubled them and ran 0.86-0.94x.
  static constexpr int kEntryBytes = sizeof(uint2);
  static constexpr int kLaneCopies = kEntryCodes * kEntryBytes > 128 ? 16 : 1;
  static constexpr int kTableEntries = kVariants * kEntryCodes * kLaneCopies;
  // A code's byte offset in the table is the code shifted up this far (regroup_share reads the
  // chunk's offset bits this many bits early).
  static constexpr int kCodeShift = index_bits(kEntryBytes * kLaneCopies);
  static_assert(kEntryValues == 1 || kEntryValues == 2, "an entry's stored values: half a value word, or all of it");
  static_assert(kEntryGroups * kBlocks == 2 && kLookups == 2, "an entry fills two 2:4 words, a chunk row two entries");
  static_assert(kN <= 2 && (kM == 4 || kM == 8), "at most 2 entries in every 4 positions, blocks inside groups");
  static_assert(kChunkEntries * 2 == 8 || kChunkEntries * 2 == 4, "a chunk's values are read as one word or two");
};

// Table entry `entry` of variant q (Regroup::kVariants) for kEntryGroups consecutive groups whose
// offset bits are `entry` (group l's at bits l * kGroupBits), in each of its kLaneCopies: for the
// entry's 4-position blocks s = 0, 1 (block b of group l, s = l * kBlocks + b), the PRMT selector
// that turns the groups' stored values (entry e of group l in bytes 2(l N + e + q kEntryValues), +1
// of a word; 4 = a zero byte) into block s's two 2:4 values, block 0's in bits 0-15 of x and block
// 1's in bits 0-15 of y (PRMT reads only those: no shift before either); the blocks' metadata
// nibbles (bits 4s..4s+3 of a byte) in byte 2 of x, so that one PRMT makes a chunk row's 16
// metadata bits from its two entries. A block with one entry at position p pairs it with a zero at
// 3 (or at 2 when p = 3), an empty block holds zeros at (0, 1): metadata is always two increasing
// positions. A repeated offset -- the (0, 0) of padding, whose values are zero -- counts once.
template <int kN, int kM>
__device__ __forceinline__ void fill_regroup_table(uint2* table) {
  using R = Regroup<kN, kM>;
  constexpr int kBits = R::F::kBits;
  for (int index = threadIdx.x; index < R::kVariants * R::kEntryCodes; index += kThreads) {
    const int entry = index % R::kEntryCodes, first = index / R::kEntryCodes * R::kEntryValues;
    uint32_t selectors[2], metadata = 0;
    for (int lb = 0; lb < R::kEntryGroups * R::kBlocks; ++lb) {
      const int l = lb / R::kBlocks, b = lb % R::kBlocks;  // group l of the entry's, its block b
      const int code = (entry >> (l * R::F::kGroupBits)) & (R::kCodes - 1);
      // The block's first and second entries: positions p0, p1 inside it, stored entries e0, e1
      // (group l's entries follow the earlier groups' in the value word).
      int count = 0, p0 = 0, p1 = 0, e0 = 0, e1 = 0, previous = -1;
      for (int e = l * kN; e < (l + 1) * kN; ++e) {
        const int off = (code >> ((e - l * kN) * kBits)) & ((1 << kBits) - 1);
        if (off == previous || off / 4 != b) continue;
        previous = off;
        if (count == 0) p0 = off % 4, e0 = e;
        else p1 = off % 4, e1 = e;
        ++count;
      }
      auto bytes = [&](int e) {
        e += first;
        return static_cast<uint32_t>(2 * e) | static_cast<uint32_t>(2 * e + 1) << 4;
      };
      uint32_t sel, nibble;
      if (count == 0) sel = 0x4444u, nibble = 0u | 1u << 2;
      else if (count == 1 && p0 < 3) sel = bytes(e0) | 0x44u << 8, nibble = p0 | 3u << 2;
      else if (count == 1) sel = 0x44u | bytes(e0) << 8, nibble = 2u | 3u << 2;
      else sel = bytes(e0) | bytes(e1) << 8, nibble = p0 | p1 << 2;
      selectors[lb] = sel;
      metadata |= nibble << (4 * lb);
    }
    for (int lane = 0; lane < R::kLaneCopies; ++lane)
      table[index * R::kLaneCopies + lane] = make_uint2(selectors[0] | metadata << 16, selectors[1]);
  }
}

// Where a step's offset words lie: `rows` (row r's kIndexWords or kWindowWords later, below), the
// step's first offset bit at bit `first_bit` of each row's first word. Copied by the producer's
// lanes (cp.async), each step has the kIndexWords of each row from the word with the step's first
// bit; by tensor copy, where rows of offset words may be tensor tiles (offset_rows_aligned), each
// group of kGroup steps has the group's: one box of kWindowWords a row from the 16-byte boundary at
// or before the group's first bit, as a box must start there (RegroupLayout::words_at).
struct OffsetWindow {
  const uint32_t* rows;
  int first_bit;
  // 48-byte rows: a word of 8 consecutive rows falls in 8 different banks (in 8-word rows, in 4:
  // A9 in BENCHMARKS.md, session 49)
  static constexpr int kWindowWords = 12;
  // (Steps and slots count from 0 and groups are a power of two: a group's first is a mask away,
  // where t - t % kGroup would take signed-remainder instructions every step.)
  template <typename F, int kGroup>
  __host__ __device__ static int64_t first_word(int64_t t, bool tensor) {
    static_assert((kGroup & (kGroup - 1)) == 0, "groups of a power of two steps");
    return tensor ? F::first_word(t & ~int64_t{kGroup - 1}) & ~int64_t{3} : F::first_word(t);
  }
  // Step t's, whose words (its group's window or its own) lie at `rows`.
  template <typename F, int kGroup>
  __device__ static OffsetWindow of(int64_t t, const uint8_t* rows, bool tensor) {
    const int64_t bit = t * F::kEntries * F::kBits;
    return {reinterpret_cast<const uint32_t*>(rows), static_cast<int>(bit - first_word<F, kGroup>(t, tensor) * 32)};
  }
};

// Regroups regrouping thread i's share of a step (`words`: where its offset words lie, OffsetWindow,
// kPerRow a row: kIndexWords or kWindowWords): the chunks that consumer threads
// v = i + j * kRegroupThreads of the 256 would own -- K positions 16q..16q+15 (q = v % 4) of the
// block-tile rows `row` and row + 8 of v's place in the MMA layout -- from the packed tile into
// the 2:4 tile (64-byte swizzle) and v's metadata word (row in bits 0-15, row + 8 in 16-31) at
// meta[v]: lanes 4g and 4g + 1 of a consumer warp read the words of chunks 2s and 2s + 1 for MMA
// s (wgmma_ops.cuh). All reads come first, then the table lookups, then the writes: a few
// regrouping warps have little else to hide the reads' latency with (session 54: each share's
// lookups between the previous share's writes ran 2:8 0.87-0.92x at 150-640 rows). The loop from
// the "full" wait to the "ready" arrive is what bounds the kernel at 150-640 rows (sessions 53-54):
// session 54 cut it from 316 to 241 instructions for 2:8, 179 to 141 for 1:4, 181 to 147 for 1:8
// on the 160-row tile (cuobjdump -sass) -- selectors as PRMT takes them (no 0x7777 mask, no shift
// for block 0), the table in static shared memory (addressed from a uniform register), codes whose
// table offset is one LOP3, each row's offset-word addresses one add from row 0's, a group's first
// step by mask. Session 55 cut it to 173-178 for 2:8, 101-108 for 1:4, 109-113 for 1:8: every
// address of a share as share 0's plus a constant (with the offset words' row length a constant,
// one loop for each of their two places), so the reads and writes take immediate offsets instead
// of an add or two each; block 1's selector in y, where PRMT reads it unshifted. Against session 54's
// loop (H100, ab_kernels --path auto on four LLaMA projections): 2:8 1.02-1.06x at 150-640 rows,
// 1:4 and 1:8 1.01-1.04x, 0.99-1.02x at 32 rows.
template <int kN, int kM, int kRegroupThreads, int kPerRow>
__device__ __forceinline__ void regroup_share(const uint8_t* packed, OffsetWindow words, int i, uint8_t* a_tile,
                                              uint32_t* meta, const uint2* table) {
  using R = Regroup<kN, kM>;
  using F = typename R::F;
  constexpr int kPer = (kThreads + kRegroupThreads - 1) / kRegroupThreads;
  static_assert(kRegroupThreads % 32 == 0, "whole warps: a share's lane, and so its K quarter, is share 0's");
  const uint32_t lane_copy = (threadIdx.x & (R::kLaneCopies - 1)) * R::kEntryBytes;  // this lane's copy, in bytes
  // Whether share j is a consumer thread's (the last may run past the 256 when kRegroupThreads
  // does not divide them: it then reads share 0 again and writes nothing).
  auto live = [&](int j) { return kThreads % kRegroupThreads == 0 || i + j * kRegroupThreads < kThreads; };
  // Consumer thread v's chunk rows are 16 (v / 32) + (v % 32) / 4 and 8 below it, its K quarter
  // v % 4: share j's rows lie j kRegroupThreads / 2 below share 0's (a multiple of 8), in the same
  // quarter and under the same swizzle, so each of its addresses is share 0's plus a constant.
  const int row0 = 16 * (i >> 5) + ((i & 31) >> 2), q = i & 3;
  auto below = [&](int j, int h) { return (live(j) ? j * kRegroupThreads / 2 : 0) + 8 * h; };
  // The chunk's offset bits land at bit R::kCodeShift of codes[j][h] (3; 7 for 2:8's lane copies),
  // so that its first table entry's byte offset is one AND away. Taking them that many bits early
  // may start a word before the row's (bit < 0: the previous row's last word, or at row 0 the
  // ring's word before the offset words), whose bits fall below the code; they never reach past
  // the step's copied words, so min keeps the second read in them.
  const int bit = words.first_bit + q * R::kChunkBits - R::kCodeShift, word = bit >> 5, shift = bit & 31;
  const uint32_t* low = words.rows + row0 * kPerRow + word;
  const uint32_t* high = words.rows + row0 * kPerRow + min(word + 1, kPerRow - 1);
  const uint8_t* stored = packed + row0 * F::kValueBytes + q * R::kChunkEntries * 2;
  uint32_t codes[kPer][2], values[kPer][2][2];
#pragma unroll
  for (int j = 0; j < kPer; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = below(j, h);
      codes[j][h] = __funnelshift_r(low[r * kPerRow], high[r * kPerRow], shift);
      if constexpr (R::kChunkEntries * 2 == 8) {
        const uint2 u = *reinterpret_cast<const uint2*>(stored + r * F::kValueBytes);
        values[j][h][0] = u.x, values[j][h][1] = u.y;
      } else {
        values[j][h][0] = *reinterpret_cast<const uint32_t*>(stored + r * F::kValueBytes), values[j][h][1] = 0;
      }
    }
  uint2 entries[kPer][2][R::kLookups];
#pragma unroll
  for (int j = 0; j < kPer; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int g = 0; g < R::kLookups; ++g) {
        constexpr uint32_t kMask = (R::kEntryCodes - 1) << R::kCodeShift;
        const uint32_t at = and_or<kMask>(codes[j][h] >> (g * R::kEntryGroups * F::kGroupBits), lane_copy);  // bytes
        entries[j][h][g] = *reinterpret_cast<const uint2*>(
            reinterpret_cast<const uint8_t*>(table + g % R::kVariants * R::kEntryCodes * R::kLaneCopies) + at);
      }
  uint8_t* chunk = a_tile + row0 * kStored * 2 + ((q ^ ((row0 >> 1) & 3)) << 4);
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    if (!live(j)) continue;
    const uint2(&e)[2][R::kLookups] = entries[j];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t out[4];
#pragma unroll
      for (int g = 0; g < R::kLookups; ++g) {
        const uint32_t stored = values[j][h][g * R::kEntryValues / 2];
        out[2 * g] = prmt(stored, 0u, e[h][g].x), out[2 * g + 1] = prmt(stored, 0u, e[h][g].y);
      }
      *reinterpret_cast<uint4*>(chunk + below(j, h) * kStored * 2) = make_uint4(out[0], out[1], out[2], out[3]);
    }
    // Row r's nibbles in bits 0-15 (byte 2 of its first entry's x, then of its second's: one PRMT),
    // row r + 8's in bits 16-31.
    uint32_t rows_meta[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) rows_meta[h] = prmt(e[h][0].x, e[h][1].x, 0x62u);
    meta[i + j * kRegroupThreads] = prmt(rows_meta[0], rows_meta[1], 0x5410u);
  }
}

// The regrouping kernel's ring in shared memory: kStages steps in slots of kPerSlot steps (1, or a
// group of kGroup), a slot holding its steps' activation tiles (128-byte swizzle), their regrouped
// 2:4 tiles (64-byte swizzle), their packed values as copied and their 2:4 tiles' metadata words,
// then room for offset words (a group's window by tensor copy, OffsetWindow, or each step's by
// cp.async); after the slots, the stages' "full", "ready" and "empty" barriers. (The regrouping
// table is static shared memory, whose address the lookups take from a uniform register: one add
// fewer each.) A slot of one step holds a whole window, which only a group's first step uses, and
// is rounded up to 1 KB: the 160-row tile fits 4 such stages in 216 KB, and 6 in slots of a group
// (the 2:4 kernel with 4 stages on that tile instead of 6 ran 0.89-1.00x as fast, session 57). kPerSm
// blocks share an SM: 1, or 2 with a ring of at most 100 KB each (two_per_sm_split), which keeps the
// offset words apart (kApart).
template <int kN, int kM, int kRows, int kPerSm, bool kSlots>
struct RegroupLayout {
  using F = sm90::Family<kN, kM>;
  // Two blocks an SM keep the offset words in an area of their own after the steps, one a group of
  // the ring (a group's window, or its steps' words by cp.async): a window in every step's slot left
  // 3 stages, too few, so until session 70 these blocks copied every step's words by cp.async. The
  // windows by tensor copy (H200, ab_kernels at 17 and 64 rows on 4096 x 4096, 4096 x 11008,
  // 4096 x 14336 and 14336 x 4096, against that): 2:8 1.11-1.19x, 1:4 1.06-1.14x, 1:8 1.03-1.07x.
  // Probes with parts skipped (products wrong; BENCHMARKS.md, session 70): without the cp.async
  // copies 2:8 had run 1.16-1.25x, without its regrouping 1.25-1.30x. Rows of offset words that are
  // not whole 16-byte units (2:8 and 1:8 at K = 11008) still go by cp.async.
  static constexpr bool kApart = kPerSm == 2;
  static constexpr size_t kX = static_cast<size_t>(kRows) * 128;
  static constexpr size_t kA = static_cast<size_t>(kTileW) * kStored * 2;
  static constexpr size_t kMeta = kThreads * 4;
  static constexpr size_t kStep = kX + kA + F::kValues + kMeta;  // a step's bytes but its offset words
  static constexpr size_t kBudget = (kPerSm == 1 ? 216 : 100) * 1024;
  static constexpr size_t kStepWords = static_cast<size_t>(kTileW) * F::kIndexWords * 4;  // by cp.async
  static constexpr size_t kWindow = static_cast<size_t>(kTileW) * OffsetWindow::kWindowWords * 4;  // by tensor copy
  // A slot of g steps, their offset words' room after them unless kApart (swizzle atoms stay
  // 1024-aligned); the room of a group of g steps' words when kApart.
  static constexpr size_t slot_of(int g) {
    return (g * kStep + (kApart ? 0 : std::max(kWindow, g * kStepWords)) + 1023) / 1024 * 1024;
  }
  static constexpr size_t area_of(int g) { return std::max(kWindow, g * kStepWords); }
  // Steps per group, issued in halves (consume): 4 where 8 stages fit, else 2. A slot holds one
  // step, or with kSlots (launch_regrouped) a group where that fits more stages (the 160-row tile:
  // 6, not 4). Session 57 (BENCHMARKS.md, H100, against a step a slot): 1:4 and 1:8 1.00-1.08x at
  // 150-640 rows on the LLaMA projections (1:4 on 11008 x 4096 at 640 rows 0.93-0.97x); 2:8, whose
  // regrouping binds more, 0.96-1.03x with two regrouping warps, 0.99-1.08x with four where its
  // offset words go by tensor copy; a group a slot where it adds no stages ran 0.98-0.99x at 64
  // rows (its addresses take more instructions).
  static constexpr size_t step_bytes(int g) { return slot_of(1) + (kApart ? area_of(g) / g : 0); }
  static constexpr int kStepGroup = kBudget / step_bytes(2) >= 8 ? 4 : 2;
  static constexpr int kStepStages = static_cast<int>(kBudget / step_bytes(kStepGroup)) / kStepGroup * kStepGroup;
  static constexpr int kSlotGroup = kBudget / slot_of(4) >= 2 ? 4 : 2;
  static constexpr int kSlotStages = static_cast<int>(kBudget / slot_of(kSlotGroup)) * kSlotGroup;
  static constexpr int kPerSlot = !kApart && kSlots && kSlotStages > kStepStages ? kSlotGroup : 1;
  static constexpr int kGroup = kPerSlot > 1 ? kSlotGroup : kStepGroup;
  static constexpr int kStages = kPerSlot > 1 ? kSlotStages : kStepStages;
  static constexpr size_t kSlot = slot_of(kPerSlot);
  static constexpr size_t kArea = kApart ? area_of(kGroup) : 0;  // a group's offset words, kApart
  static constexpr size_t kBarriers = kStages / kPerSlot * kSlot + kStages / kGroup * kArea;
  static constexpr size_t kBytes = kBarriers + 3 * kStages * 8 + 1024;  // + slack to align the ring
  static constexpr size_t kTableBytes = Regroup<kN, kM>::kTableEntries * Regroup<kN, kM>::kEntryBytes;  // static
  static constexpr uint32_t kTensorBytes = static_cast<uint32_t>(kX + F::kValues);  // what the tensor copies bring
  static constexpr uint32_t kWindowBytes = static_cast<uint32_t>(kWindow);  // ... plus, by tensor copy
  // Where stage s's parts lie, in bytes from the ring's start: the i-th step of a slot has the
  // i-th of each kind. kXStride and kAStride: how far apart consecutive stages' tiles lie.
  static constexpr uint32_t kXStride = static_cast<uint32_t>(kPerSlot > 1 ? kX : kSlot);
  static constexpr uint32_t kAStride = static_cast<uint32_t>(kPerSlot > 1 ? kA : kSlot);
  __host__ __device__ static constexpr uint32_t slot_at(int s) { return static_cast<uint32_t>(s / kPerSlot * kSlot); }
  __host__ __device__ static constexpr uint32_t x_at(int s) {
    return slot_at(s) + static_cast<uint32_t>(s % kPerSlot * kX);
  }
  __host__ __device__ static constexpr uint32_t a_at(int s) {
    return slot_at(s) + static_cast<uint32_t>(kPerSlot * kX + s % kPerSlot * kA);
  }
  __host__ __device__ static constexpr uint32_t values_at(int s) {
    return slot_at(s) + static_cast<uint32_t>(kPerSlot * (kX + kA) + s % kPerSlot * F::kValues);
  }
  __host__ __device__ static constexpr uint32_t meta_at(int s) {
    return slot_at(s) + static_cast<uint32_t>(kPerSlot * (kX + kA + F::kValues) + s % kPerSlot * kMeta);
  }
  // Step s's offset words: its group's window (tensor; in the slot of the group's first step, or
  // the group's area) or its own (cp.async).
  __host__ __device__ static constexpr uint32_t words_at(int s, bool tensor) {
    if (kApart)
      return static_cast<uint32_t>(kStages * kSlot + s / kGroup * kArea + (tensor ? 0 : s % kGroup * kStepWords));
    return slot_at(tensor ? s & ~(kGroup - 1) : s) +
           static_cast<uint32_t>(kPerSlot * kStep + (tensor ? 0 : s % kPerSlot * kStepWords));
  }
  static_assert(kArea % 128 == 0, "offset words land 128-byte aligned");
  static_assert(OffsetWindow::kWindowWords >= 3 + (kGroup * F::kEntries * F::kBits + 31) / 32 + 1,
                "a window from the 16-byte boundary holds the group's offset bits");
  static_assert(F::kValues % 128 == 0 && kX % 1024 == 0 && kA % 1024 == 0 && kMeta % 128 == 0,
                "tiles on 1 KB swizzle atoms, tensor copies' values and offset words 128-byte aligned");
  static_assert(kStages >= 2 * kGroup && kStages % kGroup == 0,
                "a group of steps in the MMAs while the next group is copied and regrouped; groups never wrap");
  static_assert(sm90::kFinishBytes<kRows> <= kBarriers, "finish_tile's scratch fits in the ring");
  static_assert(kPerSm == 2 || kBytes >= sm90::kWholeSmBytes, "one block per SM, as launch_split's waves count them");
  static_assert(kBytes + kTableBytes <= 227 * 1024, "a block's shared memory, dynamic and static");
  static_assert(kPerSm == 1 || 2 * (kBytes + kTableBytes + 1024) <= 228 * 1024, "two blocks (and their reserved 1 KB) per SM");
};

// The structure of wgmma_sp_kernel with a third role in between: the last warp copies (TMA for
// the activation tile, the packed values and, where aligned, a group's offset words, else
// cp.async for those; "full" barrier), the kRegroupThreads before it regroup each landed step
// into the 2:4 tile and its metadata words ("ready" barrier), and warps 0-7 multiply exactly as
// in wgmma_sp_kernel and release the stage ("empty" barrier). So neither the copies nor the
// regrouping wait for the MMAs or for a block barrier. Until session 18 every thread copied,
// regrouped and multiplied in turn with a block barrier per group of steps; this kernel is
// 1.06-1.25x that one at 256-4096 rows, 0.92-1.10x at 17-64 (BENCHMARKS.md, session 18).
// Regrouping inside the multiplying warpgroups instead ran 0.78-0.90x (session 17; in registers,
// 0.85-1.03x, session 49). Session 49: with neither the regrouping nor the offset-word copies, 2:8
// and 1:8 ran in 0.73-0.99x 2:4's time. Each role's work on a tile's steps is one callable, so
// that the block runs either its own tile (or a cluster's share of it) or, with kStreamK, a
// stream-K run of steps over two tiles (sm90::stream_k, kRegroupSplits).
template <typename T, int kN, int kM, int kRows, bool kSlots, bool kEarly, int kPerSm, bool kStreamK = false>
__global__ void __launch_bounds__(kThreads + kRegroupThreads<kN, kRows, kSlots> + kProducerThreads, kPerSm)
    wgmma_regroup_kernel(PathParams<T> p, const __grid_constant__ TileMaps maps) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using L = RegroupLayout<kN, kM, kRows, kPerSm, kSlots>;
  using F = typename L::F;
  constexpr int S = L::kStages, G = L::kGroup;
  constexpr int kRegrouping = kRegroupThreads<kN, kRows, kSlots>;
  constexpr bool kBf16 = std::is_same_v<T, __nv_bfloat16>;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* smem = smem_raw + ((1024 - (sm90::smem_addr(smem_raw) & 1023)) & 1023);  // swizzle atoms: 1024-aligned
  const uint32_t ring = sm90::smem_addr(smem);
  __shared__ uint2 table[Regroup<kN, kM>::kTableEntries];
  auto full = [&](int s) { return ring + static_cast<uint32_t>(L::kBarriers) + s * 8; };  // copies landed
  auto ready = [&](int s) { return full(S) + s * 8; };                                     // regrouped
  auto empty = [&](int s) { return ready(S) + s * 8; };                                    // multiplied
  auto meta = [&](int s) { return reinterpret_cast<uint32_t*>(smem + L::meta_at(s)); };
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wg = warp >> 2;
  const bool consumer = warp < kThreads / 32;
  const bool producer = warp == (kThreads + kRegrouping) / 32;
  const int row = sm90::consumer_row(warp, lane);
  const bool tensor_offsets = offset_rows_aligned(p);  // else the producer's lanes copy them

  if (threadIdx.x == 0) {
    for (int s = 0; s < S; ++s) {
      // The expected bytes, then each lane's offset words where they go by cp.async.
      sm90::mbarrier_init(full(s), 1 + (tensor_offsets ? 0 : kProducerThreads));
      sm90::mbarrier_init(ready(s), kRegrouping);  // every regrouping thread
      sm90::mbarrier_init(empty(s), kThreads / 32);                // every consumer warp
    }
    sm90::fence_barrier_init();
  }
  if (threadIdx.x < kThreads) fill_regroup_table<kN, kM>(table);
  __syncthreads();
  if constexpr (kEarly) allow_next_kernel();  // the next kernel's blocks may take idle SMs and copy their weights

  float acc[kRows / 2];  // set and used by the consumers only: the other roles keep no registers for it
  // The producer warp's copies of a tile's steps [begin, end), step begin into stage `from`.
  auto produce_steps = [&](const sm90::BlockTile& tile, int begin, int end, sm90::RingSlot<S> from) {
    const int64_t w0 = tile.w0;
    if (lane == 0) maps.prefetch(tensor_offsets);
    auto activations = [&](int s, int t) {
      sm90::tma_load_2d(ring + L::x_at(s), &maps.x, t * kBK, static_cast<int>(tile.rows.from), full(s));
    };
    // The offset words (OffsetWindow): where rows of them may be tensor tiles, a group's in one
    // tensor copy with its first step (zeros past the row and past Nout, as copy_offset_words
    // writes), which stay in the group's slot until its last step is regrouped (consume hands a
    // group's first half back only after the second half is ready); else each step's by the lanes'
    // cp.async. Session 49 (BENCHMARKS.md): the cp.async copies -- 384 four-byte copies a step for
    // 2:8 -- took as much of the call's time as the regrouping itself; a box a group made 2:8
    // 1.05-1.10x as fast at 256-640 rows, where a box a step had made it 1.00-1.08x. Session 53,
    // not kept: a box of 4 steps on every tile (groups of 2 here on the 128- to 256-row tiles), in
    // slots beside the ring that the regrouping threads hand back by barrier, ran 0.97-1.04x at
    // 150-4096 rows (1:4 0.97-0.99x at 150-640): the copies do not bind there. Its first build
    // chose the words' pointer between a slot and the stage, and the compiler then read them with
    // generic loads (about 20% more instructions in the regrouping loop): 0.90-0.93x at 150-640
    // rows, 1.00x at 1024-4096 -- the regrouping threads' path through a step binds at those rows
    // (more of them did not shorten it, kRegroupThreads; fewer instructions on it did,
    // Regroup::kEntryGroups).
    auto values = [&](int s, int t) {
      sm90::tma_load_2d(ring + L::values_at(s), &maps.values, t * F::kEntries, static_cast<int>(w0), full(s));
      if (tensor_offsets && s % G == 0)
        sm90::tma_load_2d(ring + L::words_at(s, true), &maps.offsets,
                          static_cast<int>(OffsetWindow::first_word<F, G>(t, true) * 2), static_cast<int>(w0), full(s));
    };
    auto offsets = [&](int s, int t) {
      if (!tensor_offsets)
        sm90::copy_offset_words<F::kIndexWords>(p, ring + L::words_at(s, false), F::first_word(t), w0, lane, full(s));
    };
    const uint32_t tensor_bytes = L::kTensorBytes - sm90::activation_shortfall<kRows>(p);
    auto bytes = [&](int s) { return tensor_bytes + (tensor_offsets && s % G == 0 ? L::kWindowBytes : 0u); };
    return produce<S, kEarly>(begin, end, lane, bytes, full, empty, activations, values, offsets, from);
  };
  // Regrouping thread i writes the chunks and metadata words of consumer threads i,
  // i + kRegroupThreads, ... (regroup_share), where those threads read them.
  auto regroup_steps = [&](int begin, int end, sm90::RingSlot<S> stage) {
    const int i = threadIdx.x - kThreads;
    // A loop for each place of the offset words (their rows' length a constant in each).
    auto walk = [&](auto tensor_words) {
      constexpr bool kTensor = decltype(tensor_words)::value;
      constexpr int kPerRow = kTensor ? OffsetWindow::kWindowWords : F::kIndexWords;
      for (int t = begin; t < end; ++t) {
        const int s = stage.slot;
        sm90::mbarrier_wait(full(s), stage.phase);
        regroup_share<kN, kM, kRegrouping, kPerRow>(
            smem + L::values_at(s), OffsetWindow::of<F, G>(t, smem + L::words_at(s, kTensor), kTensor), i,
            smem + L::a_at(s), meta(s), table);
        sm90::fence_async_proxy();  // the MMAs read the 2:4 tile through the async proxy
        sm90::mbarrier_arrive(ready(s));
        stage.advance();
      }
      return stage;
    };
    if (tensor_offsets) return walk(std::true_type{});
    return walk(std::false_type{});
  };
  // The consumers' MMAs of steps [begin, end) into acc (from zero), step begin in stage `from`.
  auto consume_steps = [&](int begin, int end, sm90::RingSlot<S> from) {
#pragma unroll
    for (int i = 0; i < kRows / 2; ++i) acc[i] = 0.f;
    sm90::fence_operands(acc);
    // This thread's metadata word for MMA k of a step: chunk 2k + (lane & 1) of its quad's rows.
    const int meta_reader = warp * 32 + (lane & ~3) + (lane & 1);
    auto read_step = [&](uint32_t (&m)[kMetaWords], int group_stage, int g, uint32_t phase, int) {
      sm90::mbarrier_wait(full(group_stage + g), phase);  // the activation tile
      sm90::mbarrier_wait(ready(group_stage + g), phase);
#pragma unroll
      for (int k = 0; k < kMetaWords; ++k) m[k] = meta(group_stage + g)[meta_reader + 2 * k];
    };
    return consume<L, kRows, kBf16>(acc, begin, end, ring, empty(0), wg, lane, read_step, from);
  };

  if constexpr (kStreamK) {
    sm90::stream_k<T, kRows, G, S>(p, p.groups * kM, acc, smem, consumer, producer, row, lane & 3, produce_steps,
                                   consume_steps, regroup_steps);
  } else {
    int begin, end;  // this block's steps
    sm90::split_steps<G>(p.groups * kM, begin, end);
    const sm90::BlockTile tile = sm90::block_tile<kRows>(p);
    if (producer)
      produce_steps(tile, begin, end, {});
    else if (consumer)
      consume_steps(begin, end, {});
    else
      regroup_steps(begin, end, {});
    if constexpr (kEarly) wait_for_previous_kernel();  // before any write (and the residual's read); long passed
    sm90::finish_tile<T, kRows>(p, acc, smem, consumer, tile.w0, tile.rows, row, lane & 3);
  }
#else
  __trap();  // built for sm_90a only; the dispatch never launches it elsewhere
#endif
}

// The families this path runs (sm90::with_family_of): 2:4 as stored, the others regrouped.
constexpr auto with_sp_family = [](int n, int m, auto&& fn) {
  using sm90::family_code;
  return sm90::with_family_of<family_code(2, 4), family_code(1, 4), family_code(2, 8), family_code(1, 8)>(n, m, fn);
};

// The activation-tile width of the persistent 2:4 kernel, and whether it takes an unsplit grid of
// `tiles` such tiles of `steps` steps: more tiles than SMs (else a block takes one tile anyway),
// tiles of at most kPersistentMostSteps steps, and one output tensor that a tensor map can cover
// (rows a multiple of 16 bytes, 16-byte aligned), with no residual to add (its epilogue stores by
// tensor copy and reads nothing). Session 61 (H200, in one process against wgmma_sp_kernel, 2:4):
// 1.01-1.18x at K = 4096 and 5120 (64 and 80 steps) on the LLaMA and nmSPARSE shapes at 640-4096
// rows; on 8192 x 8192 (128 steps) 1.04x at 4096 rows, 0.99x at 1024; at K = 11008-20480 (172-320
// steps) 0.94-1.07x over three runs, at or under 1.00x on most 4096-row points: the fill and the
// epilogue it hides are a smaller share of long tiles, and its fixed order of tiles loses to the
// hardware's, which hands the next tile to whichever SM is free.
// A staged 2:4 copy (p.weight_from_stream), which the persistent kernel cannot copy before its wait,
// takes it only up to 80 steps: session 64 (H200, ab_kernels against the build that launches every
// staged call a block a tile), 2:8, 1:4 and 1:8 at 1024-4096 rows: persistent 1.00-1.09x at K = 4096
// and 5120 (4096 x 4096, 4096 x 11008, 4096 x 14336, 5120 x 13824) but 0.94-0.98x at K = 8192 (8192 x
// 8192), where 2:4 itself is level.
constexpr int kPersistentRows = 256;
constexpr int64_t kPersistentMostSteps = 128, kPersistentMostStagedSteps = 80;
template <typename T>
bool persistent_grid(const PathParams<T>& p, int64_t tiles, int64_t steps) {
  const int64_t most = p.weight_from_stream ? kPersistentMostStagedSteps : kPersistentMostSteps;
  return tiles > multiprocessor_count() && steps <= most && p.residual == nullptr &&
         p.y.count == 1 && p.nout % 8 == 0 && reinterpret_cast<uintptr_t>(p.y.base[0]) % 16 == 0;
}

// The persistent kernel on min(tiles, SMs) blocks (`tiles`: the launch's, sm90::launched_tiles), as a
// programmatic dependent (one wave; session 63, H200: 1.01-1.11x at 2048-4096 rows on 4096 x 4096 to
// 5120 x 5120, level elsewhere); cudaErrorNotSupported where the driver refuses the output's tensor
// map (the caller then launches a block a tile).
template <typename T, int kRows>
cudaError_t launch_persistent(const PathParams<T>& p, const TileMaps& maps, int64_t tiles, cudaStream_t stream) {
  CUtensorMap out{};
  if (!tile_map(&out, p.y.base[0], p.nout, p.rows, p.nout, 64, kStoreRows, CU_TENSOR_MAP_SWIZZLE_128B))
    return cudaErrorNotSupported;
  constexpr auto kKernel = wgmma_sp_persistent_kernel<T, kRows>;
  constexpr int kSmem = static_cast<int>(PersistentLayout<kRows>::kBytes);
  if (cudaError_t e = allow_dynamic_smem<kKernel>(kSmem); e != cudaSuccess) return e;
  PathParams<T> q = p;
  q.tile_count = tiles;
  const int64_t blocks = std::min<int64_t>(tiles, multiprocessor_count());
  last_tile_plan().persistent = true;
  return launch_split_k(kKernel, dim3(static_cast<unsigned>(blocks)), kThreads + kProducerThreads, kSmem, stream, 1,
                        true, q, maps, out);
}

// `steps`: the call's K steps (sm90::k_steps), as run_wgmma_sp has them.
template <typename T, int kRows>
cudaError_t launch_two_of_four(const PathParams<T>& p, cudaStream_t stream, int splits, int64_t steps) {
  TileMaps maps{};
  if (!tile_map(&maps.x, p.x, p.k, p.rows, p.k, kBK, sm90::activation_box_rows<kRows>(p.rows),
                CU_TENSOR_MAP_SWIZZLE_128B) ||
      !tile_map(&maps.values, p.values, p.row_len, p.nout, p.row_len, kStored, kTileW, CU_TENSOR_MAP_SWIZZLE_64B) ||
      !offsets_map(&maps.offsets, p, SpLayout<kRows>::kBox * kMetaWords, CU_TENSOR_MAP_SWIZZLE_32B))
    return cudaErrorInvalidValue;
  if constexpr (kRows == kPersistentRows) {
    const int64_t tiles = sm90::launched_tiles(p, kRows);
    if (splits == 1 && p.stream_k_blocks == 0 && persistent_grid(p, tiles, steps))
      if (cudaError_t e = launch_persistent<T, kRows>(p, maps, tiles, stream); e != cudaErrorNotSupported) return e;
  }
  return sm90::launch_early_or_not<kRows>(
      p, splits,
      [&](auto early) {
        return sm90::launch_tiles<wgmma_sp_kernel<T, kRows, early()>, kRows, SpLayout<kRows>::kBytes,
                                  kThreads + kProducerThreads>(p, stream, splits, early(), maps);
      },
      true);
}

// The regrouping kernel's launch: its packed values are copied by TMA without a swizzle (the
// regrouping threads read them as laid out in the format), kEntries per row and step.
template <typename T, int kN, int kM, int kRows, int kPerSm, bool kSlots>
cudaError_t launch_regrouped_as(const PathParams<T>& p, cudaStream_t stream, int splits) {
  using F = sm90::Family<kN, kM>;
  using L = RegroupLayout<kN, kM, kRows, kPerSm, kSlots>;
  TileMaps maps{};  // its offset words go by tensor copy where they are aligned
  if (!sm90::packed_maps<F, kRows>(&maps, p) || !offsets_map(&maps.offsets, p, OffsetWindow::kWindowWords))
    return cudaErrorInvalidValue;
  constexpr size_t kSmem = L::kBytes;
  constexpr unsigned kBlock = kThreads + kRegroupThreads<kN, kRows, kSlots> + kProducerThreads;
  if (p.stream_k_blocks > 0) {
    if constexpr (kRows == kStreamKRows && kPerSm == 1) {
      if (cudaError_t e = sm90::clear_stream_k_flags(p, stream); e != cudaSuccess) return e;
      return sm90::launch_tiles<wgmma_regroup_kernel<T, kN, kM, kRows, kSlots, false, 1, true>, kRows, kSmem, kBlock>(
          p, stream, 1, false, maps);
    }
    return cudaErrorInvalidValue;
  }
  return sm90::launch_early_or_not<kRows, kPerSm>(p, splits, [&](auto early) {
    return sm90::launch_tiles<wgmma_regroup_kernel<T, kN, kM, kRows, kSlots, early(), kPerSm>, kRows, kSmem, kBlock>(
        p, stream, splits, early(), maps);
  });
}

// Whether the ring takes slots of a group (RegroupLayout): 1:4 and 1:8 always but on short K
// splits of the 160-row tile, 2:8 there where its offset words go by tensor copy (session 57: with
// cp.async, as on K = 11008, slots and a warpgroup of regrouping threads ran 0.89-0.90x of a step a
// slot, slots alone 0.96-1.00x). On the 160-row tile (the one where slots add stages) only where
// the blocks walk at least kSlotsFromSteps steps (session 58: 4096 x 1024's 6- and 8-way K splits,
// 8-11 steps a block, ran faster a step a slot).
template <int kN>
constexpr bool kSlotsAlways = kN == 1;
constexpr int64_t kSlotsFromSteps = 16;
// `steps`: the call's K steps (sm90::k_steps), as run_wgmma_sp has them.
template <typename T, int kN, int kM, int kRows, int kPerSm = 1>
cudaError_t launch_regrouped(const PathParams<T>& p, cudaStream_t stream, int splits, int64_t steps) {
  if constexpr (kRows == 160 && kPerSm == 1) {
    const bool long_blocks = (steps + splits - 1) / splits >= kSlotsFromSteps;
    const bool slots = long_blocks && (kN == 1 || offset_rows_aligned(p));
    return slots ? launch_regrouped_as<T, kN, kM, kRows, kPerSm, true>(p, stream, splits)
                 : launch_regrouped_as<T, kN, kM, kRows, kPerSm, false>(p, stream, splits);
  }
  return launch_regrouped_as<T, kN, kM, kRows, kPerSm, kSlotsAlways<kN>>(p, stream, splits);
}

// Two blocks of 64-row activation tiles per SM, each with half the ring (BENCHMARKS.md, session
// 39): at 17-64 rows a block of this kernel spends its time waiting on one step after another
// (Nsight Compute on 17 x 4096 x 4096 2:8: the multiplying warps wait for the regrouped tile, the
// regrouping warps for the landed one; twice the regrouping threads ran no faster), and a second
// block on the SM overlaps those waits. Taken where such a grid has at least 5/4 as many blocks as
// the GPU has SMs, with the fewest K splits that reach that, 8 steps a block and every cluster
// resident at once. Against the one-block grid, 2:8, 1:8 and 1:4 at 17-64 rows: 1.00-1.11x on
// 4096 x 4096 (6-way splits, 192 blocks), 1.07-1.19x on 11008 and 14336 x 4096 (6-way), 1.05-1.14x
// on 4096 x 11008, 12288 and 14336 (2-way, 172-224 blocks), 1.18-1.31x on 4096 x 28672 (224
// blocks unsplit, which took two waves of one block per SM). Forced splits with fewer blocks, or
// with blocks of 8 steps, lost: 32 tiles split 4 ways (128 blocks) 0.79-0.99x, 8 ways (256
// blocks) 0.77-0.95x; the 8 tiles of 4096 x 1024 0.40-1.00x at every split, so those keep one
// block per SM. 0 where it does not take the call. NMCLI_TILE_PLAN (sm90::asked_plan) "64,SPLIT,pair"
// asks for SPLIT ways where blocks keep 8 steps and the clusters fit at once; any other plan asked
// for leaves the call to launch_split.
constexpr int kTwoPerSmRows = 64;  // the activation tile of those grids
template <typename T, int kN, int kM>
int two_per_sm_split(const PathParams<T>& p, int64_t steps) {
  constexpr int kRows = kTwoPerSmRows;
  const sm90::TilePlan& asked = sm90::asked_plan();
  if (p.rows > kRows || (asked.rows != 0 && !(asked.two_per_sm && asked.rows == kRows))) return 0;
  constexpr bool kSlots = kSlotsAlways<kN>;  // as launch_regrouped takes it
  constexpr auto kernel = wgmma_regroup_kernel<T, kN, kM, kRows, kSlots, true, 2>;
  constexpr int kSmem = static_cast<int>(RegroupLayout<kN, kM, kRows, 2, kSlots>::kBytes);
  constexpr int kBlock = kThreads + kRegroupThreads<kN, kRows, kSlots> + kProducerThreads;
  if (allow_dynamic_smem<kernel>(kSmem) != cudaSuccess) return 0;
  const int64_t tiles = (p.nout + kTileW - 1) / kTileW, least_blocks = multiprocessor_count() * 5 / 4;
  const auto fits = [&](int split) { return tiles <= active_clusters<kernel>(split, kBlock, kSmem); };
  if (asked.two_per_sm)
    return asked.split <= sm90::kMostBlocks && steps / asked.split >= 8 && fits(asked.split) ? asked.split : 0;
  for (int split = 1; split <= sm90::kMostBlocks && steps / split >= 8; ++split)
    if (tiles * split >= least_blocks) return fits(split) ? split : 0;
  return 0;
}

// The regrouping kernel's splits: the expanding kernel's (kSparseSplits), and stream-K where a
// grid of 256-row tiles leaves SMs idle and a split over clusters does not fit in one wave. Session
// 45 (BENCHMARKS.md), against one tile per block: 96 tiles (640 and 768 rows, N = 4096) on the
// H100 1.13-1.15x on K = 11008 (172 steps a tile) and 1.17-1.19x on K = 14336 (224), for 2:8, 1:8
// and 1:4; on the H200 0.98x on K = 4096 (64 steps), as for 86 tiles of 4096 x 11008 at 256 rows on
// the H100. Its time came to 1.08x an SM's share of the steps (every SM at work) plus 15-16 steps;
// 20 keeps it off the K = 4096 calls. The 2:4 kernel, whose steps copy about as many bytes in 0.6x
// the time, lost (0.73-0.96x at 300-768 rows on the same shapes, H200): with every SM at work its
// steps took up to 1.25x as long (per-block clock stamps), and the handover took the rest.
constexpr sm90::SplitRule kRegroupSplits = [] {
  sm90::SplitRule rule = sm90::kSparseSplits;
  rule.stream_k_steps = 20.0;
  rule.stream_k_step_cost = 1.08;
  return rule;
}();

}  // namespace

bool wgmma_sp_family(int n, int m) {
  return with_sp_family(n, m, [](auto kN, auto) { return kN() != 0; });
}

template <typename T>
cudaError_t run_wgmma_sp(PathParams<T> p, cudaStream_t stream) {
  return sm90::run_family(p, with_sp_family, [&](auto kN, auto kM) {
    const int64_t steps = sm90::k_steps(p.groups, kM());
    if constexpr (kN() != 2 || kM() != 4)
      if (const int split = two_per_sm_split<T, kN(), kM()>(p, steps); split > 0) {
        last_tile_plan() = {kTwoPerSmRows, split, false, false, false, true};
        return launch_regrouped<T, kN(), kM(), kTwoPerSmRows, 2>(p, stream, split, steps);
      }
    const auto launch = [&](auto rows, int splits, const PathParams<T>& tiles) {
      if constexpr (kN() == 2 && kM() == 4)
        return launch_two_of_four<T, rows()>(tiles, stream, splits, steps);
      else
        return launch_regrouped<T, kN(), kM(), rows()>(tiles, stream, splits, steps);
    };
    constexpr sm90::SplitRule splits = kN() == 2 && kM() == 4 ? sm90::kTwoOfFourSplits : kRegroupSplits;
    return sm90::launch_split<256, 192, 160, 128, 64>(p, steps, sm90::kSparseTiles, splits, launch);
  });
}

template cudaError_t run_wgmma_sp<float>(PathParams<float>, cudaStream_t);
template cudaError_t run_wgmma_sp<__half>(PathParams<__half>, cudaStream_t);
template cudaError_t run_wgmma_sp<__nv_bfloat16>(PathParams<__nv_bfloat16>, cudaStream_t);

}  // namespace nmcli
