"""Device probe: the column patterns (65536x1024 fp32) with pieces handed out by a ticket counter, so that fast SMs
take more of them, and warp-specialised CTAs in which no warp that waits on another CTA holds up the stream.

Session 10's lagged CUDA kernel (a ring of three pieces in shared memory, block k's barrier awaited one block later)
still lost 24 µs to the access pattern alone, and its notes read that as every CTA pacing the slowest of the group
each block: with a fixed stretch of rows per CTA, the group moves at its slowest SM's rate however much slack the
ring gives, if some SMs are slower for the whole kernel. Here the work is pieces (R rows x 32 columns of one column
block); piece t is block t / G, rows (t % G)·R. Each CTA (one per SM, all 132) runs four roles:

- a producer warp takes the next ticket with one atomic add when a ring slot frees, and copies the piece into the
  slot as TMA boxes of up to 256 rows (TENSOR) or as 1-D bulk copies of each 128-byte row, on the slot's mbarrier;
- four statistics warps sum the piece's columns from shared memory as d = x - K (K = x[0, column]) and d·d, and
  free the slot for the producer; they never wait on another CTA;
- a publisher warp adds the sums into the block's accumulators (red.add) and arrives on the block's counter with a
  release: the only warp whose fence waits for anything, and only for its own adds;
- eight output warps wait until the block's counter holds all G arrivals, read the block's sums, and write
  (x - mean)·rstd from the slot with streaming stores, then free it.

MODE 0 normalises each piece by its own mean (the access pattern and the roles, no waiting on another CTA),
1 is column_center, 2 column_standardize, 3 loads the pieces and sums them but stores nothing. STATIC hands piece t
to CTA t % grid instead of by ticket. The grid is launched cooperatively (every CTA at once): the waits need it.

    PYTHONPATH=. python scripts/column_ticket_probe.py

Session 38, H200 (torch's copy of the same 512 MB 126.7-126.9 µs): no gain; BENCHMARKS.md has the tables. With TMA
boxes the access pattern alone runs at 80-85% of copy (150-160 µs) and the loads alone at 87-92%; the waits cost
another 34 µs (center 184.6, standardize 185.4 at best, against 162 and 174 for the generated kernels). Three rings
of 64 KB a SM hold too little of a block's latency. A first version in which the statistics warps waited for their
own arrival's atomic and the last arriver combined the partials ran at 245-451 µs; 1-D bulk copies of each 128-byte
row instead of TMA boxes held even the loads alone to 14% of copy.
"""
import statistics

from column_cuda_probe import COLUMN_HELPERS  # scripts/ is on the path when run as a script

# mbarriers, 1-D bulk and 2-D tensor copies into shared memory, named barriers, acquiring loads, float4 arithmetic
# (also scripts/column_l2_tma_probe.py)
ASYNC_HELPERS = r"""
__device__ __forceinline__ void mbar_init(uint64_t* b, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(su32(b)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(su32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(su32(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  uint32_t ok = 0;
  while (!ok)
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(ok) : "r"(su32(b)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(su32(dst)), "l"(src), "r"(bytes), "r"(su32(bar)) : "memory");
}
// a [rows, 32] box of the [M, N] input at (row, col) into shared memory, row-major, unswizzled
__device__ __forceinline__ void tensor_copy(void* dst, const CUtensorMap* map, int col, int row, uint64_t* bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
               :: "r"(su32(dst)), "l"(map), "r"(col), "r"(row), "r"(su32(bar)) : "memory");
}
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;" :: "r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ unsigned long long ld_acquire(const unsigned long long* p) {
  unsigned long long v;
  asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ float4 ldcg4(const float* p) { return __ldcg(reinterpret_cast<const float4*>(p)); }
__device__ __forceinline__ float4 sub4(float4 a, float4 b) { return make_float4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w); }
__device__ __forceinline__ float4 mul4(float4 a, float4 b) { return make_float4(a.x * b.x, a.y * b.y, a.z * b.z, a.w * b.w); }

"""

