"""A chain kernel on Hopper thread-block clusters: the intermediate spread over a cluster's SMs.

E = act(A·B + b1)·D + b2, bf16 in and out, fp32 accumulation. One cluster of C CTAs owns a
64-row tile of A. CTA r computes the intermediate slice h_r = act(A[tile]·B[:, N_r] + b1[N_r])
for its N/C columns, 64 at a time, in shared memory, and multiplies each chunk straight into
its partial output P_r = h_r·D[N_r, :] (64×L, fp32, in registers). The cluster then
reduce-scatters the partials through distributed shared memory: after `cluster.sync()` each CTA
reads its 1/C share of every peer's P through `cluster.map_shared_rank`, adds them, applies the
bias and writes E. So the whole 64×N intermediate lives on chip, spread over C SMs, and the only
traffic between SMs is the 64×L partial (C-1)/C times per CTA, over the SM-to-SM network rather
than HBM; without the cluster, a split over N needs an fp32 round trip through global memory.

Limits (checked by `supports`): bf16, row-major contiguous A (M×K), B (K×N), D (N×L);
K % 32 == 0, N % (64·C) == 0, L in {64, 128, 256}; C in {2, 4, 8, 16} (16 needs the
non-portable cluster attribute). Compiled once per process with torch's load_inline for sm_90a.
"""

from __future__ import annotations

import functools

import torch

from .cuda_cluster import CLUSTER_CONFIG

CLUSTER_SIZES = (2, 4, 8, 16)
L_SIZES = (64, 128, 256)
ACT_CODES = {"none": 0, "relu": 1, "gelu": 2, "silu": 3}

