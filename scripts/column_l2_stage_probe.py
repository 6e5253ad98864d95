"""Device probe: the column patterns (65536x1024 fp32) in two passes with L2 holding the block between them, in CUDA
with the first pass's reads deep in flight.

Session 9's Triton version of this plan (scripts/column_l2_pipeline_probe.py) ran at 260 µs against 213 for the
generated register-held groups on an H100: L2 held the block, but one program per SM read in lockstep and DRAM
moved 2.1 TB/s. Here each CTA (one per SM, a fixed stretch of R rows) keeps S column blocks in flight as cp.async
copies into a ring of shared memory, and walks the blocks:

- pass 1 of block t: its piece (R rows x W columns) from the ring into registers, the next copies issued into the
  slots it leaves, the piece's column means (and centred sums of squares) stored as partials, one release arrival;
- pass 2 of block t - 1: an acquiring poll that the whole grid's pass 1 of that block satisfied one block ago, the
  partials combined (Chan), the block read again (from L2, `ld.global.cg`) and written out (`st.global.cs`).

No CTA waits on another within a block; the grid drifts by at most one block. MODE 0 skips the poll and the
partials (the access pattern alone, statistics wrong on purpose), 1 is column_center, 2 column_standardize. The
grid is launched cooperatively (every CTA at once, or the launch fails): the polls need it.

    PYTHONPATH=. python scripts/column_l2_stage_probe.py

Session 37, H200 (copy of the same bytes 126.8 µs): no gain. The access pattern alone ran 269-435 µs (34-47% of the
copy), column_center 311-524 and column_standardize 331-563, against 162 and 174 for the generated kernels
(BENCHMARKS.md).
"""
import statistics

from column_cuda_probe import COLUMN_HELPERS  # scripts/ is on the path when run as a script

CUDA = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cstdint>

constexpr int M = 65536, N = 1024, N4 = N / 4;