# the host side: the driver's cuTensorMapEncodeTiled, found once through the runtime (no -lcuda), and a cooperative
# launch of a kernel(xmap, x, y, acc, ctr, epoch) over the [M, N] fp32 input in [box_rows, box_cols] boxes (also
# scripts/column_l2_tma_probe.py; M and N come from the source it is pasted into)
HOST_HELPERS = r"""
static PFN_cuTensorMapEncodeTiled_v12000 encode_tiled() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = nullptr;
  if (!fn) {
    cudaDriverEntryPointQueryResult q;
    TORCH_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", (void**)&fn, 12000, cudaEnableDefault, &q)
                == cudaSuccess && fn, "cuTensorMapEncodeTiled not found");
  }
  return fn;
}

// epoch < 0 only asks how many CTAs of `kernel` fit an SM
template <class Kernel>
int64_t launch_over_x(Kernel kernel, int threads, size_t smem, int box_cols, int box_rows, torch::Tensor x,
                      torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, int64_t epoch, int64_t grid, int64_t stream) {
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) == cudaSuccess,
              "smem attribute");
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
  if (epoch < 0) return per_sm;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* ap = acc.data_ptr<float>();
  unsigned long long* cp = reinterpret_cast<unsigned long long*>(ctr.data_ptr<int64_t>());
  unsigned long long ep = (unsigned long long)epoch;
  CUtensorMap xmap;
  const cuuint64_t dims[2] = {(cuuint64_t)N, (cuuint64_t)M}, strides[1] = {(cuuint64_t)N * 4};
  const cuuint32_t box[2] = {(cuuint32_t)box_cols, (cuuint32_t)box_rows}, estr[2] = {1, 1};
  TORCH_CHECK(encode_tiled()(&xmap, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 2, (void*)xp, dims, strides, box, estr,
                             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                             CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS, "tensor map");
  void* args[] = {(void*)&xmap, (void*)&xp, (void*)&yp, (void*)&ap, (void*)&cp, (void*)&ep};
  cudaError_t err = cudaLaunchCooperativeKernel((void*)kernel, dim3((unsigned)grid), dim3(threads), args, smem,
                                                reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "launch: ", cudaGetErrorString(err));
  return per_sm;
}
"""