CUDA_SOURCE = r"""
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <cuda_runtime.h>
""" + CLUSTER_CONFIG + r"""

namespace cg = cooperative_groups;
using namespace nvcuda;

constexpr int BM = 64, NC = 64, BK = 32, THREADS = 256;
constexpr int LDH = NC + 8;        // bf16 ldm must be a multiple of 8; the pad spreads banks
constexpr int LDF = NC + 4;        // fp32 ldm must be a multiple of 4

__device__ __forceinline__ float activate(float x, int act) {
  if (act == 1) return fmaxf(x, 0.f);
  if (act == 2) return 0.5f * x * (1.f + erff(x * 0.70710678118654752f));
  if (act == 3) return x / (1.f + __expf(-x));
  return x;
}

template <int L>
constexpr size_t smem_bytes() {
  size_t loop = (BM * BK + BK * NC) * 2 + BM * LDF * 4 + BM * LDH * 2 + NC * (L + 8) * 2;
  size_t part = (size_t)BM * L * 4;   // the partial output aliases the loop buffers afterwards
  return loop > part ? loop : part;
}

template <int L, int C>
__global__ void __launch_bounds__(THREADS, 1)
dsm_chain_kernel(const __nv_bfloat16* __restrict__ A, const __nv_bfloat16* __restrict__ B,
                 const __nv_bfloat16* __restrict__ D, const __nv_bfloat16* __restrict__ b1,
                 const __nv_bfloat16* __restrict__ b2, __nv_bfloat16* __restrict__ E,
                 int M, int N, int K, int act) {
  extern __shared__ __align__(128) unsigned char smem[];
  __nv_bfloat16* As = reinterpret_cast<__nv_bfloat16*>(smem);
  __nv_bfloat16* Bs = As + BM * BK;
  float* Hf = reinterpret_cast<float*>(Bs + BK * NC);
  __nv_bfloat16* Hs = reinterpret_cast<__nv_bfloat16*>(Hf + BM * LDF);
  __nv_bfloat16* Ds = Hs + BM * LDH;
  float* P = reinterpret_cast<float*>(smem);

  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();
  const int tid = threadIdx.x, warp = tid / 32;
  const int m0 = blockIdx.y * BM;
  const int slice = N / C;
  const int n_begin = rank * slice;

  // GEMM2 accumulators: warp owns row fragment warp%4 and every other 16-column fragment of L.
  constexpr int FR = L / 32;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc2[FR];
  for (int j = 0; j < FR; ++j) wmma::fill_fragment(acc2[j], 0.f);
  const int r2 = warp % 4, c2 = warp / 4;
  // GEMM1: warp owns row fragment warp/2 and column fragments 2*(warp%2) + {0,1} of the chunk.
  const int r1 = warp / 2, c1 = (warp % 2) * 2;

  for (int n0 = n_begin; n0 < n_begin + slice; n0 += NC) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc1[2];
    wmma::fill_fragment(acc1[0], 0.f);
    wmma::fill_fragment(acc1[1], 0.f);
    for (int k0 = 0; k0 < K; k0 += BK) {
      {  // A tile 64x32: one 16-byte vector per thread, rows past M read as zero
        int row = tid / 4, col = (tid % 4) * 8;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (m0 + row < M) v = *reinterpret_cast<const uint4*>(A + (size_t)(m0 + row) * K + k0 + col);
        *reinterpret_cast<uint4*>(As + row * BK + col) = v;
      }
      {  // B tile 32x64
        int row = tid / 8, col = (tid % 8) * 8;
        *reinterpret_cast<uint4*>(Bs + row * NC + col) =
            *reinterpret_cast<const uint4*>(B + (size_t)(k0 + row) * N + n0 + col);
      }
      __syncthreads();
      for (int kk = 0; kk < BK; kk += 16) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa;
        wmma::load_matrix_sync(fa, As + r1 * 16 * BK + kk, BK);
        for (int j = 0; j < 2; ++j) {
          wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb;
          wmma::load_matrix_sync(fb, Bs + kk * NC + (c1 + j) * 16, NC);
          wmma::mma_sync(acc1[j], fa, fb, acc1[j]);
        }
      }
      __syncthreads();
    }
    for (int j = 0; j < 2; ++j)
      wmma::store_matrix_sync(Hf + r1 * 16 * LDF + (c1 + j) * 16, acc1[j], LDF, wmma::mem_row_major);
    for (int i = tid; i < NC * L / 8; i += THREADS) {  // D chunk 64xL, 16-byte vectors
      int row = i / (L / 8), col = (i % (L / 8)) * 8;
      *reinterpret_cast<uint4*>(Ds + row * (L + 8) + col) =
          *reinterpret_cast<const uint4*>(D + (size_t)(n0 + row) * L + col);
    }
    __syncthreads();
    for (int i = tid; i < BM * NC; i += THREADS) {  // bias + activation, rounded to bf16 as eager stores h
      int row = i / NC, col = i % NC;
      float h = Hf[row * LDF + col];
      if (b1) h += __bfloat162float(b1[n0 + col]);
      Hs[row * LDH + col] = __float2bfloat16(activate(h, act));
    }
    __syncthreads();
    for (int kk = 0; kk < NC; kk += 16) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fh;
      wmma::load_matrix_sync(fh, Hs + r2 * 16 * LDH + kk, LDH);
      for (int j = 0; j < FR; ++j) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fd;
        wmma::load_matrix_sync(fd, Ds + kk * (L + 8) + (2 * j + c2) * 16, L + 8);
        wmma::mma_sync(acc2[j], fh, fd, acc2[j]);
      }
    }
    __syncthreads();
  }
  for (int j = 0; j < FR; ++j)
    wmma::store_matrix_sync(P + r2 * 16 * L + (2 * j + c2) * 16, acc2[j], L, wmma::mem_row_major);
  cluster.sync();  // every partial is complete and visible to the cluster

  // Reduce-scatter over DSM: this CTA finishes elements rank*THREADS + tid, stepping C*THREADS.
  float* peers[C];
  for (int q = 0; q < C; ++q) peers[q] = cluster.map_shared_rank(P, q);
  for (int e = rank * THREADS + tid; e < BM * L; e += C * THREADS) {
    int row = e / L, col = e % L;
    float s = 0.f;
    for (int q = 0; q < C; ++q) s += peers[q][e];
    if (b2) s += __bfloat162float(b2[col]);
    if (m0 + row < M) E[(size_t)(m0 + row) * L + col] = __float2bfloat16(s);
  }
  cluster.sync();  // no CTA may leave while a peer still reads its shared memory
}

template <int L, int C>
cudaError_t launch_chain(const void* A, const void* B, const void* D, const void* b1, const void* b2, void* E,
                         int M, int N, int K, int act, cudaStream_t stream) {
  auto kernel = dsm_chain_kernel<L, C>;
  size_t smem = smem_bytes<L>();
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
  if (err != cudaSuccess) return err;
  if (C > 8) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = cluster_config(dim3(C, (M + BM - 1) / BM, 1), THREADS, smem, stream, C, attr);
  return cudaLaunchKernelEx(&cfg, kernel, (const __nv_bfloat16*)A, (const __nv_bfloat16*)B,
                            (const __nv_bfloat16*)D, (const __nv_bfloat16*)b1, (const __nv_bfloat16*)b2,
                            (__nv_bfloat16*)E, M, N, K, act);
}

#define DISPATCH_C(LV)                                                                        \
  switch (C) {                                                                                \
    case 2: return launch_chain<LV, 2>(A, B, D, b1, b2, E, M, N, K, act, stream);            \
    case 4: return launch_chain<LV, 4>(A, B, D, b1, b2, E, M, N, K, act, stream);            \
    case 8: return launch_chain<LV, 8>(A, B, D, b1, b2, E, M, N, K, act, stream);            \
    case 16: return launch_chain<LV, 16>(A, B, D, b1, b2, E, M, N, K, act, stream);          \
  }

cudaError_t dispatch(const void* A, const void* B, const void* D, const void* b1, const void* b2, void* E,
                     int M, int N, int K, int L, int C, int act, cudaStream_t stream) {
  if (L == 64) { DISPATCH_C(64) }
  if (L == 128) { DISPATCH_C(128) }
  if (L == 256) { DISPATCH_C(256) }
  return cudaErrorInvalidValue;
}
"""

