"""Device probe: the column patterns (65536x1024 fp32) in two passes with L2 holding each block between them, every
copy a TMA box, and warp-specialised CTAs.

scripts/column_ticket_probe.py found (H200) that 32-column pieces held in a ring of shared memory until their
block's statistics arrive run at most at the access pattern's 84% of copy, and lose 30 µs more to the wait: 192 KB a
SM covers too little of the block's latency. L2 is 50 MB, shared memory over the GPU 25 MB. Here shared memory holds
nothing across the wait: pass 1 streams each piece in, sums it and frees it; pass 2 copies the piece again, D pieces
later, when its block is long complete, and that copy should hit L2. Blocks may then be 64 columns wide (256-byte
rows, the access pattern that ran at 94-95% of copy on the H100), 16 MB each.

Each CTA (one per SM) owns pieces c, c + grid, c + 2 grid, ... (piece t = block t / G, rows (t % G)·R):
- a producer warp issues pass 1 of piece k into ring 1, then pass 2 of piece k - D into ring 2 once its block's
  arrivals are all in (it reads the block's sums and leaves the mean and rstd beside the slot);
- four statistics warps sum d = x - K (K = x[0, column]) and d·d from ring 1;
- a publisher warp adds them to the block's sums (red.add) and arrives on the block's counter with a release;
- eight output warps write (x - mean)·rstd from ring 2 with streaming stores.
HINT marks pass 1's copies evict_last and pass 2's evict_first in L2.

MODE 0 skips the wait and the sums (the three streams alone), 1 is column_center, 2 column_standardize.

    PYTHONPATH=. python scripts/column_l2_tma_probe.py

Session 38, H200 (torch's copy of the same 512 MB 126.9 µs): no gain. The three streams alone ran at 55-67% of
copy (189-234 µs) and the patterns at 48-57% (center 223.0, standardize 223.6 at best), against 77% and 72% for the
generated kernels. Re-reading blocks from L2 loses here as it did in sessions 9 and 37 (BENCHMARKS.md).
"""
from column_cuda_probe import COLUMN_HELPERS  # scripts/ is on the path when run as a script
from column_ticket_probe import ASYNC_HELPERS, HOST_HELPERS, Bench