CUDA = r"""
#include <torch/extension.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>
#include <cstdint>

constexpr int M = 65536, N = 1024, W = 32, NB = N / W, N4 = N / 4;
constexpr int STATS_WARPS = 4, OUT_WARPS = 8, THREADS = 32 * (2 + STATS_WARPS + OUT_WARPS);
constexpr float EPS = 1e-5f;

""" + COLUMN_HELPERS + r"""
""" + ASYNC_HELPERS + r"""
// ctr: [0] tickets, [8, 8 + NB) arrivals per block; both only grow, so launch `epoch` reads its own targets without a
// reset. acc: [parity][NB][2][W] the blocks' shifted sums (launch e adds into parity e & 1 and zeroes the other for
// launch e + 1).
template <int R, int NBUF, int MODE, bool STATIC, bool TENSOR>
__global__ void __launch_bounds__(THREADS, 1) ticket_kernel(const __grid_constant__ CUtensorMap xmap,
    const float* __restrict__ x, float* __restrict__ y, float* accs, unsigned long long* ctr,
    unsigned long long epoch) {
  constexpr int G = M / R, TOTAL = NB * G, PIECE = R * W;
  constexpr bool STD = MODE == 2, WAIT = MODE == 1 || MODE == 2;
  extern __shared__ __align__(128) float ring[];  // NBUF pieces of R rows x W columns
  __shared__ uint64_t full[NBUF], empty[NBUF], summed[NBUF];
  __shared__ int ticket[NBUF];
  __shared__ __align__(16) float sums[NBUF][2][W];  // the piece's sums of d = x - K and of d * d
  __shared__ __align__(16) float sred[2][STATS_WARPS][W], sred2[2][STATS_WARPS][W];
  unsigned long long* tickets = ctr;
  unsigned long long* arrivals = ctr + 8;
  float* acc = accs + (epoch & 1) * NB * 2 * W;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  if (tid == 0) {
    for (int s = 0; s < NBUF; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], STATS_WARPS + OUT_WARPS + 1);
      mbar_init(&summed[s], 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();

  if (warp == 0) {  // producer
    if (blockIdx.x == 0)
      for (int k = lane; k < NB * 2 * W; k += 32) accs[((epoch + 1) & 1) * NB * 2 * W + k] = 0.f;
    for (int k = 0;; ++k) {
      const int s = k % NBUF;
      if (k >= NBUF) mbar_wait(&empty[s], ((k / NBUF) & 1) ^ 1);
      long long t = 0;
      if (STATIC) t = blockIdx.x + (long long)k * gridDim.x;
      else {
        if (lane == 0) t = (long long)(atomicAdd(tickets, 1ull) - epoch * (TOTAL + gridDim.x));
        t = __shfl_sync(~0u, t, 0);
      }
      if (t >= TOTAL) {
        if (lane == 0) { ticket[s] = -1; mbar_arrive(&full[s]); }
        break;
      }
      if (lane == 0) { ticket[s] = (int)t; mbar_expect_tx(&full[s], PIECE * 4); }
      __syncwarp();
      const int b = (int)(t / G), chunk = (int)(t % G);
      float* dst = ring + (size_t)s * PIECE;
      if (TENSOR) {  // boxes of BOX rows (a box spans at most 256)
        constexpr int BOX = R < 256 ? R : 256;
        if (lane < R / BOX) tensor_copy(dst + lane * BOX * W, &xmap, b * W, chunk * R + lane * BOX, &full[s]);
      } else {
        const float* src = x + (size_t)chunk * R * N + b * W;
        for (int r = lane; r < R; r += 32) bulk_copy(dst + r * W, src + (size_t)r * N, W * 4, &full[s]);
      }
    }
    return;
  }

  if (warp <= STATS_WARPS) {  // the piece's sums of d = x - K (K = x[0, column]) and d * d, from shared memory
    const int st = tid - 32, q = st % 8, r0 = st / 8, sw = st / 32;
    for (int k = 0;; ++k) {
      const int s = k % NBUF, h = k & 1;
      mbar_wait(&full[s], (k / NBUF) & 1);
      const int t = ticket[s];
      if (t < 0) break;
      const int b = t / G;
      const float4 K = __ldg(reinterpret_cast<const float4*>(x) + b * 8 + q);
      const float4* p4 = reinterpret_cast<const float4*>(ring + (size_t)s * PIECE);
      float4 a = make_float4(0.f, 0.f, 0.f, 0.f), a2 = a;
      #pragma unroll 8
      for (int r = r0; r < R; r += 16) {
        const float4 d = sub4(p4[r * 8 + q], K);
        a = add4(a, d);
        if (STD) a2 = add4(a2, mul4(d, d));
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);  // this warp is done reading the piece
      a = add4(a, shfl4(a, 8));
      a = add4(a, shfl4(a, 16));
      if (STD) { a2 = add4(a2, shfl4(a2, 8)); a2 = add4(a2, shfl4(a2, 16)); }
      if (lane < 8) {
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
        __syncwarp();
        if (st == 0) mbar_arrive(&summed[s]);
      }
    }
    return;
  }

  if (warp == STATS_WARPS + 1) {  // publisher: the only warp whose release waits for anything, its own adds
    for (int k = 0;; ++k) {
      const int s = k % NBUF;
      mbar_wait(&full[s], (k / NBUF) & 1);
      const int t = ticket[s];
      if (t < 0) break;
      mbar_wait(&summed[s], (k / NBUF) & 1);
      const int b = t / G;
      if (WAIT) {
        atomicAdd(acc + b * 2 * W + lane, sums[s][0][lane]);
        if (STD) atomicAdd(acc + b * 2 * W + W + lane, sums[s][1][lane]);
        __threadfence();
        __syncwarp();
        if (lane == 0) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(arrivals + b) : "memory");
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
    }
    return;
  }

  // output warps
  const int ot = tid - 32 * (2 + STATS_WARPS), q = ot % 8, r0 = ot / 8;
  float4* y4 = reinterpret_cast<float4*>(y);
  for (int k = 0;; ++k) {
    const int s = k % NBUF;
    const uint32_t ph = (k / NBUF) & 1;
    mbar_wait(&full[s], ph);
    const int t = ticket[s];
    if (t < 0) break;
    mbar_wait(&summed[s], ph);
    if (MODE == 3) {  // loads alone
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[s]);
      continue;
    }
    const int b = t / G, chunk = t % G;
    const float4 K = __ldg(reinterpret_cast<const float4*>(x) + b * 8 + q);
    float4 s1, s2 = make_float4(0.f, 0.f, 0.f, 0.f);
    float n = (float)R;
    if (MODE == 0) {  // the piece's own statistics
      s1 = reinterpret_cast<const float4*>(sums[s][0])[q];
    } else {
      if (ot == 0)
        while (ld_acquire(arrivals + b) < (epoch + 1) * G) {}
      named_sync(2, 32 * OUT_WARPS);
      s1 = ldcg4(acc + b * 2 * W + q * 4);
      if (STD) s2 = ldcg4(acc + b * 2 * W + W + q * 4);
      n = (float)M;
    }
    const float inv = 1.f / n;
    const float4 dm = make_float4(s1.x * inv, s1.y * inv, s1.z * inv, s1.w * inv);
    const float4 mu = add4(K, dm);
    float4 rs = make_float4(1.f, 1.f, 1.f, 1.f);
    if (STD)
      rs = make_float4(rsqrtf(s2.x * inv - dm.x * dm.x + EPS), rsqrtf(s2.y * inv - dm.y * dm.y + EPS),
                       rsqrtf(s2.z * inv - dm.z * dm.z + EPS), rsqrtf(s2.w * inv - dm.w * dm.w + EPS));
    const float4* p4 = reinterpret_cast<const float4*>(ring + (size_t)s * PIECE);
    #pragma unroll 8
    for (int r = r0; r < R; r += 32) {
      float4 o = sub4(p4[r * 8 + q], mu);
      if (STD) o = mul4(o, rs);
      __stcs(y4 + (size_t)(chunk * R + r) * N4 + b * 8 + q, o);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[s]);
  }
}

""" + HOST_HELPERS + r"""
template <int R, int NBUF, int MODE, bool STATIC, bool TENSOR>
int64_t launch(torch::Tensor x, torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, int64_t epoch, int64_t grid,
               int64_t stream) {
  return launch_over_x(ticket_kernel<R, NBUF, MODE, STATIC, TENSOR>, THREADS, (size_t)NBUF * R * W * sizeof(float), W,
                       R < 256 ? R : 256, x, y, acc, ctr, epoch, grid, stream);
}

int64_t run(torch::Tensor x, torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, int64_t epoch,
            int64_t variant, int64_t mode, int64_t grid, int64_t stream) {
  switch (variant * 4 + mode) {
@CASES@
  }
  TORCH_CHECK(false, "no such variant");
  return 0;
}
"""

