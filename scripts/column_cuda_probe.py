"""Device probe: the column patterns (column_center, column_standardize at 65536x1024 fp32) as hand-written CUDA.

The generated Triton kernels hold 32-column pieces (128-byte rows) because Triton's TMA could not copy 256-byte box
rows into a piece's row slices, and the 32-column access pattern alone runs at 87-88% of copy where 64-column rows
run at 94-95%. Here, in CUDA, nothing stops 64-column pieces:

- A persistent cooperative grid (one CTA per SM). A group of G = M / R CTAs shares a column block of W columns; each
  CTA holds a piece of R rows x W columns (128 KB) in registers.
- The next piece goes out as 16-byte cp.async copies into shared memory the moment the current one has moved into
  registers, before its sums, the group's barrier and the stores, so reads stay in flight through the barrier.
- The barrier: each CTA stores its piece's column means (and centred sums of squares) to its own slots, one release
  arrival on the group's counter, acquiring polls; then every CTA combines the group's partials (Chan, about member
  0's mean so that the two sums after the barrier are independent).

MODE 0 normalises each piece by its own statistics (wrong on purpose: the access pattern alone), 1 is
column_center, 2 column_standardize, 3 column_center
with the pieces' column sums added atomically (red.global.add, order-dependent) so that one 256-byte read follows the
barrier. Not a test: prints one line per variant against torch's copy.

    python scripts/column_cuda_probe.py            # on the GPU
    python scripts/column_cuda_probe.py --emit f.cu  # the CUDA source, for nvcc -Xptxas -v on a machine without one
"""
import argparse

M, N = 65536, 1024
# (piece held in regs or a ring of smem (lag), W columns, R rows, threads, CTAs per SM or ring length): G = M / R CTAs per group, grid 128 or 256 CTAs
# session 10, first runs (regs, __stcs, center / standardize / center with atomics, us): (64, 512, 512, 1) 235.8 /
# 245.7 / 228.9; (32, 1024, 512, 1) 245.2 / 249.9 / 242.2; (32, 512, 256, 2) 227.0 / 233.1 / 219.9;
# (64, 256, 256, 2) 246.7 / 282.4 / 228.4; own statistics 195-197 (W=64), 207-209 (W=32)
VARIANTS = [("regs", 32, 512, 256, 2), ("lag", 32, 512, 256, 3), ("lag", 32, 512, 512, 3), ("lag", 32, 512, 256, 2)]
MODES = {"regs": 4, "lag": 5}

# shared-memory address, cp.async, float4 sums and the column totals of a W-column tile (also
# scripts/column_l2_stage_probe.py)
COLUMN_HELPERS = r"""
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(su32(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ float4 add4(float4 a, float4 b) { return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w); }
__device__ __forceinline__ float4 shfl4(float4 a, int o) {
  return make_float4(__shfl_xor_sync(~0u, a.x, o), __shfl_xor_sync(~0u, a.y, o), __shfl_xor_sync(~0u, a.z, o),
                     __shfl_xor_sync(~0u, a.w, o));
}

// sums of 4 adjacent columns from every thread into red[c] for the W columns (thread tid < W reads red[tid] after)
template <int W, int T>
__device__ __forceinline__ float column_total(float4 s, float* red) {
  constexpr int Q = W / 4;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  #pragma unroll
  for (int o = Q; o < 32; o <<= 1) s = add4(s, shfl4(s, o));
  if (lane < Q && warp < T / 32) reinterpret_cast<float4*>(red)[warp * Q + lane] = s;
  __syncthreads();
  float t = 0.f;
  if (tid < W) {
    #pragma unroll
    for (int w = 0; w < T / 32; ++w) t += red[w * W + tid];
  }
  return t;
}

"""

