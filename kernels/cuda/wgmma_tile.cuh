// The pieces the warpgroup kernels share (wgmma.cu: the weight expanded to a dense tile;
// wgmma_sp.cu: 2:4 weights on the sparse tensor cores; wgmma_tf32.cu: fp32): the block shape, the
// activation tile's copy by cp.async (the fp32 kernel's; the others copy it by TMA,
// wgmma_feed.cuh), the epilogue, the calls they can run, the choice of activation-tile width and
// the launch. sm_90a only.
#pragma once
#include <cooperative_groups.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "common.cuh"
#include "kernels.cuh"
#include "nm_matmul_cuda.h"
#include "split_k.cuh"
#include "wgmma_ops.cuh"

namespace nmcli {
namespace sm90 {

constexpr int kBK = 64;                      // K positions per step: one 128-byte swizzle row of B
// Steps of kBK positions over a call's K, groups of m positions each (the last step may be partial).
__host__ __device__ constexpr int64_t k_steps(int64_t groups, int m) { return (groups * m + kBK - 1) / kBK; }
// ... of T in general (32 for fp32: wgmma_tf32.cu).
template <typename T> constexpr int kStepOf = 128 / static_cast<int>(sizeof(T));
constexpr int kWarpgroups = 2;
constexpr int kThreads = 128 * kWarpgroups;
constexpr int kTileW = 64 * kWarpgroups;     // weight rows (output features) per block
static_assert(kTileW == kWgmmaWeightTile, "the dispatch sizes the grid with kWgmmaWeightTile");
// A consumer thread's first weight row in the block's tile (`warp` of the block): row g of its
// warp's 16 in its warpgroup's 64, g = lane / 4, as a 64-row MMA fragment holds them (and g + 8).
__device__ __forceinline__ int consumer_row(int warp, int lane) {
  return (warp >> 2) * 64 + (warp & 3) * 16 + (lane >> 2);
}

// Copies a step's activation tile ([kRows x kStepOf<T>] K-major, 128-byte swizzle) to the start of
// its stage. Every thread copies the same chunks of every step (fixed rows and columns of the tile),
// so the addresses, the swizzled destinations and the row checks are computed once; per step
// only K moves. Rows past the end and K positions past K are zero-filled.
template <typename T, int kRows>
struct ActivationLoader {
  static constexpr int kStep = kStepOf<T>;
  static constexpr int kChunks = kRows * 8 / kThreads;  // 16-byte chunks per thread
  static_assert(kRows * 8 % kThreads == 0, "whole activation chunks per thread");

  const T* x;               // this thread's first chunk at step 0
  int64_t row_stride;       // 32 rows further
  uint32_t dst;             // its swizzled offset in the stage (+ j * 32 rows for chunk j)
  uint32_t rows_ok;         // bit j: chunk j's row exists
  int col;                  // K offset of the chunks inside a step

  __device__ __forceinline__ ActivationLoader(const PathParams<T>& p, int64_t r0) {
    const int tid = threadIdx.x, r = tid >> 3;
    col = (tid & 7) * (kStep / 8);
    x = p.x + (r0 + r) * p.k + col;
    row_stride = 32 * p.k;
    dst = r * 128 + (((tid & 7) ^ (r & 7)) << 4);
    rows_ok = 0;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) rows_ok |= static_cast<uint32_t>(r0 + r + 32 * j < p.rows) << j;
  }