# (R rows a piece, NBUF pieces in the ring, static hand-out, TMA boxes rather than 1-D bulk copies of each row)
# session 38, H200, 1-D bulk copies of 128-byte rows: the access pattern alone at 27-28% of copy whatever R, NBUF or
# the hand-out (452-487 µs; center 476-499, standardize 480-504)
# TMA boxes, a last arriver combining the partials, statistics warps that waited on their arrival: access pattern
# 149-157 µs (80-85%), loads alone 69-86, center 245-409, standardize 256-451 (the statistics warps' fence and
# atomic round trip serialised every piece). As now (publisher warp, block sums added atomically), µs for loads
# alone / access pattern / center / standardize: 512 3 static grid 132 70.8 / 160.0 / 186.7 / 186.6, grid 128
# 71.4 / 150.8 / 190.0 / 189.9; 512 3 tickets 72.7 / 151.0 / 184.6 / 185.4; 256 6 tickets 75.4 / 151.3 / 201.2 /
# 201.3; 128 12 tickets 86.3 / 157.2 / 235.7 / 247.2
VARIANTS = [(512, 3, True, True), (512, 3, False, True), (256, 6, False, True), (128, 12, False, True)]


def source() -> str:
    cases = [f"    case {v * 4 + mode}: return launch<{r}, {nbuf}, {mode}, {str(st).lower()}, {str(tensor).lower()}>"
             f"(x, y, acc, ctr, epoch, grid, stream);"
             for v, (r, nbuf, st, tensor) in enumerate(VARIANTS) for mode in range(4)]
    return CUDA.replace("@CASES@", "\n".join(cases))