CUDA = r"""
#include <cuda_runtime.h>
#include <cstdint>

constexpr int M = @M@, N = @N@, N4 = N / 4;

""" + COLUMN_HELPERS + r"""
// The group's partials of each column combined (Chan, about member 0's mean K): thread (set, c) sums partials set,
// set + NS, ... of column c (`active` threads only), the sets meet in red / red2, and threads tid < W get (mean,
// centred sum of squares) of their column. The caller frees red / red2 first; this ends past a block barrier.
template <int W, int T, int G, int R, bool STD>
__device__ __forceinline__ float2 combine_partials(const float* mine, bool active, float* red, float* red2) {
  constexpr int NS = T / W;
  const int tid = threadIdx.x, c = tid % W, set = tid / W;
  const float K = STD ? __ldcg(mine + c) : 0.f;
  if (active) {
    float sm = 0.f, sq = 0.f;
    #pragma unroll 16
    for (int j = 0; j < G / NS; ++j) {
      const float ms = __ldcg(mine + (set + j * NS) * W + c);
      sm += ms;
      if (STD) sq += __ldcg(mine + (G + set + j * NS) * W + c) + (float)R * (ms - K) * (ms - K);
    }
    red[set * W + c] = sm;
    red2[set * W + c] = sq;
  }
  __syncthreads();
  float tm = 0.f, tq = 0.f;
  if (tid < W) {
    #pragma unroll
    for (int s2 = 0; s2 < NS; ++s2) { tm += red[s2 * W + tid]; tq += red2[s2 * W + tid]; }
  }
  const float mean = tm / G;
  return make_float2(mean, tq - (float)(G * R) * (mean - K) * (mean - K));
}

template <int W, int R, int T, int MINB, int MODE>
__global__ void __launch_bounds__(T, MINB) col_kernel(const float* __restrict__ x, float* __restrict__ y, float* part,
                                                   unsigned long long* cnt, long long epoch) {
  constexpr int Q = W / 4, RPP = T / Q, PER_T = R / RPP, G = M / R, NB = N / W;
  extern __shared__ float4 buf[];  // the next piece: PER_T x T float4, each thread's own slots
  __shared__ __align__(16) float red[T / 32 * W];
  __shared__ __align__(16) float red2[T / 32 * W];
  __shared__ __align__(16) float stat[2][W];
  const int tid = threadIdx.x, q = tid % Q, r0 = tid / Q;
  const int NG = gridDim.x / G, g = blockIdx.x / G, i = blockIdx.x % G, BPG = NB / NG;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  auto at = [&](int cb, int j) { return (size_t)(i * R + r0 + j * RPP) * N4 + cb * Q + q; };
  auto issue = [&](int cb) {
    #pragma unroll
    for (int j = 0; j < PER_T; ++j) cp_async16(&buf[j * T + tid], x4 + at(cb, j));
    asm volatile("cp.async.commit_group;" ::: "memory");
  };
  if (MODE == 3 && blockIdx.x == 0)  // the next launch's accumulators (this one's were zeroed by the last)
    for (int k = tid; k < N; k += T) part[(size_t)2 * M / R * N + ((epoch + 1) & 1) * N + k] = 0.f;
  issue(g);
  int it = 0;
  for (int cb = g; cb < NB; cb += NG, ++it) {
    asm volatile("cp.async.wait_group 0;" ::: "memory");
    float4 v[PER_T];
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    #pragma unroll
    for (int j = 0; j < PER_T; ++j) { v[j] = buf[j * T + tid]; }
    if (cb + NG < NB) issue(cb + NG);  // each thread refills only the slots it has just read
    #pragma unroll
    for (int j = 0; j < PER_T; ++j) s = add4(s, v[j]);
    const float mloc = column_total<W, T>(s, red) / R;
    float qloc = 0.f;
    if ((MODE & 1) == 0) {
      if (tid < W) stat[0][tid] = mloc;
      __syncthreads();
      const float4 m = reinterpret_cast<float4*>(stat[0])[q];
      float4 d2 = make_float4(0.f, 0.f, 0.f, 0.f);
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) {
        const float a = v[j].x - m.x, b = v[j].y - m.y, c = v[j].z - m.z, d = v[j].w - m.w;
        d2 = add4(d2, make_float4(a * a, b * b, c * c, d * d));
      }
      qloc = column_total<W, T>(d2, red2);
    }
    float mean = mloc, m2 = qloc * G;
    if (MODE != 0) {
      float* mine = part + (size_t)cb * 2 * G * W;  // [2][G][W]: means, then centred sums of squares
      float* acc = part + (size_t)2 * M / R * N + (epoch & 1) * N + cb * W;  // mode 3: this launch's sums
      if (MODE == 3 && tid < W) atomicAdd(acc + tid, mloc);
      else if (tid < W) {
        mine[i * W + tid] = mloc;
        if (MODE == 2) mine[(G + i) * W + tid] = qloc;
      }
      __syncthreads();
      if (tid == 0) {
        unsigned long long old, seen, target = (unsigned long long)(epoch * BPG + it + 1) * G;
        asm volatile("atom.add.release.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(cnt + g) : "memory");
        seen = old + 1;
        while (seen < target) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(cnt + g) : "memory");
      }
      __syncthreads();
      if (MODE == 3) {
        if (tid < W) mean = __ldcg(acc + tid) / G;
      } else {  // red is free: the block barrier above follows its last reads
        const float2 mm = combine_partials<W, T, G, R, MODE == 2>(mine, true, red, red2);
        mean = mm.x;
        m2 = mm.y;
      }
    }
    if (tid < W) { stat[0][tid] = mean; stat[1][tid] = MODE & 1 ? 1.f : rsqrtf(m2 / M + 1e-5f); }
    __syncthreads();
    const float4 mu = reinterpret_cast<float4*>(stat[0])[q], rs = reinterpret_cast<float4*>(stat[1])[q];
    #pragma unroll
    for (int j = 0; j < PER_T; ++j) {
      float4 o;
      if (MODE & 1) o = make_float4(v[j].x - mu.x, v[j].y - mu.y, v[j].z - mu.z, v[j].w - mu.w);
      else o = make_float4((v[j].x - mu.x) * rs.x, (v[j].y - mu.y) * rs.y, (v[j].z - mu.z) * rs.z, (v[j].w - mu.w) * rs.w);
      @STORE@(y4 + at(cb, j), o);
    }
  }
}

// grid <= 0: how many CTAs of `kernel` fit at once (negated); else a cooperative launch of `grid` CTAs
template <class K>
cudaError_t cooperative(K kernel, int threads, size_t smem, int grid, cudaStream_t stream, const float* x, float* y,
                        float* part, unsigned long long* cnt, long long epoch) {
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  if (grid <= 0) {
    int per_sm = 0, sms = 0, dev = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev);
    err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem);
    return err != cudaSuccess ? err : (cudaError_t)(-per_sm * sms);
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, x, y, part, cnt, epoch);
}

template <int W, int R, int T, int MINB, int MODE>
cudaError_t launch(const float* x, float* y, float* part, unsigned long long* cnt, long long epoch, int grid,
                   cudaStream_t stream) {
  constexpr int Q = W / 4, PER_T = R / (T / Q);
  return cooperative(col_kernel<W, R, T, MINB, MODE>, T, (size_t)PER_T * T * 16, grid, stream, x, y, part, cnt, epoch);
}

// The lagged design: pieces live only in shared memory, in a ring of NBUF. Iteration k sums piece k and arrives at
// its barrier, then finishes piece k-1 (whose barrier had a whole iteration to complete: wait, combine, store), then
// refills k-1's buffer with piece k+NBUF-1. MODE 0 own statistics, 1 center and 2 standardize reading every
// partial, 3 center and 4 standardize adding the partials atomically about K = x[0, column].
// T data threads load, sum and store; one more warp (the sync warp) writes the partials, arrives and polls, so the
// release of its arrival never waits for the data threads' streaming stores.
template <int W, int R, int T, int NBUF, int MODE>
__global__ void __launch_bounds__(T + 32, 1) lag_kernel(const float* __restrict__ x, float* __restrict__ y,
                                                        float* part, unsigned long long* cnt, long long epoch) {
  constexpr int Q = W / 4, RPP = T / Q, PER_T = R / RPP, G = M / R, NB = N / W, PIECE4 = PER_T * T;
  constexpr bool STD = MODE == 2 || MODE == 4, ATOMIC = MODE >= 3;
  extern __shared__ float4 buf[];  // NBUF pieces, each data thread's own slots
  __shared__ __align__(16) float red[T / 32 * W];
  __shared__ __align__(16) float red2[T / 32 * W];
  __shared__ __align__(16) float stat[2][W];
  __shared__ __align__(16) float lmean[W];
  __shared__ __align__(16) float tot[2][W];
  const int tid = threadIdx.x, q = tid % Q, r0 = tid / Q, lane = tid & 31;
  const bool data = tid < T, syncer = tid == T;
  const int NG = gridDim.x / G, g = blockIdx.x / G, i = blockIdx.x % G, BPG = NB / NG;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  float* accs = part + (size_t)2 * M / R * N;  // [parity][2][N] for the atomic modes
  if (ATOMIC && blockIdx.x == 0)  // the next launch's accumulators (this one's were zeroed by the last)
    for (int k = tid; k < 2 * N; k += T + 32) accs[((epoch + 1) & 1) * 2 * N + k] = 0.f;
  auto at = [&](int cb, int j) { return (size_t)(i * R + r0 + j * RPP) * N4 + cb * Q + q; };
  auto issue = [&](int it) {
    if (data && it < BPG) {
      float4* dst = buf + (it % NBUF) * PIECE4;
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) cp_async16(&dst[j * T + tid], x4 + at(g + it * NG, j));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");  // empty past the end, so the counts stay uniform
  };
  // one counter per column block: a CTA may arrive at block k+1 before another has arrived at block k
  auto poll = [&](int it) {
    if (syncer) {
      unsigned long long seen, target = (unsigned long long)(epoch + 1) * G;
      do asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(cnt + g + it * NG) : "memory");
      while (seen < target);
    }
  };
  auto finish = [&](int it) {  // every thread: block it's statistics, then the data threads store its piece
    const int cb = g + it * NG;
    const float* mine = part + (size_t)cb * 2 * G * W;
    const float* acc = accs + (epoch & 1) * 2 * N + cb * W;
    __syncthreads();  // after the sync warp's poll
    if (MODE != 0 && ATOMIC) {
      if (tid < W) {
        const float K = STD ? __ldg(x + cb * W + tid) : 0.f;
        const float mean = K + __ldcg(acc + tid) / G;
        const float m2 = STD ? __ldcg(acc + N + tid) - (float)M * (mean - K) * (mean - K) : 0.f;
        stat[0][tid] = mean;
        stat[1][tid] = STD ? rsqrtf(m2 / M + 1e-5f) : 1.f;
      }
    } else if (MODE != 0) {
      const float2 mm = combine_partials<W, T, G, R, STD>(mine, data, red, red2);
      if (tid < W) {
        stat[0][tid] = mm.x;
        stat[1][tid] = STD ? rsqrtf(mm.y / M + 1e-5f) : 1.f;
      }
    }
    __syncthreads();
    if (data) {
      const float4 mu = reinterpret_cast<float4*>(stat[0])[q], rs = reinterpret_cast<float4*>(stat[1])[q];
      const float4* src = buf + (it % NBUF) * PIECE4;
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) {
        const float4 v = src[j * T + tid];
        float4 o = make_float4(v.x - mu.x, v.y - mu.y, v.z - mu.z, v.w - mu.w);
        if (STD || MODE == 0) o = make_float4(o.x * rs.x, o.y * rs.y, o.z * rs.z, o.w * rs.w);
        @STORE@(y4 + at(cb, j), o);
      }
    }
  };
  #pragma unroll 1
  for (int k = 0; k < NBUF - 1; ++k) issue(k);
  #pragma unroll 1
  for (int it = 0; it < BPG; ++it) {
    const int cb = g + it * NG;
    if (NBUF == 2) asm volatile("cp.async.wait_group 0;" ::: "memory");
    else asm volatile("cp.async.wait_group 1;" ::: "memory");
    const float4* cur = buf + (it % NBUF) * PIECE4;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    if (data) {
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) s = add4(s, cur[j * T + tid]);
    }
    const float mloc = column_total<W, T>(s, red) / R;
    float qloc = 0.f;
    if (STD || MODE == 0) {
      if (tid < W) lmean[tid] = mloc;
      __syncthreads();
      const float4 m = reinterpret_cast<float4*>(lmean)[q % Q];
      float4 d2 = make_float4(0.f, 0.f, 0.f, 0.f);
      if (data) {
        #pragma unroll
        for (int j = 0; j < PER_T; ++j) {
          const float4 v = cur[j * T + tid];
          const float a = v.x - m.x, b = v.y - m.y, c = v.z - m.z, d = v.w - m.w;
          d2 = add4(d2, make_float4(a * a, b * b, c * c, d * d));
        }
      }
      qloc = column_total<W, T>(d2, red2);
    }
    if (MODE == 0) {  // own statistics, in place of a combine
      if (tid < W) { stat[0][tid] = mloc; stat[1][tid] = rsqrtf(qloc / R + 1e-5f); }
      finish(it);
      issue(it + NBUF - 1);
      continue;
    }
    if (tid < W) { tot[0][tid] = mloc; tot[1][tid] = qloc; }
    __syncthreads();
    if (tid >= T) {  // the sync warp: partials out, a fence that waits only for them, the arrival
      float* mine = part + (size_t)cb * 2 * G * W;
      float* acc = accs + (epoch & 1) * 2 * N + cb * W;
      for (int c = lane; c < W; c += 32) {
        const float ml = tot[0][c], ql = tot[1][c];
        if (ATOMIC) {
          const float K = STD ? __ldg(x + cb * W + c) : 0.f;
          atomicAdd(acc + c, ml - K);
          if (STD) atomicAdd(acc + N + c, ql + (float)R * (ml - K) * (ml - K));
        } else {
          mine[i * W + c] = ml;
          if (STD) mine[(G + i) * W + c] = ql;
        }
      }
      __threadfence();
      __syncwarp();
      if (syncer) asm volatile("red.release.gpu.global.add.u64 [%0], 1;" :: "l"(cnt + cb) : "memory");
      if (it > 0) poll(it - 1);
    }
    if (it > 0) finish(it - 1);
    issue(it + NBUF - 1);
  }
  if (MODE != 0) {
    poll(BPG - 1);
    finish(BPG - 1);
  }
}

template <int W, int R, int T, int NBUF, int MODE>
cudaError_t lag_launch(const float* x, float* y, float* part, unsigned long long* cnt, long long epoch, int grid,
                       cudaStream_t stream) {
  constexpr int Q = W / 4, PER_T = R / (T / Q);
  return cooperative(lag_kernel<W, R, T, NBUF, MODE>, T + 32, (size_t)NBUF * PER_T * T * 16, grid, stream, x, y,
                     part, cnt, epoch);
}

int64_t col(torch::Tensor x, torch::Tensor y, torch::Tensor part, torch::Tensor cnt, int64_t epoch, int64_t variant,
            int64_t mode, int64_t grid, int64_t stream_handle) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  auto* cp = reinterpret_cast<unsigned long long*>(cnt.data_ptr<int64_t>());
  cudaError_t err = cudaErrorInvalidValue;
  switch (variant * 8 + mode) {
@CASES@
  }
  if ((int)err < 0) return -(int64_t)(int)err;
  TORCH_CHECK(err == cudaSuccess, "column probe launch: ", cudaGetErrorString(err));
  return 0;
}
"""


