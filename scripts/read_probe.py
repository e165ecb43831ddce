"""How fast a kernel that only reads can stream B bytes with a grid of G blocks: the size-matched
reference for the decode path, which reads its weights once (BENCHMARKS.md, session 15).

Each block has 1024 threads; each thread issues U independent 16-byte loads (L1 bypassed) per
pass. A CUDA graph chains reads over buffers that together exceed 400 MiB, so no read hits L2;
median of 15 replays. Needs cupy and a GPU.

    python scripts/read_probe.py                       # 10, 35, 66 and 1024 MiB; 64..264 blocks
    python scripts/read_probe.py --mib 35 --blocks 132 --unroll 4
"""
import argparse

import cupy as cp
import numpy as np

SOURCE = r"""
extern "C" __global__ void __launch_bounds__(1024, 1) read_only(const uint4* __restrict__ src, long long nvec,
                                                              unsigned* sink) {
  unsigned acc = 0;
  const long long stride = (long long)gridDim.x * blockDim.x;
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + (UNROLL - 1) * stride < nvec; i += UNROLL * stride) {
    uint4 v[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u)
      asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                   : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w) : "l"(src + i + u * stride));
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < nvec; i += stride) {
    const uint4 w = src[i];
    acc ^= w.x ^ w.y ^ w.z ^ w.w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;  // keeps the loads; practically never taken
}
"""
ROTATION_BYTES = 400 << 20  # well past the H100's 50 MB L2
THREADS, CHAIN, REPLAYS = 1024, 8, 15


def graph_us(launch, sets: int, stream) -> float:
    """Median microseconds per launch of a graph that chains launch(j % sets) CHAIN * sets times
    (one launch per buffer set, the sets together past L2); also used by pattern_probe.py."""
    with stream:
        stream.begin_capture()
        for j in range(CHAIN * sets):
            launch(j % sets)
        graph = stream.end_capture()
        graph.launch(stream)  # warm-up
        stream.synchronize()
        times = []
        for _ in range(REPLAYS):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / (CHAIN * sets))
    return float(np.median(times))


def time_read(kernel, nbytes: int, blocks: int, stream, sink) -> float:
    """Median microseconds of one read of `nbytes` by `blocks` blocks."""
    nvec = nbytes // 16
    sets = max(2, -(-ROTATION_BYTES // nbytes))
    buffers = [cp.random.randint(0, 2**31, size=nvec * 4, dtype=cp.int32) for _ in range(sets)]
    return graph_us(lambda j: kernel((blocks,), (THREADS,), (buffers[j], np.int64(nvec), sink)), sets, stream)


def main() -> None:
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, nargs="+", default=[10, 35, 66, 1024])
    parser.add_argument("--blocks", type=int, nargs="+", default=[64, 112, 128, sms, 2 * sms])
    parser.add_argument("--unroll", type=int, nargs="+", default=[1, 2, 4])
    args = parser.parse_args()
    kernels = {u: cp.RawKernel(SOURCE.replace("UNROLL", str(u)), "read_only") for u in args.unroll}
    stream, sink = cp.cuda.Stream(non_blocking=True), cp.zeros(4, dtype=cp.uint32)
    print(f"{cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}, {sms} SMs")
    for mib in args.mib:
        nbytes = int(mib * 2**20) // 16 * 16
        for blocks in args.blocks:
            for unroll, kernel in kernels.items():
                us = time_read(kernel, nbytes, blocks, stream, sink)
                print(f"{mib:7.0f} MiB  {blocks:4d} blocks  {unroll} loads in flight: {us:8.2f} us  "
                      f"{nbytes / us / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()