class Bench:
    """What both column probes share (also scripts/column_l2_tma_probe.py): the extension compiled from `source`
    (one `run(x, y, acc, ctr, epoch, variant, mode, grid, stream)`), the input 100 + 3·randn, the references of
    modes 1 (center) and 2 (standardize), torch's copy of the same bytes, and `time` of one variant and mode."""

    def __init__(self, name: str, source: str):
        import torch
        from torch.utils.cpp_extension import load_inline

        self.ext = load_inline(name=name, cpp_sources=[
            "int64_t run(torch::Tensor x, torch::Tensor y, torch::Tensor acc, torch::Tensor ctr, "
            "int64_t epoch, int64_t variant, int64_t mode, int64_t grid, int64_t stream);"],
            cuda_sources=[source], functions=["run"],
            extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"], verbose=False)
        gen = torch.Generator(device="cuda").manual_seed(0)
        x = self.x = torch.randn(65536, 1024, device="cuda", generator=gen) * 3 + 100
        self.y = torch.empty_like(x)
        self.acc = torch.zeros(2 * 2 * 1024, device="cuda")
        self.ctr = torch.zeros(128, dtype=torch.int64, device="cuda")
        self.stream = torch.cuda.current_stream().cuda_stream
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.refs = {1: x - x.mean(0), 2: (x - x.mean(0)) * torch.rsqrt(x.var(0, unbiased=False) + 1e-5)}
        self.copy = statistics.median(self._timed(lambda: self.y.copy_(x)) for _ in range(3))
        print(f"{torch.cuda.get_device_name()}: torch copy of the same bytes {self.copy * 1e6:.1f} us "
              f"({2 * x.numel() * 4 / self.copy / 1e12:.2f} TB/s)", flush=True)

    @staticmethod
    def _timed(fn) -> float:
        from stitchflow.targets.gpu.timing import timed_median

        return timed_median(fn)

    def _error(self, mode: int) -> float:
        return (self.y - self.refs[mode]).abs().max().item() if mode in self.refs else float("nan")

    def time(self, label: str, variant: int, mode: int, grid: int, share: float = 1.0) -> None:
        """Median of three rounds, checked against eager on the first call and after all of them; `share`: the
        fraction of the copy's bytes the mode moves."""
        import torch

        self.ctr.zero_()
        self.acc.zero_()
        epoch = [0]

        def call():
            self.ext.run(self.x, self.y, self.acc, self.ctr, epoch[0], variant, mode, grid, self.stream)
            epoch[0] += 1
        self.y.zero_()
        call()
        torch.cuda.synchronize()
        err = self._error(mode)
        rounds = [self._timed(call) for _ in range(3)]
        torch.cuda.synchronize()
        us = statistics.median(rounds) * 1e6
        print(f"{label} mode {mode}: {us:.1f} us ({' / '.join(f'{t * 1e6:.1f}' for t in rounds)}), "
              f"{share * self.copy * 1e6 / us:.0%} of copy, max error {err:.1e} first call, "
              f"{self._error(mode):.1e} after {epoch[0]} calls", flush=True)


def main():
    bench = Bench("column_ticket_probe", source())
    for v, (r, nbuf, static, tensor) in enumerate(VARIANTS):
        for grid in (bench.sms, 128) if static else (bench.sms,):
            for mode in (3, 0, 1, 2):  # mode 3, loads alone, moves half the bytes
                bench.time(f"R={r} NBUF={nbuf} {'static' if static else 'tickets'} {'TMA' if tensor else 'bulk'} "
                           f"grid={grid}", v, mode, grid, 0.5 if mode == 3 else 1.0)


if __name__ == "__main__":
    main()