def source(store: str) -> str:
    cases = []
    for v, (kind, w, r, t, extra) in enumerate(VARIANTS):
        for mode in range(MODES[kind]):
            fn = "launch" if kind == "regs" else "lag_launch"
            cases.append(f"    case {v * 8 + mode}: err = {fn}<{w}, {r}, {t}, {extra}, {mode}>(xp, yp, pp, cp, epoch, "
                         f"(int)grid, stream); break;")
    return (CUDA.replace("@M@", str(M)).replace("@N@", str(N)).replace("@CASES@", "\n".join(cases))
            .replace("@STORE@", store))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--emit")
    ap.add_argument("--store", default="__stcs", help="__stcs (streaming) or __stcg")
    args = ap.parse_args()
    if args.emit:
        with open(args.emit, "w") as f:
            f.write("#include <torch/extension.h>\n" + source(args.store))
        return
    import torch
    from torch.utils.cpp_extension import load_inline
    from triton.testing import do_bench

    ext = load_inline(name=f"column_cuda_probe_{args.store}", cpp_sources=[
        "int64_t col(torch::Tensor x, torch::Tensor y, torch::Tensor part, torch::Tensor cnt, int64_t epoch, "
        "int64_t variant, int64_t mode, int64_t grid, int64_t stream_handle);"],
        cuda_sources=["#include <torch/extension.h>\n" + source(args.store)], functions=["col"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"], verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, N, device="cuda", generator=gen) * 3 + 100
    y = torch.empty_like(x)
    part = torch.zeros(N * 2 * 256 + 2 * N, device="cuda")
    cnt = torch.zeros(64, dtype=torch.int64, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    std = (x - x.mean(0)) * torch.rsqrt(x.var(0, unbiased=False) + 1e-5)
    refs = {1: x - x.mean(0), 3: x - x.mean(0), 2: std, 4: std}
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=100, return_mode="median") * 1e-3
    floor = 2 * x.numel() * 4 / 3.00e12
    print(f"torch copy {copy * 1e6:.1f} us; floor at the bench's 3.00 TB/s {floor * 1e6:.1f} us; store {args.store}",
          flush=True)
    for v, (kind, w, r, t, extra) in enumerate(VARIANTS):
        minb = extra if kind == "regs" else 1
        fits = ext.col(x, y, part, cnt, 0, v, 0, 0, stream)
        g = M // r
        grid = g * max(1, min(fits, 132 * minb) // g)
        if fits < g:
            print(f"W={w} R={r} T={t}: a group of {g} does not fit ({fits} CTAs at once)", flush=True)
            continue
        for mode in range(MODES[kind]):
            cnt.zero_()
            part.zero_()
            epoch = [0]

            def run():
                ext.col(x, y, part, cnt, epoch[0], v, mode, grid, stream)
                epoch[0] += 1
            run()
            torch.cuda.synchronize()
            err = (y - refs[mode]).abs().max().item() if mode else float("nan")
            y.zero_()
            us = do_bench(run, warmup=5, rep=200, return_mode="median")
            print(f"{kind} {extra} W={w} R={r} T={t} grid={grid} mode {mode}: {us * 1e3:.1f} us, {floor / (us * 1e-3):.0%} of the "
                  f"floor, max error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
