"""CUDA text shared by the thread-block cluster kernels (cluster_planes, cluster_dsm, and the probes under scripts/):
PTX wrappers for mbarriers, bulk copies and distributed shared memory, and the launch configuration of a grid of
clusters."""

# device helpers: mbarrier phases, 1-D bulk copies completing on an mbarrier, peers' shared memory (mapa, st.async)
PTX_HELPERS = r"""
__device__ __forceinline__ uint32_t su32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(su32(bar)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_expect(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" :: "r"(su32(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile("{\n.reg .pred P1;\nLAB_WAIT:\n"
               "mbarrier.try_wait.parity.shared::cta.b64 P1, [%0], %1;\n"
               "@P1 bra DONE;\nbra LAB_WAIT;\nDONE:\n}\n" :: "r"(su32(bar)), "r"(parity) : "memory");
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               :: "r"(su32(dst)), "l"(src), "r"(bytes), "r"(su32(bar)) : "memory");
}
__device__ __forceinline__ uint32_t mapa(uint32_t addr, uint32_t rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
// 16 bytes into a peer's shared memory, completing them on the peer's mbarrier
__device__ __forceinline__ void push(uint32_t raddr, float a, float b, uint32_t rbar) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               :: "r"(raddr), "f"(a), "f"(b), "f"(0.f), "f"(0.f), "r"(rbar) : "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <int THREADS>
__device__ __forceinline__ float block_sum(float s, float* red) {
  for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
  __syncthreads();
  float t = 0.f;
  #pragma unroll
  for (int k = 0; k < THREADS / 32; ++k) t += red[k];
  return t;
}
// the larger of two floats, a NaN kept (fmaxf drops it, torch's max keeps it)
__device__ __forceinline__ float nanmax(float a, float b) { return (a != a || b != b) ? a + b : fmaxf(a, b); }
template <int THREADS>
__device__ __forceinline__ float block_max(float m, float* red) {
  for (int o = 16; o; o >>= 1) m = nanmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
  __syncthreads();
  float t = -INFINITY;
  #pragma unroll
  for (int k = 0; k < THREADS / 32; ++k) t = nanmax(t, red[k]);
  return t;
}
"""

# a grid of `grid` CTAs of `threads` in clusters of `cluster` along x (above 8 the kernel needs
# cudaFuncAttributeNonPortableClusterSizeAllowed, which the caller sets); `attr` must outlive the launch
CLUSTER_CONFIG = r"""
inline cudaLaunchConfig_t cluster_config(dim3 grid, int threads, size_t smem, cudaStream_t stream, int cluster,
                                         cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads, 1, 1);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = cluster;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}
"""