""" + COLUMN_HELPERS + r"""
template <int W, int G, int T, int S, int MODE>
__global__ void __launch_bounds__(T, G > 132 ? 2 : 1) staged(const float* __restrict__ x, float* __restrict__ y, float* part,
                                               unsigned int* cnt, unsigned int epoch) {
  constexpr int Q = W / 4, R = M / G, RPP = T / Q, PER_T = R / RPP, NB = N / W, NS = T / W;
  extern __shared__ float4 ring[];  // S x PER_T x T float4: each thread's own slots
  __shared__ __align__(16) float redA[T / 32 * W];
  __shared__ __align__(16) float redB[T / 32 * W];
  __shared__ __align__(16) float redC[T];
  __shared__ __align__(16) float stat[3][W];
  const int tid = threadIdx.x, q = tid % Q, r0 = tid / Q, g = blockIdx.x;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  float4* y4 = reinterpret_cast<float4*>(y);
  float* means = part;                       // [NB][G][W]
  float* squares = part + (size_t)NB * G * W;  // [NB][G][W]
  auto at = [&](int b, int j) { return (size_t)(g * R + r0 + j * RPP) * N4 + b * Q + q; };
  auto issue = [&](int b) {
    if (b < NB) {
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) cp_async16(&ring[((b % S) * PER_T + j) * T + tid], x4 + at(b, j));
    }
    asm volatile("cp.async.commit_group;" ::: "memory");  // empty groups too, so that wait_group counts blocks
  };
  #pragma unroll
  for (int b = 0; b < S; ++b) issue(b);
  for (int t = 0; t <= NB; ++t) {
    if (t < NB) {  // pass 1 of block t
      asm volatile("cp.async.wait_group %0;" :: "n"(S - 1) : "memory");
      float4 v[PER_T];
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) v[j] = ring[((t % S) * PER_T + j) * T + tid];
      issue(t + S);  // into the slots this thread has just read
      if (MODE != 0) {
        float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
        #pragma unroll
        for (int j = 0; j < PER_T; ++j) s = add4(s, v[j]);
        const float mloc = column_total<W, T>(s, redA) / R;
        if (tid < W) means[((size_t)t * G + g) * W + tid] = mloc;
        if (MODE == 2) {
          if (tid < W) stat[0][tid] = mloc;
          __syncthreads();
          const float4 m = reinterpret_cast<float4*>(stat[0])[q];
          float4 d2 = make_float4(0.f, 0.f, 0.f, 0.f);
          #pragma unroll
          for (int j = 0; j < PER_T; ++j) {
            const float a = v[j].x - m.x, b = v[j].y - m.y, c = v[j].z - m.z, d = v[j].w - m.w;
            d2 = add4(d2, make_float4(a * a, b * b, c * c, d * d));
          }
          const float qloc = column_total<W, T>(d2, redB);
          if (tid < W) squares[((size_t)t * G + g) * W + tid] = qloc;
        }
        __syncthreads();
        if (tid == 0) asm volatile("red.release.gpu.global.add.u32 [%0], 1;" :: "l"(cnt + t) : "memory");
      }
    }
    if (t >= 1) {  // pass 2 of block t - 1
      const int b = t - 1;
      float4 m = make_float4(0.f, 0.f, 0.f, 0.f), rs = make_float4(1.f, 1.f, 1.f, 1.f);
      if (MODE != 0) {
        if (tid == 0) {
          const unsigned int want = (epoch + 1) * G;
          unsigned int seen;
          do {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(cnt + b) : "memory");
          } while ((int)(seen - want) < 0);
        }
        __syncthreads();
        const int c = tid % W, set = tid / W;
        float sm = 0.f;
        #pragma unroll 4
        for (int k = set; k < G; k += NS) sm += __ldcg(means + ((size_t)b * G + k) * W + c);
        redC[tid] = sm;
        __syncthreads();
        if (tid < W) {
          float tm = 0.f;
          #pragma unroll
          for (int s2 = 0; s2 < NS; ++s2) tm += redC[s2 * W + tid];
          stat[1][tid] = tm / G;
        }
        __syncthreads();
        if (MODE == 2) {
          const float mean = stat[1][c];
          float sq = 0.f;
          #pragma unroll 4
          for (int k = set; k < G; k += NS) {
            const float d = __ldcg(means + ((size_t)b * G + k) * W + c) - mean;
            sq += __ldcg(squares + ((size_t)b * G + k) * W + c) + (float)R * d * d;
          }
          redC[tid] = sq;  // every thread read redC's sums before the barrier above
          __syncthreads();
          if (tid < W) {
            float tq = 0.f;
            #pragma unroll
            for (int s2 = 0; s2 < NS; ++s2) tq += redC[s2 * W + tid];
            stat[2][tid] = rsqrtf(tq / M + 1e-5f);
          }
          __syncthreads();
          rs = reinterpret_cast<float4*>(stat[2])[q];
        }
        m = reinterpret_cast<float4*>(stat[1])[q];
      }
      #pragma unroll
      for (int j = 0; j < PER_T; ++j) {
        const float4 xv = __ldcg(x4 + at(b, j));
        __stcs(y4 + at(b, j), make_float4((xv.x - m.x) * rs.x, (xv.y - m.y) * rs.y, (xv.z - m.z) * rs.z,
                                          (xv.w - m.w) * rs.w));
      }
      __syncthreads();  // stat and redC are rewritten by the next block
    }
  }
}

