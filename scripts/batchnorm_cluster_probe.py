"""Device probe: what does batch norm's barrier cost when the 8 programs of a channel form a thread-block
cluster and exchange their statistics through distributed shared memory, with no global memory and no fence?

Hand-written CUDA (torch's load_inline, sm_90a) on the bench's 64x256x56x56 fp32 input, the same plan as the
generated Gluon kernel: a persistent grid of clusters of 8 CTAs walks the channels; CTA r of a cluster holds
images 8r..8r+7 of the channel (8 contiguous planes, copied by 1-D bulk copies into shared memory while the current
piece, in registers, waits), sums its piece, takes its centred sum of squares, exchanges both, then normalises and
stores from registers. MODE picks the exchange:

    0: none (each piece normalised by its own statistics: wrong on purpose, the access pattern alone)
    1: global memory and a counter, as the generated kernel does (partials stored, acq_rel arrival, the next piece's
       copies, acquiring polls, partials read back)
    2: distributed shared memory: each CTA pushes its two numbers to every peer with st.async, which completes
       bytes on the peer's mbarrier (armed by the peer for this block), so no release waits for stores in flight
    3: partials in global memory, the cluster's hardware barrier (arrive.release, then the copies, wait.acquire)
    4: partials stored into every peer's shared memory (st.shared::cluster), the cluster's barrier

    python scripts/batchnorm_cluster_probe.py

Not a test: prints one line per mode against the generated kernel and torch's copy."""
import torch
from triton.testing import do_bench

from stitchflow.targets.gpu.cuda_cluster import CLUSTER_CONFIG, PTX_HELPERS