  __device__ __forceinline__ void load(const PathParams<T>& p, uint32_t stage, int64_t t) const {
    const bool k_ok = t * kStep + col < p.k;
#pragma unroll
    for (int j = 0; j < kChunks; ++j) {
      const bool ok = k_ok && (rows_ok >> j & 1u);
      cp_async16(stage + dst + j * 32 * 128, ok ? x + t * kStep + j * row_stride : p.x, ok);
    }
  }
};

// An N:M family as one number, for the family lists of with_family_of.
constexpr int family_code(int n, int m) { return n * 64 + m; }

// Calls fn(N, M) with the family as compile-time constants (std::integral_constant) when
// family_code(n, m) is one of kFamilies, else fn(0, 0): a warpgroup path's one list of the
// families it compiles.
template <int... kFamilies, typename Fn>
auto with_family_of(int n, int m, Fn&& fn) {
  using std::integral_constant;
  decltype(fn(integral_constant<int, 0>{}, integral_constant<int, 0>{})) result{};
  const int code = family_code(n, m);
  const bool found =
      ((code == kFamilies && (result = fn(integral_constant<int, kFamilies / 64>{}, integral_constant<int, kFamilies % 64>{}), true)) ||
       ...);
  return found ? result : fn(integral_constant<int, 0>{}, integral_constant<int, 0>{});
}

// Whether a warpgroup kernel can run the call: 16-byte activation copies (K % 8 == 0, x 16-byte
// aligned) on a device that runs sm_90a code.
template <typename T>
bool runs_here(const PathParams<T>& p) {
  return p.k % 8 == 0 && reinterpret_cast<uintptr_t>(p.x) % 16 == 0 && wgmma_device();
}

// The entry both warpgroup paths share: cudaErrorInvalidValue for fp32 (no 16-bit tensor-core
// operands), for calls runs_here rejects and for families `with_family` (a path's
// with_family_of list) does not compile; else launch(N, M) with the family as compile-time
// constants.
template <typename T, typename WithFamily, typename Launch>
cudaError_t run_family(const PathParams<T>& p, WithFamily&& with_family, Launch&& launch) {
  if constexpr (sizeof(T) != 2) {
    return cudaErrorInvalidValue;
  } else {
    if (!runs_here(p)) return cudaErrorInvalidValue;
    return with_family(p.n, p.m, [&](auto kN, auto kM) -> cudaError_t {
      if constexpr (kN() == 0)
        return cudaErrorInvalidValue;
      else
        return launch(kN, kM);
    });
  }
}

// An activation-tile width a kernel is compiled for, and the cost of one of its steps relative to
// a 64-row step.
struct TileCost {
  int rows;
  double cost;
};

// The sparse kernels' widths: 1.5 for 256 rows, 1.2 for 128, roughly as measured per step in
// session 10; 1.35 for 192 (session 50), which gives 513-768-row calls on N = 4096 four row tiles
// of 128 blocks in one wave where 256-row tiles left 36 of 132 SMs idle, and 257-384-row calls
// cheaper steps than 256's over the same blocks. Against the same model without it (H100,
// ab_kernels --path auto on 4096 x 4096, 11008 x 4096, 4096 x 11008 and 4096 x 14336, 2:4, 2:8
// and 4:16): 1.05-1.15x at 29 of its 48 points at 384-768 rows, the rest 0.99-1.04x; 0.99-1.05x
// at 200 and 1024 rows. On the fused widths, 8192 x 8192, 20480 x 5120, 4096 x 1024 and 4096 x
// 2048 at 300-1040 rows: 1.05-1.20x at 38 of 54 points, the rest 0.99-1.04x. Unsplit at 640-768
// rows on N = 4096, a 192-row step took 0.89-0.95x the time of a 256-row one (BENCHMARKS.md).
// 1.275 for 160 (session 51, between 128's and 192's), which the model takes for 129-160 rows
// (one row tile), 257-320 and 513-640 on N = 4096 and other calls whose 160-row tiles fill the same
// waves as 192-row ones with less waste. Against the same model without it (H100, ab_kernels
// --path auto, 2:4, 2:8 and 4:16 on six shapes at 150, 300, 520 and 640 rows): 1.04-1.33x at 52 of
// 72 points, the rest 0.99-1.02x but one 2:4 point at 0.94x (11008 x 4096 at 520 rows, 96 tiles of
// 192 rows against 128 of 160), which a rerun with the 192-row plan forced put at 1.05x.
constexpr TileCost kSparseTiles[] = {{256, 1.5}, {192, 1.35}, {160, 1.275}, {128, 1.2}, {64, 1.0}};

// Which K splits launch_split weighs: up to `most` blocks of a cluster per tile, each block keeping
// at least 8 steps, each extra block costing `extra_steps` steps (the reduction through distributed
// shared memory, the cluster's barriers; `extra_steps_past_64_rows` instead for calls of more rows
// where given); only for grids whose tiles alone leave SMs idle unless
// `any_grid`. `whole_sm`: the kernels' blocks each fill an SM (whole_sm_clusters counts a wave);
// else a wave is taken as SMs / split clusters. `one_wave` (with `whole_sm`): a split only where
// all its clusters run at once.
constexpr int kMostBlocks = 8;  // the portable cluster size
struct SplitRule {
  int most;  // launch_split takes at most kMostBlocks
  double extra_steps;
  bool any_grid;
  bool whole_sm;
  bool one_wave;
  double extra_steps_past_64_rows = -1;  // negative: extra_steps at every row count
  // With whole_sm: also weigh grids of several waves whose last, partial wave's tiles are launched
  // apart, split over clusters that all run at once (launch_split).
  bool split_last_wave = false;
  // With whole_sm: also weigh stream-K (wgmma_feed.cuh, stream_k) for grids of kStreamKRows-row
  // tiles with more tiles than clusters of 2 run at once but fewer than SMs, where the call has a
  // workspace for it: every SM's share of the steps, each costing stream_k_step_cost steps (all
  // SMs at work draw more bytes at once), plus stream_k_steps for the handover (negative: never).
  double stream_k_steps = -1;
  double stream_k_step_cost = 1;
};

// The fp16/bf16 kernels' splits, up to 8 blocks (the portable cluster size), from sessions 33 and
// 34's sweeps (every width x split forced at 17-256 rows on N = 1024, 2048 and 4096 with K = 1024
// to 14336; 2:4, 2:8, 1:8, 4:8 and 8:16; BENCHMARKS.md; scored offline by scratch/sim34d.py). An
// extra block costs the regrouping and expanding kernels (wgmma_sp.cu's regroup, wgmma.cu) about
// nothing: with half a step the model's choice ran within 3% of the fastest forced one at 86 of 96
// points (mean 0.7% off, worst 13%), where session 33's rule (up to 3 blocks, 4 steps each) was
// within 3% at 60 of 90 (up to 2.0x off on N = 1024). The 2:4 kernel's steps are a third to a
// quarter as long (4096 x 1024 at 17 rows: 0.16 us a step against 0.46 for 2:8 and 0.60 for 4:8,
// from the 1- and 8-way times), so a fixed cost per block (the prologue, the reduction through
// distributed shared memory) is worth 3-4 of its steps. With 3.5: within 3% at 25 of 33 points
// (mean 2.2% off, worst 12%; session 33's rule: 19 of 30, worst 43%); with 3, 256-row tiles split
// 3 ways took 4096 x 4096 at 256 rows, 0.89x the 128-row tiles split 2 ways before. Counting a
// block's steps in the kernel's whole groups (split_steps; 4 steps for 2:4's narrower tiles), as
// this model does not, it was within 3% at 30 of 33 (scratch/sim34c.py).
// Every split that won in the sweeps fits in one wave; without that bound the model also sent the
// 86 tiles of 4096 x 11008 at 17-128 rows to 4-way splits in 3 waves, which ran 0.82-0.85x (2:8)
// and 0.89-0.93x (4:8) of the unsplit grid (session 34, run J): it does not weigh a wave's fill and
// drain. So splits must fit in one wave.
constexpr SplitRule kSparseSplits{kMostBlocks, 0.5, false, true, true, -1, true};
// Past 64 rows an extra 2:4 block costs 20 steps (session 42, H100: every width x split forced on
// 1024 x 1024 to 14336 x 4096 at 17-4096 rows, 69 points, with the epilogue's row loop made lean;
// scratch/fit42*.py, not kept): the partial tiles a split sums grow with the rows, and 128- and
// 64-row tiles unsplit beat wider ones split two ways. Within 3% of the fastest forced choice at
// 56 of 69 points (44 of the 45 past 64 rows, worst 1.04x) where 3.5 throughout was at 46 (worst
// 1.38x: 2048 x 1024 x 1024 took 256-row tiles split two ways, 13.5 us against 9.7 for 128-row
// tiles unsplit). Up to 64 rows 3.5 stays: there the fastest splits were as many as or more than
// 3.5's (17-64 rows on 4096 x 1024: 8 ways, 1.08-1.11x its 4), which 20 would cut to 2.
constexpr SplitRule kTwoOfFourSplits{kMostBlocks, 3.5, false, true, true, 20.0, true};

// A block with more than half of an SM's 228 KB of shared memory runs alone on its SM, and clusters
// of such blocks must fit in one GPC: on the H100 (132 SMs) 66 clusters of 2 run at once, 39 of 3,
// 30 of 4, 22 of 5, 17 of 6 and 15 of 7 or 8 (BENCHMARKS.md, sessions 28 and 34: the occupancy
// query agreed with the first wave of 40 spinning clusters of each size). Asked of the device once
// per split, with an empty kernel of that size; the kernels that rely on it assert that their
// blocks are that large.
constexpr size_t kWholeSmBytes = 116 * 1024;
static __global__ void whole_sm_block() {}
inline int64_t whole_sm_clusters(int split) {
  if (split <= 1) return multiprocessor_count();
  if (allow_dynamic_smem<whole_sm_block>(static_cast<int>(kWholeSmBytes)) != cudaSuccess) {
    (void)cudaGetLastError();  // not a launch's error
    return multiprocessor_count() / split;
  }
  return active_clusters<whole_sm_block>(split, kThreads, static_cast<int>(kWholeSmBytes));
}

// The tiles a launch with `rows`-row activation tiles runs: p.tile_count where set, else every tile
// of the call (weight tiles x activation tiles).
template <typename T>
int64_t launched_tiles(const PathParams<T>& p, int rows) {
  return p.tile_count > 0 ? p.tile_count : (p.nout + kTileW - 1) / kTileW * ((p.rows + rows - 1) / rows);
}

// The activation-tile width and K split of a call: the (width, split) with the least estimated
// time, waves x (steps per block + the split's cost) x the step cost of that width (`tiles`,
// widest first; ties go to the wider tile, which reads each weight tile fewer times, then to the
// smaller split), a wave being as many clusters as run at once. For the sparse kernels, against
// "the widest tile that fills the GPU" (the rule before it): 1.4-2.1x at 512 rows with N = 4096,
// 1.33-1.59x at 256 rows with N >= 11008, 1.2-1.36x at 1024 rows with N = 4096 (BENCHMARKS.md,
// session 10). launch(std::integral_constant<int, kRows>, splits, q) starts the kernel on the tiles
// q names (PathParams::first_tile, tile_count); kWidths lists the widths it compiles, which `tiles`
// must not go beyond.
// With rule.split_last_wave, a grid of up to kMostWavesBeforeSplit whole waves and a partial one
// may instead run its whole waves unsplit and then, in a second launch, its last wave's tiles split
// over clusters that all run at once (estimated as the whole waves plus one split block's steps).
// A partial wave costs far more than its share of blocks: 28 blocks of 2:4 256-row tiles after a
// wave of 132 took 0.6 of that wave's time on 20480 x 5120 at 1024 rows. Session 44 (H100, against
// one launch): 1.15-1.27x on 4096 x 11008 at 512 rows (2:4, 2:8, 1:4, 4:8), 1.24-1.56x on 20480 x
// 5120 at 1000 rows, 1.13-1.45x on 5120 x 20480 at 256, 1.17-1.31x on 8192 x 8192 at 640,
// 1.03-1.09x on 4096 x 14336 at 1000 (3 whole waves); after 5 and 10 whole waves (4096 x 11008 at
// 2048 and 4096 rows) 0.99-1.00x.
constexpr int64_t kMostWavesBeforeSplit = 3;

// A plan asked for through NMCLI_TILE_PLAN, a knob for measuring the plans launch_split weighs
// against its choice (like NMCLI_NO_PDL): "ROWS,SPLIT" (one launch), "ROWS,sk" (stream-K) or
// "ROWS,SPLIT,last" (the whole waves unsplit, then the last one split). launch_split takes it where
// it is one of the plans it weighs for the call, else its own choice; unset, rows is 0. "64,SPLIT,pair"
// asks for the regrouping kernel's grid of two blocks an SM (wgmma_sp.cu, two_per_sm_split), which
// any other plan asked for keeps off the call. Session 50
// forced every plan at 640 and 768 rows before the 192-row tiles (BENCHMARKS.md): the model's
// choice was within 2% of the fastest at all 18 points.
struct TilePlan {
  int rows = 0, split = 1;
  int64_t body = 0;  // tiles launched unsplit before the split ones (split_last_wave), else 0
  bool stream_k = false;
  double time = -1.0;  // launch_split's estimate; negative: no plan yet
  bool two_per_sm = false;  // asked "pair": two blocks an SM (two_per_sm_split), never a launch_split plan
};
inline const TilePlan& asked_plan() {
  static const TilePlan plan = [] {
    TilePlan a;
    const char* text = std::getenv("NMCLI_TILE_PLAN");
    char second[8] = {}, third[8] = {};
    if (text == nullptr || std::sscanf(text, "%d,%7[a-z0-9],%7[a-z]", &a.rows, second, third) < 2) return TilePlan{};
    a.stream_k = std::strcmp(second, "sk") == 0;
    a.split = a.stream_k ? 1 : std::max(1, std::atoi(second));
    a.body = std::strcmp(third, "last") == 0 ? 1 : 0;  // any body: the last wave split
    a.two_per_sm = std::strcmp(third, "pair") == 0;
    return a;
  }();
  return plan;
}
inline bool plan_matches(const TilePlan& asked, const TilePlan& plan) {
  return asked.rows == plan.rows && asked.stream_k == plan.stream_k && asked.two_per_sm == plan.two_per_sm &&
         (plan.stream_k || (asked.split == plan.split && (asked.body > 0) == (plan.body > 0)));
}

template <int... kWidths, typename T, size_t kCount, typename Launch>
cudaError_t launch_split(const PathParams<T>& p, int64_t steps, const TileCost (&tiles)[kCount], SplitRule rule,
                         Launch&& launch) {
  const int64_t sms = multiprocessor_count();
  const int64_t most_blocks = std::min(rule.most, kMostBlocks);
  const double extra_steps =
      p.rows > 64 && rule.extra_steps_past_64_rows >= 0 ? rule.extra_steps_past_64_rows : rule.extra_steps;
  const TilePlan& asked = asked_plan();
  TilePlan best, best_asked;
  const auto weigh = [&](const TilePlan& plan) {
    if (best.time < 0 || plan.time < best.time) best = plan;
    if (asked.rows != 0 && plan_matches(asked, plan) && (best_asked.time < 0 || plan.time < best_asked.time))
      best_asked = plan;
  };
  // Clusters of each split that run at once (whole_sm), asked once per call: every width weighs
  // the same splits.
  int64_t at_once[kMostBlocks + 1] = {};
  const auto clusters = [&](int split) {
    if (at_once[split] == 0) at_once[split] = whole_sm_clusters(split);
    return at_once[split];
  };
  const int most_split = static_cast<int>(std::clamp<int64_t>(steps / 8, 1, most_blocks));
  const auto split_steps = [&](int split) {
    return static_cast<double>((steps + split - 1) / split) + extra_steps * (split - 1);
  };
  for (const TileCost& tile : tiles) {
    const int64_t blocks = launched_tiles(p, tile.rows);
    const bool may_split = rule.any_grid || blocks < sms;
    for (int split = 1; split <= (may_split ? most_split : 1); ++split) {
      if (rule.one_wave && split > 1 && blocks > clusters(split)) continue;
      const double waves = rule.whole_sm ? std::ceil(static_cast<double>(blocks) / clusters(split))
                                         : std::ceil(static_cast<double>(blocks * split) / sms);
      weigh({tile.rows, split, 0, false, waves * split_steps(split) * tile.cost});
    }
    // Stream-K: every SM takes an equal share of the tiles' steps, plus the handover. At least 8
    // steps a block: a block with none would hand over nothing that the block after it waits for.
    if (rule.whole_sm && rule.stream_k_steps >= 0 && p.partials != nullptr && tile.rows == kStreamKRows &&
        blocks < sms && blocks > clusters(2) && blocks * steps >= 8 * sms) {
      const double share = std::ceil(static_cast<double>(blocks * steps) / sms);
      weigh({tile.rows, 1, 0, true, (share * rule.stream_k_step_cost + rule.stream_k_steps) * tile.cost});
    }
    // The whole waves unsplit, then the last wave's tiles split where their clusters run at once.
    const int64_t wave = rule.whole_sm ? clusters(1) : sms;
    const int64_t body = blocks / wave * wave, last = blocks - body;
    if (!rule.split_last_wave || !rule.whole_sm || body == 0 || last == 0 || body > kMostWavesBeforeSplit * wave)
      continue;
    const double body_steps = static_cast<double>(body / wave * steps);
    for (int split = 2; split <= most_split; ++split)
      if (last <= clusters(split)) weigh({tile.rows, split, body, false, (body_steps + split_steps(split)) * tile.cost});
  }
  const TilePlan& plan = best_asked.time >= 0 ? best_asked : best;
  last_tile_plan() = {plan.rows, plan.split, plan.body > 0, plan.stream_k};
  const auto run = [&](const PathParams<T>& q, int split) {
    cudaError_t e = cudaErrorInvalidValue;
    (void)((plan.rows == kWidths && (e = launch(std::integral_constant<int, kWidths>{}, split, q), true)) || ...);
    return e;
  };
  PathParams<T> part = p;
  if (plan.stream_k) {
    part.stream_k_blocks = sms;
    return run(part, 1);
  }
  if (plan.body == 0) return run(p, plan.split);
  part.tile_count = plan.body;
  if (cudaError_t e = run(part, 1); e != cudaSuccess) return e;
  part.first_tile = plan.body;
  part.tile_count = launched_tiles(p, plan.rows) - plan.body;
  return run(part, plan.split);
}

// This block's steps [begin, end) over `positions` K positions (packed groups x M): steps of kStep
// positions, rounded up to whole groups of kGroup steps (the extra steps copy zeros), all of them
// unless a cluster of gridDim.z blocks splits them: in whole groups, as evenly as they go (each block
// floor or ceil of groups / z), so no block is left without steps while there are as many groups as
// blocks (launch_split keeps 8 steps a block). Giving every block but the last ceil(groups / z), as
// before session 34, leaves blocks empty: 15 groups over 7 blocks went 3, 3, 3, 3, 3, 0, 0.
template <int kGroup, int kStep = kBK>
__device__ __forceinline__ void split_steps(int64_t positions, int& begin, int& end) {
  const int64_t steps = ((positions + kStep - 1) / kStep + kGroup - 1) / kGroup * kGroup;
  const int64_t groups = steps / kGroup, splits = gridDim.z;
  begin = static_cast<int>(static_cast<int64_t>(blockIdx.z) * groups / splits * kGroup);
  end = static_cast<int>((static_cast<int64_t>(blockIdx.z) + 1) * groups / splits * kGroup);
}

// A block's activation rows: it reads kRows rows from `from` and writes them from `skip` rows in.
// Its own tile's, except where the call's rows end inside the tile and fill at least one: that
// last tile reads the kRows rows ending with them, overlapping the tile before, and writes only
// its own. A tensor copy of rows past the end (zeros) made the tile slow: session 44 (H100, 2:4,
// the same 3 x 86 blocks of 256-row tiles), 4096 x 11008 at 576 / 640 / 704 / 767 / 768 rows took
// 122 / 112 / 96 / 81 / 81 us. With the overlap, against reading past the end: at 640 rows 1.30-1.41x
// for 2:4 (4096 x 4096, 4096 x 11008, 14336 x 4096), on 4096 x 11008 at 600 rows 1.30x for 1:8 and
// 1.09x for 4:8, on 4096 x 4096 at 300 rows 1.21x (2:4) and 1.54x (2:8), at 4000 rows 1.04-1.07x;
// whole tiles level.
struct RowTile {
  int64_t from;
  int skip;
};
// The block's tile: its first weight row (output column) and its activation rows. Tile t of the
// call is weight tile t % (weight tiles), activation tile t / (weight tiles); block x of a grid
// (launch_tiles) runs tile p.first_tile + x. kOverlapLast false: the last activation tile keeps its
// own rows (kernels whose copies zero-fill rows past the end themselves).
struct BlockTile {
  int64_t w0;
  RowTile rows;
};
template <int kRows, bool kOverlapLast = true, typename T>
__device__ __forceinline__ BlockTile tile_at(const PathParams<T>& p, int64_t t) {
  const int64_t weight_tiles = (p.nout + kTileW - 1) / kTileW;
  const int64_t own = t / weight_tiles * kRows;
  const int64_t from = kOverlapLast && p.rows >= kRows && own + kRows > p.rows ? p.rows - kRows : own;
  return {t % weight_tiles * kTileW, {from, static_cast<int>(own - from)}};
}
template <int kRows, bool kOverlapLast = true, typename T>
__device__ __forceinline__ BlockTile block_tile(const PathParams<T>& p) {
  return tile_at<kRows, kOverlapLast>(p, p.first_tile + blockIdx.x);
}

// The rows of a step's activation copy (its tensor map's box): kRows, or where a call of at most
// 48 rows has the smallest (64-row) tile, those rows rounded up to 8, so that the copy reads little
// past the end either. The tile's other rows keep what the stage held before; they feed only the
// accumulators of rows that are not written. Session 44 (H100, against 64 rows): 1.03-1.15x for
// 2:4 at 17 rows, 1.02-1.05x for 2:8, 1.06x for 4:8, 1.02-1.04x at 40 rows. Wider tiles keep their
// box: 2:8 at 100 rows (256-row tiles, a 104-row box) ran 0.96-0.97x, 2:4 on 128-row tiles 0.97-1.07x.
template <int kRows>
__host__ __device__ constexpr int activation_box_rows(int64_t rows) {
  return kRows == kWgmmaMinRowTile && rows * 4 <= kRows * 3 ? static_cast<int>((rows + 7) / 8 * 8) : kRows;
}
// The bytes a step's activation copy falls short of kRows rows.
template <int kRows, typename T>
__device__ __forceinline__ uint32_t activation_shortfall(const PathParams<T>& p) {
  return static_cast<uint32_t>(kRows - activation_box_rows<kRows>(p.rows)) * 128;
}

// One 8- or 16-byte store (a plain vector assignment went out as two 4-byte stores).
__device__ __forceinline__ void st_global_vec(void* at, uint2 v) {
  asm volatile("st.global.v2.b32 [%0], {%1, %2};" ::"l"(at), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void st_global_vec(void* at, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w) : "memory");
}

// 2 outputs rounded to a 16-bit T, the first in the low half.
template <typename T>
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  uint32_t bits;
  if constexpr (std::is_same_v<T, __half>) {
    const __half2 h = __floats2half2_rn(a, b);
    memcpy(&bits, &h, 4);
  } else {
    const __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
    memcpy(&bits, &h, 4);
  }
  return bits;
}