TORCH_GLUE = r"""
cudaError_t dispatch(const void*, const void*, const void*, const void*, const void*, void*,
                     int, int, int, int, int, int, cudaStream_t);

void dsm_chain(torch::Tensor A, torch::Tensor B, torch::Tensor D, c10::optional<torch::Tensor> b1,
               c10::optional<torch::Tensor> b2, torch::Tensor E, int64_t cluster, int64_t act, int64_t stream_handle) {
  const void* p1 = b1.has_value() ? b1->data_ptr() : nullptr;
  const void* p2 = b2.has_value() ? b2->data_ptr() : nullptr;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);  // torch's current stream
  cudaError_t err = dispatch(A.data_ptr(), B.data_ptr(), D.data_ptr(), p1, p2, E.data_ptr(), (int)A.size(0),
                             (int)B.size(1), (int)A.size(1), (int)D.size(1), (int)cluster, (int)act, stream);
  TORCH_CHECK(err == cudaSuccess, "dsm_chain launch: ", cudaGetErrorString(err));
  err = cudaGetLastError();
  TORCH_CHECK(err == cudaSuccess, "dsm_chain kernel: ", cudaGetErrorString(err));
}
"""

CPP_DECL = ("void dsm_chain(torch::Tensor A, torch::Tensor B, torch::Tensor D, c10::optional<torch::Tensor> b1, "
            "c10::optional<torch::Tensor> b2, torch::Tensor E, int64_t cluster, int64_t act, int64_t stream_handle);")


def supports(M: int, N: int, K: int, L: int, cluster: int, act: str, dtype: torch.dtype, gated: bool = False) -> bool:
    return (dtype == torch.bfloat16 and not gated and act in ACT_CODES and cluster in CLUSTER_SIZES
            and L in L_SIZES and K % 32 == 0 and N % (64 * cluster) == 0 and M > 0)


@functools.lru_cache(maxsize=1)
def load_extension():
    """Build the kernels for sm_90a with nvcc through torch's load_inline (once per process)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        name="stitchflow_cluster_dsm", cpp_sources=[CPP_DECL], cuda_sources=[CUDA_SOURCE + TORCH_GLUE],
        functions=["dsm_chain"], extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"],
        verbose=False)


def dsm_chain(a, b, d, *, act: str = "none", bias1=None, bias2=None, cluster: int = 4):
    """E = act(A·B + bias1)·D + bias2 on a cluster of `cluster` CTAs per 64-row tile."""
    M, K = a.shape
    N, L = d.shape
    if not supports(M, N, K, L, cluster, act, a.dtype):
        raise ValueError(f"cluster kernel does not take M={M} N={N} K={K} L={L} C={cluster} act={act} {a.dtype}")
    out = torch.empty((M, L), dtype=a.dtype, device=a.device)
    load_extension().dsm_chain(a.contiguous(), b.contiguous(), d.contiguous(), bias1, bias2, out, cluster,
                               ACT_CODES[act], torch.cuda.current_stream(a.device).cuda_stream)
    return out