CUDA = r"""
#include <cuda_runtime.h>
#include <cstdint>
""" + CLUSTER_CONFIG + r"""

constexpr int THREADS = 256, CL = 8, PLANES = 8, C = 256, HW = 3136, HW4 = HW / 4;
constexpr int PIECE4 = PLANES * HW4, PER_T = (PIECE4 + THREADS - 1) / THREADS;
constexpr size_t SMEM = PIECE4 * 16 + 64 + 2 * CL * 16;

""" + PTX_HELPERS + r"""

template <int MODE>
__global__ void __launch_bounds__(THREADS, 1) bn_kernel(const float* __restrict__ x, const float* __restrict__ w,
    const float* __restrict__ b, float* __restrict__ y, float* part, unsigned long long* cnt, long long epoch,
    int nclusters) {
  extern __shared__ __align__(128) unsigned char smem[];
  float4* piece = reinterpret_cast<float4*>(smem);
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + PIECE4 * 16);  // [0] piece, [1], [2] statistics
  float4* recv = reinterpret_cast<float4*>(smem + PIECE4 * 16 + 64);  // [2][CL]
  __shared__ float red[2][THREADS / 32];
  const int tid = threadIdx.x;
  const uint32_t rank = cluster_rank();
  const int cid = blockIdx.x / CL, n0 = rank * PLANES;
  if (tid == 0) {
    mbar_init(&bars[0], 1); mbar_init(&bars[1], 1); mbar_init(&bars[2], 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  cluster_sync();  // every CTA's barriers exist before any peer pushes to them
  auto issue = [&](int c) {
    mbar_expect(&bars[0], PIECE4 * 16);
    for (int p = 0; p < PLANES; ++p) bulk_copy(piece + p * HW4, x + ((size_t)(n0 + p) * C + c) * HW, HW * 4, &bars[0]);
  };
  if (tid == 0) issue(cid);
  int it = 0;
  for (int c = cid; c < C; c += nclusters, ++it) {
    mbar_wait(&bars[0], it & 1);
    float4 v[PER_T];
    float s = 0.f;
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      int idx = k * THREADS + tid;
      v[k] = idx < PIECE4 ? piece[idx] : make_float4(0.f, 0.f, 0.f, 0.f);
      s += (v[k].x + v[k].y) + (v[k].z + v[k].w);
    }
    __syncthreads();  // the piece left shared memory: it may refill
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const float nloc = PLANES * HW;
    const float mloc = block_sum<THREADS>(s, red[0]) / nloc;
    float q = 0.f;
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      if (k * THREADS + tid < PIECE4) {
        float a = v[k].x - mloc, bb = v[k].y - mloc, cc = v[k].z - mloc, d = v[k].w - mloc;
        q += (a * a + bb * bb) + (cc * cc + d * d);
      }
    }
    q = block_sum<THREADS>(q, red[1]);
    const bool more = c + nclusters < C;
    float mean = mloc, m2 = q * CL;
    if (MODE == 0) {
      if (tid == 0 && more) issue(c + nclusters);
    } else if (MODE == 1) {
      if (tid == 0) {
        part[(c * CL + rank) * 2] = mloc;
        part[(c * CL + rank) * 2 + 1] = q;
        unsigned long long old;
        asm volatile("atom.add.acq_rel.gpu.global.u64 %0, [%1], 1;" : "=l"(old) : "l"(cnt + c) : "memory");
        if (more) issue(c + nclusters);
        unsigned long long seen = old + 1, target = (unsigned long long)(epoch + 1) * CL;
        while (seen < target) asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(cnt + c) : "memory");
      }
      __syncthreads();
    } else if (MODE == 3) {  // partials in global memory, the cluster's hardware barrier (release, acquire)
      if (tid == 0) {
        part[(c * CL + rank) * 2] = mloc;
        part[(c * CL + rank) * 2 + 1] = q;
      }
      asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
      if (tid == 0 && more) issue(c + nclusters);
      asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else if (MODE == 4) {  // partials stored into every peer's shared memory, the cluster's barrier
      const int slot = it & 1;
      if (tid < CL) {
        const uint32_t raddr = mapa(su32(&recv[slot * CL + rank]), tid);
        asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" :: "r"(raddr), "f"(mloc), "f"(q) : "memory");
      }
      asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
      if (tid == 0 && more) issue(c + nclusters);
      asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    } else {
      const int slot = it & 1;
      if (tid == 0) {
        mbar_expect(&bars[1 + slot], CL * 16);
        const uint32_t laddr = su32(&recv[slot * CL + rank]), lbar = su32(&bars[1 + slot]);
        for (int r = 0; r < CL; ++r) push(mapa(laddr, r), mloc, q, mapa(lbar, r));
        if (more) issue(c + nclusters);
      }
      mbar_wait(&bars[1 + slot], (it >> 1) & 1);
    }
    if (MODE != 0) {
      float ms[CL], qs[CL], sum_m = 0.f;
      #pragma unroll
      for (int r = 0; r < CL; ++r) {
        if (MODE == 1 || MODE == 3) {
          ms[r] = __ldcg(part + (c * CL + r) * 2);
          qs[r] = __ldcg(part + (c * CL + r) * 2 + 1);
        }
        else { float4 got = recv[(it & 1) * CL + r]; ms[r] = got.x; qs[r] = got.y; }
        sum_m += ms[r];
      }
      mean = sum_m / CL;
      m2 = 0.f;
      #pragma unroll
      for (int r = 0; r < CL; ++r) m2 += qs[r] + nloc * (ms[r] - mean) * (ms[r] - mean);
    }
    const float rstd = rsqrtf(m2 / (CL * nloc) + 1e-5f), wc = w[c] * rstd, bc = b[c] - mean * wc;
    float4* y4 = reinterpret_cast<float4*>(y);
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      int idx = k * THREADS + tid;
      if (idx < PIECE4) {
        int p = idx / HW4, i = idx - p * HW4;
        y4[((size_t)(n0 + p) * C + c) * HW4 + i] =
            make_float4(v[k].x * wc + bc, v[k].y * wc + bc, v[k].z * wc + bc, v[k].w * wc + bc);
      }
    }
  }
  cluster_sync();  // no CTA leaves while a peer may still push to it
}

template <int MODE>
cudaError_t launch(const float* x, const float* w, const float* b, float* y, float* part, unsigned long long* cnt,
                   long long epoch, int nclusters, cudaStream_t stream) {
  auto kernel = bn_kernel<MODE>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)SMEM);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attr[1];
  cudaLaunchConfig_t cfg = cluster_config(dim3((nclusters > 0 ? nclusters : 1) * CL), THREADS, SMEM, stream, CL, attr);
  if (nclusters <= 0) {  // ask how many clusters of CL fit at once
    int n = 0;
    err = cudaOccupancyMaxActiveClusters(&n, kernel, &cfg);
    return err != cudaSuccess ? err : (cudaError_t)(-n);
  }
  return cudaLaunchKernelEx(&cfg, kernel, x, w, b, y, part, cnt, epoch, nclusters);
}
"""