// 4 outputs rounded to T, as one 8-byte (16-bit T) or 16-byte (fp32) vector.
template <typename T>
__device__ __forceinline__ std::conditional_t<sizeof(T) == 4, uint4, uint2> pack4(const float (&v)[4]) {
  if constexpr (std::is_same_v<T, float>)
    return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]), __float_as_uint(v[3]));
  else
    return make_uint2(pack2<T>(v[0], v[1]), pack2<T>(v[2], v[3]));
}

// finish_tile's reads of 4 fp32 partial sums: from this block's shared memory, or from that of
// block `rank` of the cluster (distributed shared memory; `at` is this block's address of them).
__device__ __forceinline__ float4 ld_shared_f32x4(uint32_t at) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];" : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w) : "r"(at));
  return v;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(uint32_t at, int rank) {
  uint32_t peer;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(peer) : "r"(at), "r"(rank));
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(peer));
  return v;
}

// The partial tiles finish_tile adds at one lane's 4 columns: with kParts == 1 this block's own,
// from its shared memory; else those of the cluster's `count` blocks (at most kParts) in rank
// order through distributed shared memory (a grid launched without clusters has clusters of one
// block). sum() issues a row's loads before its adds: exactly 1 or 2, else in rounds of 4 with the
// loads past `count` predicated off. Session 43 (H100): the loop over the runtime block count it
// replaced went out as one load, a round of 4, then one at a time, with a branch per block between
// local and peer loads. Kept apart: one version for every count (8 loads, each behind a check)
// lost 9-15% on unsplit 2:4 calls of 256-1024 rows, whose every row paid for the checks; 8 generic
// peer pointers mapped once spilled registers in the kernels that run two blocks per SM.
template <int kParts>
struct PartialTiles {
  uint32_t at;  // this lane's columns in this block's tile (shared-memory address)
  int count;