CUDA = r"""
#include <torch/extension.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdint>

constexpr int M = 65536, N = 1024;
constexpr int STATS_WARPS = 4, OUT_WARPS = 8, THREADS = 32 * (2 + STATS_WARPS + OUT_WARPS);
constexpr float EPS = 1e-5f;

""" + COLUMN_HELPERS + ASYNC_HELPERS + r"""
__device__ __forceinline__ void tensor_copy_hint(void* dst, const CUtensorMap* map, int col, int row, uint64_t* bar,
                                                 uint64_t policy) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
               " [%0], [%1, {%2, %3}], [%4], %5;"
               :: "r"(su32(dst)), "l"(map), "r"(col), "r"(row), "r"(su32(bar)), "l"(policy) : "memory");
}

// ctr: [8, 8 + NB) arrivals per block (only grow: launch `epoch` waits for (epoch + 1)·G). acc: [parity][NB][2][W]
// the blocks' sums of d and d·d (launch e adds into parity e & 1 and zeroes the other for launch e + 1).
template <int W, int R, int N1, int N2, int D, int MODE, bool HINT>
__global__ void __launch_bounds__(THREADS, 1) staged(const __grid_constant__ CUtensorMap xmap,
    const float* __restrict__ x, float* __restrict__ y, float* accs, unsigned long long* ctr,
    unsigned long long epoch) {
  constexpr int NB = N / W, G = M / R, TOTAL = NB * G, PIECE = R * W, QW = W / 4, BOX = R < 256 ? R : 256;
  constexpr bool STD = MODE == 2, WAIT = MODE != 0;
  extern __shared__ __align__(128) float smem[];
  float* ring1 = smem;                       // N1 pieces, pass 1
  float* ring2 = smem + (size_t)N1 * PIECE;  // N2 pieces, pass 2
  __shared__ uint64_t full1[N1], empty1[N1], summed[N1], full2[N2], empty2[N2];
  __shared__ __align__(16) float sums[N1][2][W];
  __shared__ __align__(16) float stat2[N2][2][W];  // pass 2's mean and rstd
  __shared__ __align__(16) float sred[2][STATS_WARPS][W], sred2[2][STATS_WARPS][W];
  unsigned long long* arrivals = ctr + 8;
  float* acc = accs + (epoch & 1) * NB * 2 * W;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, grid = gridDim.x, c0 = blockIdx.x;
  const int KC = (TOTAL - c0 + grid - 1) / grid;  // this CTA's pieces
  if (tid == 0) {
    for (int s = 0; s < N1; ++s) { mbar_init(&full1[s], 1); mbar_init(&empty1[s], STATS_WARPS + 1); mbar_init(&summed[s], 1); }
    for (int s = 0; s < N2; ++s) { mbar_init(&full2[s], 1); mbar_init(&empty2[s], OUT_WARPS); }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // producer
    if (c0 == 0)
      for (int k = lane; k < NB * 2 * W; k += 32) accs[((epoch + 1) & 1) * NB * 2 * W + k] = 0.f;
    uint64_t keep = 0, drop = 0;
    if (HINT) {
      asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(keep));
      asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(drop));
    }
    for (int k = 0; k < KC + D; ++k) {
      if (k < KC) {  // pass 1 of piece k
        const int s = k % N1, t = c0 + k * grid, b = t / G, chunk = t % G;
        if (k >= N1) mbar_wait(&empty1[s], ((k / N1) & 1) ^ 1);
        if (lane == 0) mbar_expect_tx(&full1[s], PIECE * 4);
        __syncwarp();
        float* dst = ring1 + (size_t)s * PIECE;
        if (lane < R / BOX) {
          if (HINT) tensor_copy_hint(dst + lane * BOX * W, &xmap, b * W, chunk * R + lane * BOX, &full1[s], keep);
          else tensor_copy(dst + lane * BOX * W, &xmap, b * W, chunk * R + lane * BOX, &full1[s]);
        }
      }
      const int j = k - D;
      if (j >= 0) {  // pass 2 of piece j
        const int s = j % N2, t = c0 + j * grid, b = t / G, chunk = t % G;
        if (j >= N2) mbar_wait(&empty2[s], ((j / N2) & 1) ^ 1);
        if (WAIT && lane == 0)
          while (ld_acquire(arrivals + b) < (epoch + 1) * G) {}
        __syncwarp();
        for (int c = lane; c < W; c += 32) {
          const float K = __ldg(x + b * W + c);
          float mean = K, rstd = 1.f;
          if (WAIT) {
            const float dm = __ldcg(acc + b * 2 * W + c) / M;
            mean = K + dm;
            if (STD) rstd = rsqrtf(__ldcg(acc + b * 2 * W + W + c) / M - dm * dm + EPS);
          }
          stat2[s][0][c] = mean;
          stat2[s][1][c] = rstd;
        }
        __syncwarp();
        if (lane == 0) mbar_expect_tx(&full2[s], PIECE * 4);  // releases stat2 to the output warps
        __syncwarp();
        float* dst = ring2 + (size_t)s * PIECE;
        if (lane < R / BOX) {
          if (HINT) tensor_copy_hint(dst + lane * BOX * W, &xmap, b * W, chunk * R + lane * BOX, &full2[s], drop);
          else tensor_copy(dst + lane * BOX * W, &xmap, b * W, chunk * R + lane * BOX, &full2[s]);
        }
      }
    }
    return;
  }

  if (warp <= STATS_WARPS) {  // pass 1: the piece's sums of d = x - K and d·d
    constexpr int RSTEP = 32 * STATS_WARPS / QW;
    const int st = tid - 32, q = st % QW, r0 = st / QW, sw = st / 32;
    for (int k = 0; k < KC; ++k) {
      const int s = k % N1, h = k & 1, t = c0 + k * grid, b = t / G;
      mbar_wait(&full1[s], (k / N1) & 1);
      const float4 K = __ldg(reinterpret_cast<const float4*>(x) + b * QW + q);
      const float4* p4 = reinterpret_cast<const float4*>(ring1 + (size_t)s * PIECE);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f), a2 = a;
      #pragma unroll 8
      for (int r = r0; r < R; r += RSTEP) {
        const float4 d = sub4(p4[r * QW + q], K);
        a = add4(a, d);
        if (STD) a2 = add4(a2, mul4(d, d));
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty1[s]);
      #pragma unroll
      for (int o = QW; o < 32; o <<= 1) { a = add4(a, shfl4(a, o)); if (STD) a2 = add4(a2, shfl4(a2, o)); }
      if (lane < QW) {
        reinterpret_cast<float4*>(sred[h][sw])[lane] = a;
        if (STD) reinterpret_cast<float4*>(sred2[h][sw])[lane] = a2;
      }
      named_sync(1, 32 * STATS_WARPS);
      if (st < W) {
        float s1 = 0.f, s2 = 0.f;
        #pragma unroll
        for (int w = 0; w < STATS_WARPS; ++w) { s1 += sred[h][w][st]; if (STD) s2 += sred2[h][w][st]; }
        sums[s][0][st] = s1;
        sums[s][1][st] = s2;
      }
      named_sync(1, 32 * STATS_WARPS);
      if (st == 0) mbar_arrive(&summed[s]);
    }
    return;
  }

  if (warp == STATS_WARPS + 1) {  // publisher: the only warp whose release waits for anything, its own adds
    for (int k = 0; k < KC; ++k) {
      const int s = k % N1, t = c0 + k * grid, b = t / G;
      mbar_wait(&summed[s], (k / N1) & 1);
      if (WAIT) {
        for (int c = lane; c < W; c += 32) {
          atomicAdd(acc + b * 2 * W + c, sums[s][0][c]);
          if (STD) atomicAdd(acc + b * 2 * W + W + c, sums[s][1][c]);
        }
        __threadfence();
        __syncwarp();
        if (lane == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(arrivals + b) : "memory");
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty1[s]);
    }
    return;
  }

  // pass 2: output warps
  constexpr int RSTEP = 32 * OUT_WARPS / QW;
  const int ot = tid - 32 * (2 + STATS_WARPS), q = ot % QW, r0 = ot / QW;
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int j = 0; j < KC; ++j) {
    const int s = j % N2, t = c0 + j * grid, b = t / G, chunk = t % G;
    mbar_wait(&full2[s], (j / N2) & 1);
    const float4 mu = reinterpret_cast<const float4*>(stat2[s][0])[q];
    const float4 rs = reinterpret_cast<const float4*>(stat2[s][1])[q];
    const float4* p4 = reinterpret_cast<const float4*>(ring2 + (size_t)s * PIECE);
    #pragma unroll 8
    for (int r = r0; r < R; r += RSTEP) {
      float4 o = sub4(p4[r * QW + q], mu);
      if (STD) o = mul4(o, rs);
      __stcs(y4 + (size_t)(chunk * R + r) * (N / 4) + b * QW + q, o);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty2[s]);
  }
}

""" + HOST_HELPERS + r"""
template <int W, int R, int N1, int N2, int D, int MODE, bool HINT>
int64_t launch(torch::Tensor x, torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, int64_t epoch, int64_t grid,
               int64_t stream) {
  return launch_over_x(staged<W, R, N1, N2, D, MODE, HINT>, THREADS, (size_t)(N1 + N2) * R * W * sizeof(float), W,
                       R < 256 ? R : 256, x, y, acc, ctr, epoch, grid, stream);
}

int64_t run(torch::Tensor x, torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, int64_t epoch, int64_t variant,
            int64_t mode, int64_t grid, int64_t stream) {
  switch (variant * 3 + mode) {
@CASES@
  }
  TORCH_CHECK(false, "no such variant");
  return 0;
}
"""

# (W columns a block, R rows a piece, N1 and N2 ring slots, D pieces between the passes, L2 hints)
VARIANTS = [(32, 256, 3, 3, 6, False), (32, 256, 3, 3, 6, True), (32, 256, 3, 3, 10, True),
            (64, 128, 3, 3, 8, True), (64, 128, 3, 3, 12, True)]


def source() -> str:
    cases = [f"    case {v * 3 + mode}: return launch<{w}, {r}, {n1}, {n2}, {d}, {mode}, {str(hint).lower()}>"
             f"(x, y, acc, ctr, epoch, grid, stream);"
             for v, (w, r, n1, n2, d, hint) in enumerate(VARIANTS) for mode in range(3)]
    return CUDA.replace("@CASES@", "\n".join(cases))


def main():
    bench = Bench("column_l2_tma_probe", source())
    for v, (w, r, n1, n2, d, hint) in enumerate(VARIANTS):
        for mode in range(3):
            bench.time(f"W={w} R={r} rings {n1}+{n2} D={d} hints={hint}", v, mode, bench.sms)


if __name__ == "__main__":
    main()