GLUE = r"""
template <int MODE> cudaError_t launch(const float*, const float*, const float*, float*, float*, unsigned long long*,
                                       long long, int, cudaStream_t);

int64_t bn(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor part, torch::Tensor cnt,
           int64_t epoch, int64_t mode, int64_t nclusters, int64_t stream_handle) {
  auto stream = reinterpret_cast<cudaStream_t>(stream_handle);
  auto args = std::make_tuple(x.data_ptr<float>(), w.data_ptr<float>(), b.data_ptr<float>(), y.data_ptr<float>(),
                              part.data_ptr<float>(), reinterpret_cast<unsigned long long*>(cnt.data_ptr<int64_t>()));
  cudaError_t err = mode == 0 ? launch<0>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                                          std::get<4>(args), std::get<5>(args), epoch, (int)nclusters, stream)
                  : mode == 1 ? launch<1>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                                          std::get<4>(args), std::get<5>(args), epoch, (int)nclusters, stream)
                  : mode == 2 ? launch<2>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                                          std::get<4>(args), std::get<5>(args), epoch, (int)nclusters, stream)
                  : mode == 3 ? launch<3>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                                          std::get<4>(args), std::get<5>(args), epoch, (int)nclusters, stream)
                              : launch<4>(std::get<0>(args), std::get<1>(args), std::get<2>(args), std::get<3>(args),
                                          std::get<4>(args), std::get<5>(args), epoch, (int)nclusters, stream);
  if ((int)err < 0) return -(int64_t)(int)err;  // the occupancy query's answer
  TORCH_CHECK(err == cudaSuccess, "bn launch: ", cudaGetErrorString(err));
  return 0;
}
"""


def main():
    from torch.utils.cpp_extension import load_inline

    ext = load_inline(name="bn_cluster_probe", cpp_sources=[
        "int64_t bn(torch::Tensor x, torch::Tensor w, torch::Tensor b, torch::Tensor y, torch::Tensor part, "
        "torch::Tensor cnt, int64_t epoch, int64_t mode, int64_t nclusters, int64_t stream_handle);"],
        cuda_sources=[CUDA + GLUE], functions=["bn"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"], verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, 56, 56, device="cuda", generator=gen)
    w, b = torch.randn(256, device="cuda", generator=gen), torch.randn(256, device="cuda", generator=gen)
    y = torch.empty_like(x)
    part = torch.empty(256 * 8 * 2, device="cuda")
    cnt = torch.zeros(256, dtype=torch.int64, device="cuda")
    ref = torch.nn.functional.batch_norm(x, None, None, w, b, training=True, eps=1e-5)
    stream = torch.cuda.current_stream().cuda_stream
    copy = do_bench(lambda: y.copy_(x), warmup=5, rep=50, return_mode="median") * 1e-3
    print(f"torch copy {copy * 1e6:.1f} us", flush=True)
    fits = ext.bn(x, w, b, y, part, cnt, 0, 0, 0, stream)
    print(f"clusters of 8 resident at once: {fits}", flush=True)
    epoch = [0]
    for ncl in sorted({min(16, fits), min(fits, 12)}):
        for mode in (0, 1, 2, 3, 4):
            cnt.zero_()  # the counters of mode 1: each launch adds 8 per channel
            epoch[0] = 0

            def run():
                ext.bn(x, w, b, y, part, cnt, epoch[0], mode, ncl, stream)
                epoch[0] += 1
            run()
            torch.cuda.synchronize()
            err = (y - ref).abs().max().item()
            t = do_bench(run, warmup=5, rep=100, return_mode="median") * 1e-3
            print(f"{ncl} clusters, mode {mode}: {t * 1e6:.1f} us, {copy / t:.0%} of copy, max error {err:.1e}",
                  flush=True)


if __name__ == "__main__":
    main()