  __device__ __forceinline__ PartialTiles(const float* tile, int col, int blocks)
      : at(smem_addr(tile) + static_cast<uint32_t>(col * 4)), count(blocks) {}

  // Exact where kParts <= 2 (the caller chose kParts == count), else loads past count skipped.
  __device__ __forceinline__ float4 sum(int offset) const {
    const uint32_t row = at + static_cast<uint32_t>(offset * 4);
    if constexpr (kParts == 1) return ld_shared_f32x4(row);
    float4 total = make_float4(0.f, 0.f, 0.f, 0.f);
    constexpr int kBatch = kParts < 4 ? kParts : 4;
#pragma unroll
    for (int z0 = 0; z0 < kParts; z0 += kBatch) {
      float4 v[kBatch];
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (kParts <= 2 || z0 + j < count) v[j] = ld_cluster_f32x4(row, z0 + j);
#pragma unroll
      for (int j = 0; j < kBatch; ++j)
        if (kParts <= 2 || z0 + j < count) {
          if (z0 + j == 0)
            total = v[j];
          else
            total.x += v[j].x, total.y += v[j].y, total.z += v[j].z, total.w += v[j].w;
        }
    }
    return total;
  }
};

// The epilogue of every warpgroup kernel: writes the block's [kRows x kTileW] output tile (alpha,
// bias and residual applied), summing the partial tiles of a cluster that split K.
// * Every block puts its fp32 accumulators into its own shared memory (`scratch`, free once the
//   main loop is done; kFinishBytes), row-major by activation row with a pitch of kTileW + 4 floats,
//   so a warp's 32 stores of one accumulator land in 32 banks.
// * Then every warp of the block (not only the consumers) takes whole activation rows, rank z of
//   a cluster of S the rows z, z + S, ...: each lane reads 4 consecutive columns from every
//   block's tile in rank order (its own, its peers' through distributed shared memory), adds them
//   and writes the 4 outputs as one 8- or 16-byte store, a warp 256 or 512 contiguous bytes.
// It replaced (session 32) a reduction where block 0 read all of its peers' tiles and then stored
// the tile from the MMA fragments, 2 bytes a store spread over 4 output rows: fp16 1.04-1.17x at
// 512 rows, 1.00-1.09x at 17-64 and 1.01-1.06x at 4096 (2:4, 2:8, 4:8 on LLaMA shapes); fp32
// 0.98-1.04x (BENCHMARKS.md). Session 42 made the row loop lean where each lane's 4 outputs go
// as one aligned vector (the common case; the general loop stays for the rest): 1.03-1.16x at
// 4096 rows on the LLaMA projections (2:4, 2:8, 1:4), 1.05-1.09x for 4:8 on the expanding kernel.
// Session 43 kept a row's partial-sum loads in flight together (PartialTiles) and arrives at the
// closing cluster barrier without a release: 1.05-1.17x at 17-64 rows where K splits 4-8 ways,
// 1.02-1.13x at 256-1024 rows on the small nmSPARSE shapes (2:4, 2:8), 1.03-1.08x for 4:8.
// Accumulator i*4 + h*2 + e of a consumer thread holds weight row `row` (+ 8 for h = 1) of the
// block, activation row 8i + 2q + e of its tile (`rows`: the kRows rows from rows.from, written from
// rows.skip on). Threads that hold no accumulators (`holds` false) take part in the barriers and
// the stores.
template <int kRows>
constexpr size_t kFinishBytes = static_cast<size_t>(kRows) * (kTileW + 4) * 4;

