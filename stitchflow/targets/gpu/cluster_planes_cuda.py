"""The CUDA text of cluster_planes' kernels: the fixed exchange, with @NAME@-style holes that
cluster_planes_emit.emit_source fills (the statistics of the piece and their combine, the epilogue printed from the
IR, the constants of the plan)."""

from .cuda_cluster import CLUSTER_CONFIG, PTX_HELPERS

HEADER = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
""" + PTX_HELPERS + CLUSTER_CONFIG

KERNEL = r"""
namespace @NAME@_ns {
constexpr int THREADS = 256, CL = @CL@, PLANES = @PLANES@, C = @C@, NPL = @NPL@, HW = @HW@, VEC = @VEC@;
constexpr int HWV = HW / VEC, PIECEV = PLANES * HWV, PER_T = (PIECEV + THREADS - 1) / THREADS;
constexpr uint32_t PLANE_BYTES = HW * sizeof(@XT@);
constexpr size_t PIECE_BYTES = (size_t)PLANES * PLANE_BYTES;
constexpr size_t SMEM = PIECE_BYTES + 64 + 2 * CL * 16;  // the next piece, 3 mbarriers, 2 x CL statistics
[[maybe_unused]] constexpr float NLOC = (float)PLANES * HW;
typedef @XT@ xt;
// plane n of channel c: outer-major (batch norm's NCHW) or channel-major (group norm's groups)
__device__ __forceinline__ size_t plane_at(int n, int c) { return @PLANE_AT@; }

template <class T, int N> struct __align__(sizeof(T) * N) Vec { T a[N]; };
__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
template <class T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
__device__ __forceinline__ float rnd_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }
__device__ __forceinline__ float rnd_f16(float v) { return __half2float(__float2half_rn(v)); }


__global__ void __launch_bounds__(THREADS, @MINB@) @NAME@(const xt* __restrict__ x, @PARAMS@int nclusters) {
  extern __shared__ __align__(128) unsigned char smem[];
  Vec<xt, VEC>* piece = reinterpret_cast<Vec<xt, VEC>*>(smem);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + PIECE_BYTES);  // [0] the piece, [1], [2] statistics
  float4* recv = reinterpret_cast<float4*>(smem + PIECE_BYTES + 64);  // [2][CL] every CTA's two statistics
  __shared__ float red[2][THREADS / 32];
  const int tid = threadIdx.x;
  const uint32_t rank = cluster_rank();
  const int cid = blockIdx.x / CL, n0 = rank * PLANES;
  if (tid == 0) {
    mbar_init(&bars[0], 1); mbar_init(&bars[1], 1); mbar_init(&bars[2], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_sync();  // every CTA's mbarriers exist before any peer pushes to them
  auto issue = [&](int c) {
    mbar_expect(&bars[0], (uint32_t)PIECE_BYTES);
    for (int p = 0; p < PLANES; ++p)
      bulk_copy(piece + p * HWV, x + plane_at(n0 + p, c) * HW, PLANE_BYTES, &bars[0]);
  };
  if (tid == 0) issue(cid);
  int it = 0;
  for (int c = cid; c < C; c += nclusters, ++it) {
    mbar_wait(&bars[0], it & 1);
    float v[PER_T][VEC];
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      const int idx = k * THREADS + tid;
      const Vec<xt, VEC> raw = idx < PIECEV ? piece[idx] : Vec<xt, VEC>{};
      #pragma unroll
      for (int e = 0; e < VEC; ++e) v[k][e] = to_f(raw.a[e]);
    }
    __syncthreads();  // the piece left shared memory: it may refill
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
@STATS@
@PARAM_LOADS@
    // the exchange: this CTA's two numbers into every peer's slot, bytes completing on the peer's mbarrier
    // (armed here for this block first; a push that lands before its owner armed only makes the count
    // negative, and the phase still needs the owner's own arrival)
    const int slot = it & 1;
    if (tid == 0) {
      mbar_expect(&bars[1 + slot], CL * 16);
      const uint32_t laddr = su32(&recv[slot * CL + rank]), lbar = su32(&bars[1 + slot]);
      for (int r = 0; r < CL; ++r) push(mapa(laddr, r), sa, sb, mapa(lbar, r));
      if (c + nclusters < C) issue(c + nclusters);
    }
    mbar_wait(&bars[1 + slot], (it >> 1) & 1);
    float as_[CL], bs_[CL];
    #pragma unroll
    for (int r = 0; r < CL; ++r) { const float4 got = recv[slot * CL + r]; as_[r] = got.x; bs_[r] = got.y; }
@COMBINE@
@ROW@
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      const int idx = k * THREADS + tid;
      if (idx < PIECEV) {
        const int p = idx / HWV, i = idx - p * HWV;
        const size_t off = plane_at(n0 + p, c) * HWV + i;
@PLANE_PARAMS@
@VEC_LOADS@
        #pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float xv = v[k][e];
@ELEMENT@
        }
@VEC_STORES@
      }
    }
  }
  cluster_sync();  // no CTA leaves while a peer may still push to it
}
}  // namespace @NAME@_ns

cudaError_t @NAME@_launch(const void* const* ptrs, int nclusters, cudaStream_t stream, int* fits) {
  using namespace @NAME@_ns;
  auto kernel = @NAME@;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM);
  if (err != cudaSuccess) return err;
  if (CL > 8) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = cluster_config(dim3((nclusters > 0 ? nclusters : 1) * CL), THREADS, SMEM, stream, CL, attr);
  if (fits) return cudaOccupancyMaxActiveClusters(fits, kernel, &cfg);
  return cudaLaunchKernelEx(&cfg, kernel, @CASTS@nclusters);
}
"""

GLUE = r"""
#include <torch/extension.h>
#include <cuda_runtime_api.h>
#include <vector>

@DECLS@

// variant < 0: how many clusters of variant ~variant fit at once; else launch it on nclusters clusters
int64_t run(std::vector<torch::Tensor> tensors, int64_t variant, int64_t nclusters, int64_t stream_handle) {
  std::vector<const void*> ptrs;
  for (auto& t : tensors) ptrs.push_back(t.data_ptr());
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  int fits = 0;
  const int v = variant < 0 ? (int)~variant : (int)variant;
  cudaError_t err = cudaErrorInvalidValue;
  switch (v) {
@CASES@
  }
  TORCH_CHECK(err == cudaSuccess, "cluster planes launch: ", cudaGetErrorString(err));
  err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "cluster planes kernel: ", cudaGetErrorString(err));
  return fits;
}
"""