template <int W, int G, int T, int S, int MODE>
int64_t launch(torch::Tensor x, torch::Tensor y, torch::Tensor part, torch::Tensor cnt, int64_t epoch, int64_t stream) {
  constexpr int Q = W / 4, R = M / G, RPP = T / Q, PER_T = R / RPP;
  const size_t smem = (size_t)S * PER_T * T * sizeof(float4);
  auto kernel = staged<W, G, T, S, MODE>;
  TORCH_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) == cudaSuccess);
  int per_sm = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, T, smem);
  if (epoch < 0) return per_sm;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  float* pp = part.data_ptr<float>();
  unsigned int* cp = reinterpret_cast<unsigned int*>(cnt.data_ptr<int>());
  unsigned int ep = (unsigned int)epoch;
  void* args[] = {(void*)&xp, (void*)&yp, (void*)&pp, (void*)&cp, (void*)&ep};
  cudaError_t err = cudaLaunchCooperativeKernel((void*)kernel, dim3(G), dim3(T), args, smem,
                                                reinterpret_cast<cudaStream_t>(stream));
  TORCH_CHECK(err == cudaSuccess, "staged launch: ", cudaGetErrorString(err));
  return per_sm;
}

int64_t run(torch::Tensor x, torch::Tensor y, torch::Tensor part, torch::Tensor cnt, int64_t epoch, int64_t variant,
            int64_t mode, int64_t stream) {
  switch (variant * 3 + mode) {
@CASES@
  }
  TORCH_CHECK(false, "no such variant");
  return 0;
}
"""

# (W columns per block, G CTAs, T threads, S blocks in flight)
VARIANTS = [(32, 128, 256, 2), (32, 128, 256, 3), (32, 128, 512, 3), (32, 256, 256, 3), (16, 128, 256, 4)]


def source() -> str:
    cases = [f"    case {v * 3 + mode}: return launch<{w}, {g}, {t}, {s}, {mode}>(x, y, part, cnt, epoch, stream);"
             for v, (w, g, t, s) in enumerate(VARIANTS) for mode in range(3)]
    return CUDA.replace("@CASES@", "\n".join(cases))


def main():
    import torch
    from torch.utils.cpp_extension import load_inline

    from stitchflow.targets.gpu.timing import timed_median

    ext = load_inline(name="column_l2_stage_probe", cpp_sources=[
        "int64_t run(torch::Tensor x, torch::Tensor y, torch::Tensor part, torch::Tensor cnt, int64_t epoch, "
        "int64_t variant, int64_t mode, int64_t stream);"], cuda_sources=[source()], functions=["run"],
        extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"], verbose=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(65536, 1024, device="cuda", generator=gen) * 3 + 100
    y = torch.empty_like(x)
    part = torch.zeros(2 * 32 * 256 * 64, device="cuda")
    cnt = torch.zeros(64, dtype=torch.int32, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    refs = {1: x - x.mean(0), 2: (x - x.mean(0)) * torch.rsqrt(x.var(0, unbiased=False) + 1e-5)}
    copy_us = statistics.median(timed_median(lambda: y.copy_(x)) for _ in range(3)) * 1e6
    print(f"{torch.cuda.get_device_name()}: copy of the same bytes {copy_us:.1f} us "
          f"({2 * x.numel() * 4 / copy_us / 1e6:.2f} TB/s)", flush=True)
    for v, (w, g, t, s) in enumerate(VARIANTS):
        per_sm = ext.run(x, y, part, cnt, -1, v, 0, stream)
        if per_sm * torch.cuda.get_device_properties(0).multi_processor_count < g:
            print(f"W={w} G={g} T={t} S={s}: {per_sm} CTAs an SM cannot hold the grid", flush=True)
            continue
        for mode in range(3):
            cnt.zero_()
            epoch = [0]

            def call():
                ext.run(x, y, part, cnt, epoch[0], v, mode, stream)
                epoch[0] += 1
            y.zero_()
            call()
            torch.cuda.synchronize()
            err = (y - refs[mode]).abs().max().item() if mode else float("nan")
            us = [timed_median(call) * 1e6 for _ in range(3)]
            print(f"W={w} G={g} T={t} S={s} mode {mode}: {statistics.median(us):.1f} us "
                  f"({' / '.join(f'{u:.1f}' for u in us)}), {copy_us / statistics.median(us):.1%} of the copy, "
                  f"max error {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