template <typename T, int kRows>
__device__ __forceinline__ void finish_tile(const PathParams<T>& p, const float (&acc)[kRows / 2], uint8_t* scratch,
                                            bool holds, int64_t w0, RowTile rows, int row, int q) {
  const int64_t r0 = rows.from;
  constexpr int kPitch = kTileW + 4;
  namespace cg = cooperative_groups;
  float* tile = reinterpret_cast<float*>(scratch);
  cp_async_wait<0>();
  __syncthreads();  // nobody reads the stage ring any more
  if (holds) {
#pragma unroll
    for (int i = 0; i < kRows / 8; ++i)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int e = 0; e < 2; ++e) tile[(8 * i + 2 * q + e) * kPitch + row + 8 * h] = acc[i * 4 + h * 2 + e];
  }
  const bool split = gridDim.z > 1;
  const int splits = static_cast<int>(gridDim.z);
  const int rank = split ? static_cast<int>(cg::this_cluster().block_rank()) : 0;
  // The partial tiles are written. Where K split, the peers read them after the cluster barrier,
  // whose release (MEMBAR.ALL.GPU: ptxas's every form of a cluster-scope release) the first warp
  // alone makes, after the block barrier has ordered every thread's writes before it; the other
  // warps arrive relaxed. Session 43 (H100): 1.00-1.03x every warp releasing, at 17-256 rows on
  // split calls; the release itself costs 0.35-0.61 us a call (a scratch build without it, timing
  // only, BENCHMARKS.md).
  __syncthreads();
  if (split) {
    if (threadIdx.x < 32)
      asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    else
      asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
  }
  const int lane = threadIdx.x & 31, warp = static_cast<int>(threadIdx.x >> 5), warps = static_cast<int>(blockDim.x >> 5);
  const int col = 4 * lane;
  const int64_t w = w0 + col;
  // The lane's 4 columns as one vector where they are in one output part and inside Nout; else
  // one at a time (store_output).
  const OutputColumn<T> first = p.y.column(w), last = p.y.column(w + 3);
  const bool whole = w + 3 < p.nout && last.y == first.y + 3;
  float bias[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) bias[j] = whole && p.bias ? to_f32(p.bias[w + j]) : 0.f;
  const int r_begin = rows.skip + rank + splits * warp, r_step = splits * warps;
  const int r_end = static_cast<int>(p.rows - r0 < kRows ? p.rows - r0 : kRows);
  using Vec = std::conditional_t<sizeof(T) == 4, uint4, uint2>;  // 4 outputs
  auto vec_aligned = [](const T* ptr, int64_t stride) {
    return reinterpret_cast<uintptr_t>(ptr) % sizeof(Vec) == 0 && stride * sizeof(T) % sizeof(Vec) == 0;
  };
  const auto fast_rows = [&](const auto& parts) {
    // Every row's 4 outputs (and residuals) one aligned vector: output offsets stepped, not
    // recomputed, per row. Session 42 (H100, per-block clock stamps): the general loop below, then
    // with 64-bit index arithmetic, generic loads and per-row checks, took 8.1-8.4 us of a 256-row
    // tile's 41 us at 4096 x 4096 x 4096 (2:4), about as long with its stores left out, and 2.5-4.3
    // us of 64- and 128-row tiles whose main loop ran 2-4 us (BENCHMARKS.md).
    const int64_t out_step = static_cast<int64_t>(r_step) * first.stride, res_step = static_cast<int64_t>(r_step) * p.nout;
    int64_t out_at = (r0 + r_begin) * first.stride, res_at = (r0 + r_begin) * p.nout + w;
#pragma unroll 2
    for (int r = r_begin; r < r_end; r += r_step, out_at += out_step, res_at += res_step) {
      const float4 sum = parts.sum(r * kPitch);
      float v[4] = {p.alpha * sum.x + bias[0], p.alpha * sum.y + bias[1], p.alpha * sum.z + bias[2],
                    p.alpha * sum.w + bias[3]};
      if (p.residual) {
        const Vec raw = *reinterpret_cast<const Vec*>(p.residual + res_at);
        T res[4];
        memcpy(res, &raw, sizeof(Vec));
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] += to_f32(res[j]);
      }
      st_global_vec(first.y + out_at, pack4<T>(v));
    }
  };
  if (whole && vec_aligned(first.y, first.stride) && (p.residual == nullptr || vec_aligned(p.residual + w, p.nout))) {
    // The split counts of wider tiles (one or two blocks) exactly, the rest with the unused
    // blocks' loads predicated off.
    if (splits == 1)
      fast_rows(PartialTiles<1>(tile, col, splits));
    else if (splits == 2)
      fast_rows(PartialTiles<2>(tile, col, splits));
    else
      fast_rows(PartialTiles<kMostBlocks>(tile, col, splits));
  } else {
    const PartialTiles<kMostBlocks> parts(tile, col, splits);
    for (int r = r_begin; r < r_end; r += r_step) {
      const int64_t out_row = r0 + r;
      const float4 sum = parts.sum(r * kPitch);
      const float v[4] = {sum.x, sum.y, sum.z, sum.w};
      T* dst = &first[out_row];
      if (whole && reinterpret_cast<uintptr_t>(dst) % sizeof(Vec) == 0) {
        float out[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) out[j] = p.alpha * v[j] + bias[j] + residual_at(p, out_row, w + j);
        st_global_vec(dst, pack4<T>(out));
      } else {
#pragma unroll
        for (int j = 0; j < 4; ++j) store_output<T>(p, out_row, w + j, v[j]);
      }
    }
  }
  // Peers' shared memory must outlive the reads above. Every read's data is in registers by now
  // (the stores consumed it), so this block's arrival needs no release, which went out as a
  // GPU-wide fence (MEMBAR.ALL.GPU) that waited for this block's output stores to land.
  if (split) asm volatile("barrier.cluster.arrive.relaxed;\n\tbarrier.cluster.wait;" ::: "memory");
}

