"""Does the decode kernel's access pattern cost bandwidth against a flat read of the same bytes?
A load-only copy of decode.cuh's walk (BENCHMARKS.md, session 16): a warp per packed row (or W
warps per row, each taking every W-th step), U 16-byte vectors of values per lane per step with
one step loaded ahead, the offset words of each vector loaded as decode.cuh does or not at all,
and their shift into place done at the load ("defer 0", decode.cuh before session 16) or when
the step is used ("defer 1"). 2:8 fp16 byte counts; graph chain over > 400 MiB, median of 15
replays. Needs cupy and a GPU.

    python scripts/pattern_probe.py                      # LLaMA shapes, the session-16 variants
    python scripts/pattern_probe.py --all 4096x4096      # every W, U, offsets and shift variant
"""
import argparse
import itertools

import cupy as cp
import numpy as np
from read_probe import ROTATION_BYTES, graph_us  # same chain over buffer sets, same median

SRC = r"""
struct Step { int tile, j; };
extern "C" __global__ void __launch_bounds__(1024, 1) rows_read(const uint4* __restrict__ vals, const unsigned* __restrict__ offs,
    int nout, int row_vecs, int row_words, int vec_bits, int use_offs, unsigned* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  constexpr int RPT = 32 / WPR;
  const int part = warp % WPR;
  const int tiles = (nout + RPT - 1) / RPT;
  const int steps = (row_vecs + 32 * VECS - 1) / (32 * VECS);
  if (part >= steps) return;
  auto advance = [&](Step s) { s.j += WPR; if (s.j >= steps) { s.j = part; s.tile += gridDim.x; } return s; };
  auto load = [&](uint4 (&v)[VECS], unsigned (&o)[VECS], unsigned (&h)[VECS], Step s) {
    const long long row = (long long)s.tile * RPT + warp / WPR;
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
      const int c = s.j * 32 * VECS + lane + 32 * u;
      v[u] = make_uint4(0, 0, 0, 0); o[u] = 0; h[u] = 0;
      if (c < row_vecs && row < nout) {
        asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
            : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(vals + row * row_vecs + c));
        if (use_offs) {
          const long long bit = (long long)c * vec_bits;
          const int shift = (int)(bit & 31);
          const unsigned* wp = offs + row * row_words + (bit >> 5);
#if DEFER
          o[u] = __ldg(wp);
          h[u] = shift + vec_bits > 32 ? __ldg(wp + 1) : 0u;
#else
          unsigned long long w = __ldg(wp);
          if (shift + vec_bits > 32) w |= (unsigned long long)__ldg(wp + 1) << 32;
          o[u] = (unsigned)(w >> shift);
#endif
        }
      }
    }
  };
  unsigned acc = 0;
  auto use = [&](const uint4 (&v)[VECS], const unsigned (&o)[VECS], const unsigned (&h)[VECS], Step s, Step next) {
#pragma unroll
    for (int u = 0; u < VECS; ++u) {
#if DEFER
      const int sh = (int)(((long long)(s.j * 32 * VECS + lane + 32 * u) * vec_bits) & 31);
      acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w ^ __funnelshift_r(o[u], h[u], sh);
#else
      acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w ^ o[u];
#endif
    }
    if (next.tile != s.tile) {
      for (int d = 16; d > 0; d >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, d);
      const long long row = (long long)s.tile * RPT + warp / WPR;
      if (lane == 0 && row < nout) atomicXor(out + row, acc);
      acc = 0;
    }
  };
  uint4 va[VECS], vb[VECS];
  unsigned oa[VECS], ob[VECS], ha[VECS], hb[VECS];
  Step s0{(int)blockIdx.x, part};
  if (s0.tile >= tiles) return;
  load(va, oa, ha, s0);
  for (;;) {
    const Step s1 = advance(s0);
    if (s1.tile < tiles) load(vb, ob, hb, s1);
    use(va, oa, ha, s0, s1);
    if (s1.tile >= tiles) break;
    const Step s2 = advance(s1);
    if (s2.tile < tiles) load(va, oa, ha, s2);
    use(vb, ob, hb, s1, s2);
    if (s2.tile >= tiles) break;
    s0 = s2;
  }
}
"""
# (warps per row, vectors per lane, offsets loaded, shift deferred)
DEFAULT_VARIANTS = [(1, 2, 1, 0), (1, 2, 1, 1), (1, 2, 0, 0), (1, 4, 1, 1), (2, 2, 1, 1)]
ALL_VARIANTS = [(w, u, o, d) for w, u, o, d in itertools.product((1, 2, 4), (2, 4), (1, 0), (0, 1)) if o or not d]
# (Nout, K): LLaMA-7B/8B projections and the fused gate/up width
SHAPES = ["4096x4096", "11008x4096", "4096x11008", "14336x4096", "4096x14336", "28672x4096"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("shapes", nargs="*", default=SHAPES, help="NOUTxK of the packed weight")
    parser.add_argument("--all", action="store_true", help="every variant, not the session-16 list")
    args = parser.parse_args()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    stream = cp.cuda.Stream(non_blocking=True)
    kernels = {}
    for shape in args.shapes:
        nout, k = (int(v) for v in shape.split("x"))
        stored = -(-(k // 4) // 32) * 32  # 2:8: K/4 entries per row, rounded up to 32
        row_vecs, row_words = stored // 8, stored * 3 // 32  # 8 fp16 entries per vector, 3 offset bits each
        nbytes = nout * (row_vecs * 16 + row_words * 4)
        sets = max(2, -(-ROTATION_BYTES // nbytes))
        vals = [cp.random.randint(0, 2**31, size=nout * row_vecs * 4, dtype=cp.int32) for _ in range(sets)]
        offs = [cp.random.randint(0, 2**31, size=nout * row_words, dtype=cp.int32) for _ in range(sets)]
        out = cp.zeros(nout, dtype=cp.uint32)
        for w, u, use_offs, defer in ALL_VARIANTS if args.all else DEFAULT_VARIANTS:
            if (w, u, defer) not in kernels:
                options = ("-std=c++17", f"-DWPR={w}", f"-DVECS={u}", f"-DDEFER={defer}")
                kernels[w, u, defer] = cp.RawKernel(SRC, "rows_read", options=options)
            kernel = kernels[w, u, defer]
            tiles = -(-nout // (32 // w))
            blocks = -(-tiles // -(-tiles // sms))  # every block walks the same number of tiles, as decode.cuh
            args_of = lambda j: (vals[j], offs[j], np.int32(nout), np.int32(row_vecs),  # noqa: E731
                                 np.int32(row_words), np.int32(24), np.int32(use_offs), out)
            us = graph_us(lambda j: kernel((blocks,), (1024,), args_of(j)), sets, stream)
            moved = nout * row_vecs * 16 + (nout * row_words * 4 if use_offs else 0)
            print(f"{nout}x{k} W={w} U={u} offsets={use_offs} defer={defer} blocks={blocks}: {us:7.2f} us "
                  f"{moved / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