// Zeroes a stream-K launch's flags (one per block) on the stream, before the launch.
template <typename T>
cudaError_t clear_stream_k_flags(const PathParams<T>& p, cudaStream_t stream) {
  return cudaMemsetAsync(p.flags, 0, static_cast<size_t>(p.stream_k_blocks) * sizeof(uint32_t), stream);
}

// Calls launch(std::true_type{}) to start a grid of kRows-row activation tiles, `splits` blocks
// per tile, as a programmatic dependent, launch(std::false_type{}) to start it as before. Early
// where PDL is on and the grid fits on the GPU at once (one block per SM; grids of kPerSm = 2
// blocks per SM are launched only where they fit, wgmma_sp.cu's two_per_sm_split): 1.03-1.17x at
// 17-64 rows (BENCHMARKS.md, session 19). Grids of several waves keep the launch and the code they
// had: a first version that changed their producer's code ran 0.78-0.97x at 4096 rows, and PDL
// alone was not measured there. Where the previous kernel wrote the weight (p.weight_from_stream),
// early only for kernels that then wait before copying it (`waits_for_weight`).
template <int kRows, int kPerSm = 1, typename T, typename Launch>
cudaError_t launch_early_or_not(const PathParams<T>& p, int splits, Launch&& launch, bool waits_for_weight = false) {
  const int64_t blocks = launched_tiles(p, kRows);
  const bool early = use_pdl() && (waits_for_weight || !p.weight_from_stream) &&
                     (kPerSm == 2 || blocks <= whole_sm_clusters(splits));
  return early ? launch(std::true_type{}) : launch(std::false_type{});
}

// Launches a warpgroup kernel with kRows-row activation tiles and kSmem bytes of dynamic shared
// memory: the launched tiles (launched_tiles) along x, weight tile fastest (the kernel finds its
// own with block_tile), and `splits` blocks of a cluster along z splitting K (the kernel then calls
// split_steps and finish_tile). The kernel takes p and then `extra` (kBlockThreads: the kThreads
// consumers plus any producer warps). `pdl`: as a programmatic dependent launch (see
// launch_split_k), for kernels that wait for the previous one themselves.
template <auto kKernel, int kRows, size_t kSmem, unsigned kBlockThreads = kThreads, typename T, typename... Extra>
cudaError_t launch_tiles(const PathParams<T>& p, cudaStream_t stream, int splits, bool pdl, const Extra&... extra) {
  static_assert(kSmem <= 227 * 1024, "shared memory per block");
  if (cudaError_t e = allow_dynamic_smem<kKernel>(static_cast<int>(kSmem)); e != cudaSuccess) return e;
  const dim3 grid(static_cast<unsigned>(p.stream_k_blocks > 0 ? p.stream_k_blocks : launched_tiles(p, kRows)));
  if (splits == 1 && !pdl) {
    kKernel<<<grid, kBlockThreads, kSmem, stream>>>(p, extra...);
    return cudaGetLastError();
  }
  return launch_split_k(kKernel, grid, kBlockThreads, kSmem, stream, splits, pdl, p, extra...);
}

}  // namespace sm90
}  // namespace nmcli
