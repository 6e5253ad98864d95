"""Dataflow analysis and an analytical cost model for compute chains E = act(A·B)·D (FlashFuser).

A candidate plan fixes a loop schedule for the four loops of the chain, m (rows of A), n (the
intermediate's columns), k (GEMM1's reduction) and l (E's columns): each loop is spatial (split
over programs) or temporal (a loop inside one program); it fixes the tiles, and the memory level
of each tensor: registers, shared memory (smem), distributed shared memory in a cluster (dsm)
or global memory (hbm, through L2). From these the analyzer counts the bytes that cross each
level and the FLOPs (recomputation included); the cost is the largest volume/bandwidth over the
levels (a minimax: the busiest level binds), stretched by wave quantization and by how many SMs
the plan can keep busy, plus launch overheads. Capacity limits (shared memory, registers per
thread) prune plans; legality prunes the rest: k may not be split across programs before the
activation (act needs whole sums), so k is always temporal and innermost in GEMM1.

Plan kinds:
- fused: one Triton kernel (chain_kernels.chain); h in registers, chunk by chunk over n.
  Spatial: m, l (each l tile recomputes GEMM1), optionally n (split_n: fp32 partials in hbm).
- two_pass: GEMM1 + epilogue writes h to hbm (L2-resident when small), GEMM2 reads it, split over
  its reduction (n) when the output has too few tiles to fill the chip (decode-sized M).
- cluster: the CUDA kernel of cluster_dsm.py; n spatial over the C CTAs of a cluster, partials
  reduced through dsm.
- cublas_epi: cuBLAS GEMM1 (cuDNN for a conv), one Triton pass for bias, activation and gate,
  cuBLAS GEMM2 (the structure torch.compile generates; one pass fewer than eager when gated).
- cublas_pro: cuBLAS GEMM1 (bias in its epilogue; cuDNN for a conv), then our Triton GEMM2 that
  applies the activation to h as it loads it (no pass of its own; worth it when L is one or two
  tiles, since every column tile of E re-applies it). Not for gated chains.
- cublas_lt: cuBLASLt GEMM1 with bias and activation in its own epilogue (ReLU, or GELU in its tanh form,
  the two it has; torch._addmm_activation), cuBLAS GEMM2: no pass over h at all. Not for gated chains or
  convolutions.
- library: cuBLAS GEMMs and separate elementwise passes (what eager does), for reference.
- wgmma: the Gluon Hopper kernel of chain_wgmma.py; weights resident in (or streamed through)
  shared memory, h in registers.

This module prices one plan; chain_plans.py enumerates the plans of each kind and ranks them.

A conv chain (shape.conv_in > 0) runs the matrix plans on im2col(x), built inside each call at
the measured gather rate; the cublas_* plans run GEMM1 as cuDNN's convolution instead.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from . import cluster_dsm
from .chain_kernels import ChainTiles, GemmTiles
from .chain_resident import ResidentTiles, resident_refusal
from .chain_wgmma import WgmmaTiles, is_resident, shape_refusal
from .stream_gemm import StreamTiles
from .stream_gemm import shape_refusal as stream_shape_refusal
from .stream_gemm import smem_bytes as stream_smem_bytes


@dataclass(frozen=True)
class DeviceProfile:
    """Measured numbers where we have them (workloads.md, KINDS.md); the rest are leads."""

    name: str
    sms: int = 132
    smem_per_block: int = 227 * 1024
    smem_per_sm: int = 228 * 1024
    regs_per_sm: int = 65536
    hbm_bw: float = 3.0e12          # device-to-device copy, read + write (H100: 3.0, H200: 4.3 TB/s)
    l2_bw: float = 9.0e12           # lead: about 3x HBM
    l2_bytes: float = 50e6
    smem_bw: float = 33e12          # 128 B/clock/SM at ~1.98 GHz over 132 SMs
    mma_flops: float = 750e12       # bf16 dense GEMM measured (690-800 TFLOP/s)
    dsm_bw: float = 3.5e12          # aggregate, measured 2.6-4.7 TB/s
    dsm_latency: float = 200 / 1.75e9
    launch: float = 2.5e-6          # per kernel launch in a stream of launches
    mem_latency: float = 0.9e-6     # one SM sustains stages x tile bytes per latency
    iter_cost: float = 80e-9        # fixed cost of one pipelined loop iteration (barriers, address math)
    alu_rate: float = 132 * 128 * 1.98e9   # fp32 lane-instructions per second (FMA pipe, all SMs)
    step_latency: float = 1.5e-6    # exposed latency of one serial chunk step of a fused program (fitted, H200)
    # Calibration probes (bench/chains.py measures them with the ceilings; these defaults are the
    # H200 numbers of round one): our Triton GEMM's rate over cuBLAS's on a large square GEMM; the
    # weight-streaming bandwidth of a 16-row GEMM (Triton, cuBLAS) over the copy rate; the im2col
    # copy's rate in bytes written per second.
    triton_mma_eff: float = 0.82
    triton_stream_eff: float = 0.55
    library_stream_eff: float = 0.75
    gluon_stream_eff: float = 0.86   # stream_gemm (H100, clean L2; Triton and cuBLAS measured 0.91 there)
    gather_bw: float = 0.6e12


# FMA-pipe instructions per element of each activation, fitted from the H200 sweep
# (bench/chains_sweep.py): a fused chain ran 12 µs longer with the polynomial GELU than with none
# on 16.7M elements, 22 µs longer with libdevice's erf. The tensor cores and this ALU work did
# not overlap in any measured configuration, so the model adds them.
ACT_INSTR = {"none": 0, "relu": 1, "gelu": 24, "gelu_libdevice": 43, "gelu_tanh": 22, "silu": 22, "sigmoid": 20}


def cluster_usable_sms(profile: DeviceProfile, size: int) -> int:
    """Clusters must fit inside a GPC: clusters of 16 with large smem leave 20 of 132 SMs idle."""
    if size >= 16:
        return profile.sms - 20
    if size >= 8:
        return profile.sms - profile.sms % 8
    return profile.sms


def profile_for(name: str, copy_bw: float | None = None, gemm_flops: float | None = None,
                probes: dict | None = None) -> DeviceProfile:
    """The device's profile; copy_bw, gemm_flops and `probes` (DeviceProfile field -> value, see
    the calibration fields) are measured on the device by the bench."""
    base = DeviceProfile(name, hbm_bw=4.3e12 if "H200" in name else 3.0e12,
                         l2_bytes=60e6 if "H200" in name else 50e6)
    changes = {}
    if copy_bw:
        changes.update(hbm_bw=copy_bw, l2_bw=3 * copy_bw)
    if gemm_flops:
        changes["mma_flops"] = gemm_flops
    known = {f.name for f in dataclasses.fields(DeviceProfile)}
    changes.update({k: v for k, v in (probes or {}).items() if k in known and v})
    return DeviceProfile(**{**base.__dict__, **changes})


@dataclass(frozen=True)
class ChainShape:
    M: int
    K: int
    N: int
    L: int
    elt: int = 2                    # bytes per element of A, B, D, E
    gated: bool = False
    act: str = "gelu"
    conv_in: int = 0                # > 0: A is im2col of a conv input with this many elements

    @property
    def weight_bytes(self) -> int:
        return (self.K * self.N * (2 if self.gated else 1) + self.N * self.L) * self.elt

    @property
    def io_bytes(self) -> int:
        """The floor's bytes: every input read once, the output written once."""
        return self.weight_bytes + (self.M * self.K + self.M * self.L) * self.elt

    @property
    def flops(self) -> int:
        return 2 * self.M * self.N * (self.K * (2 if self.gated else 1) + self.L)


@dataclass(frozen=True)
class Estimate:
    seconds: float
    volumes: tuple[tuple[str, float], ...]   # level -> bytes
    times: tuple[tuple[str, float], ...]     # level (and compute) -> seconds
    programs: int
    waves: int

    @property
    def bound(self) -> str:
        return max(self.times, key=lambda kv: kv[1])[0]


@dataclass(frozen=True)
class Plan:
    kind: str
    schedule: str                             # e.g. "m:S l:T n:T k:T"
    levels: tuple[tuple[str, str], ...]       # tensor -> memory level
    chain: ChainTiles | None = None
    resident: ResidentTiles | None = None
    wgmma: WgmmaTiles | None = None
    gemm1: GemmTiles | None = None
    gemm2: GemmTiles | None = None
    streams: tuple[StreamTiles, StreamTiles] | None = None   # the stream plan's GEMM1 and GEMM2
    cluster: int = 0
    estimate: Estimate | None = field(default=None, compare=False)

    def __str__(self) -> str:
        if self.kind == "fused":
            t = self.chain
            tiles = f"bm{t.bm} bn{t.bn} bk{t.bk} bl{t.bl} split{t.split_n} w{t.num_warps} s{t.num_stages}"
        elif self.kind == "resident":
            t = self.resident
            tiles = (f"bm{t.bm} bn{t.bn} w{t.num_warps} s{t.num_stages} x{t.programs_per_sm}/SM"
                     f"{' transposed' if t.transposed else ''}{' w-regs' if t.weights_in_registers else ''}")
        elif self.kind == "wgmma":
            tiles = str(self.wgmma).removeprefix("wgmma ")
        elif self.kind == "two_pass":
            g1, g2 = self.gemm1, self.gemm2
            tiles = (f"g1[{g1.bm}x{g1.bn}x{g1.bk} w{g1.num_warps} s{g1.num_stages}] "
                     f"g2[{g2.bm}x{g2.bn}x{g2.bk} splitk{g2.split_k} w{g2.num_warps} s{g2.num_stages}]")
        elif self.kind == "stream":
            tiles = f"g1[{self.streams[0]}] g2[{self.streams[1]}]".replace("stream ", "")
        elif self.kind == "cluster":
            tiles = f"cluster{self.cluster} bm64 bn64"
        elif self.kind == "cublas_pro":
            g2 = self.gemm2
            tiles = f"cuBLAS + g2[{g2.bm}x{g2.bn}x{g2.bk} w{g2.num_warps} s{g2.num_stages}, act on load]"
        elif self.kind == "cublas_epi":
            tiles = "cuBLAS + one act pass + cuBLAS"
        elif self.kind == "cublas_lt":
            tiles = "cuBLASLt with the act in its epilogue + cuBLAS"
        else:
            tiles = "cuBLAS"
        est = f" ~{self.estimate.seconds * 1e6:.1f}us ({self.estimate.bound})" if self.estimate else ""
        return f"{self.kind} {tiles} [{self.schedule}]{est}"


# ---------------------------------------------------------------- the kernel-level model

def _kernel_time(profile: DeviceProfile, flops: float, rate: float, volumes: dict, programs: int,
                 per_sm: int, bytes_in_flight: float, iterations: float, usable_sms: int | None = None) -> Estimate:
    """`iterations`: loop iterations per program; their fixed cost overlaps across the programs
    sharing an SM (up to two), which makes tiny tiles lose their false ties with large ones."""
    """max over levels of volume / bandwidth, with bandwidths scaled to the SMs kept busy."""
    sms = usable_sms or profile.sms
    slots = max(1, sms * per_sm)
    waves = math.ceil(programs / slots)
    busy = min(sms, programs) if waves == 1 else sms * programs / (waves * slots)
    share = busy / profile.sms
    pull = busy * min(per_sm, 4, max(1, programs // max(1, busy))) * bytes_in_flight / profile.mem_latency
    bws = {"hbm": min(profile.hbm_bw * profile.triton_stream_eff, pull), "l2": profile.l2_bw * share, "smem": profile.smem_bw * share,
           "dsm": profile.dsm_bw * share}
    times = {lvl: vol / bws[lvl] for lvl, vol in volumes.items() if vol}
    times["compute"] = flops / (rate * share)
    times["issue"] = iterations * programs * profile.iter_cost / (busy * min(per_sm, 2))
    seconds = max(times.values()) + profile.launch
    return Estimate(seconds, tuple(volumes.items()), tuple(times.items()), programs, waves)


def _mma_rate(profile: DeviceProfile, bm: int, warps: int, elt: int, acc_elements: int = 0) -> float:
    """wgmma needs 64-row warpgroup tiles; smaller tiles fall back to mma.sync (~60%); fp32 runs as
    tf32. More than 64 fp32 accumulators per thread cost a quarter (measured on the H200: a
    2048×4096×16384 GEMM ran 1.26x slower with 128×128 tiles on 4 warps than on 8)."""
    rate = profile.mma_flops * profile.triton_mma_eff * (1.0 if bm >= 64 and warps >= 4 else 0.6)
    if acc_elements > 64 * warps * 32:
        rate *= 0.75
    return rate / 2 if elt == 4 else rate


def _smem_operand_bytes(flops: float, bm: int, bn: int, elt: int) -> float:
    """An mma of bm x bn x bk reads bm*bk + bk*bn operands for 2*bm*bn*bk FLOPs."""
    return flops / 2 * (1 / bn + 1 / bm) * elt


def _weight_rereads(shape: ChainShape, profile: DeviceProfile, row_tiles: int, slots: int) -> int:
    """Weights larger than L2 come from HBM once per wave of row tiles walking them together."""
    if shape.weight_bytes <= profile.l2_bytes / 2:
        return 1
    return max(1, math.ceil(row_tiles / max(1, min(8, slots))))


def _per_sm(profile: DeviceProfile, smem: int, regs_per_thread: int, warps: int) -> int:
    by_smem = profile.smem_per_sm // max(1, smem)
    by_regs = profile.regs_per_sm // max(1, regs_per_thread * warps * 32)
    return max(0, min(by_smem, by_regs, 64 // warps))


# ---------------------------------------------------------------- the plan kinds

def estimate_fused(shape: ChainShape, t: ChainTiles, profile: DeviceProfile) -> Estimate | None:
    e, g = shape.elt, 2 if shape.gated else 1
    resident = shape.K <= t.bk
    smem = t.num_stages * (t.bm * t.bk + g * t.bk * t.bn) * e + 2 * t.bn * t.bl * e + t.bm * t.bn * e
    regs = (g * t.bm * t.bn + t.bm * t.bl) // (t.num_warps * 32) + (t.bm * t.bk // (t.num_warps * 64) if resident else 0) + 40
    if smem > profile.smem_per_block or regs > 255:
        return None
    per_sm = _per_sm(profile, smem, regs, t.num_warps)
    if per_sm == 0:
        return None
    m_t, l_t, n_t = math.ceil(shape.M / t.bm), math.ceil(shape.L / t.bl), math.ceil(shape.N / t.bn)
    programs = m_t * l_t * t.split_n
    pm, pn, pl = m_t * t.bm, n_t * t.bn, l_t * t.bl
    flops1 = 2 * pm * pn * shape.K * g * l_t        # every l tile recomputes GEMM1
    flops2 = 2 * pm * pn * pl
    a_loads = m_t * l_t * (t.bm * shape.K if resident else n_t * t.bm * shape.K)
    l2 = (a_loads + m_t * l_t * n_t * (g * shape.K * t.bn + t.bn * t.bl)) * e
    partials = 2 * t.split_n * shape.M * shape.L * 4 if t.split_n > 1 else 0
    hbm = (shape.M * shape.K + shape.M * shape.L) * e + partials
    hbm += shape.weight_bytes * _weight_rereads(shape, profile, m_t * l_t, profile.sms * per_sm)
    smem_vol = _smem_operand_bytes(flops1, t.bm, t.bn, e) + _smem_operand_bytes(flops2, t.bm, t.bl, e)
    in_flight = t.num_stages * (t.bm * t.bk + g * t.bk * t.bn) * e
    iters = math.ceil(n_t / t.split_n) * (math.ceil(shape.K / t.bk) + 1)
    est = _kernel_time(profile, flops1 + flops2, _mma_rate(profile, t.bm, t.num_warps, e),
                       {"hbm": hbm, "l2": l2, "smem": smem_vol}, programs, per_sm, in_flight, iters)
    steps = math.ceil(programs / (profile.sms * per_sm)) * math.ceil(n_t / t.split_n)
    est = _serial_terms(est, profile, shape, pm * pn * l_t, steps)
    if t.split_n > 1:
        est = _with_reduction(est, profile, t.split_n, shape.M * shape.L, e)
    return est


def _with_reduction(est: Estimate, profile: DeviceProfile, split: int, elements: int, elt: int) -> Estimate:
    """Split partials are summed by a second kernel after the first: it reads split fp32 copies
    and writes the result, serially (round one priced only its launch, and ranked a split-16
    GEMM2 that measured 2.2x slower than split 1 as a tie)."""
    seconds = profile.launch + (split * elements * 4 + elements * elt) / profile.hbm_bw
    return Estimate(est.seconds + seconds, est.volumes, est.times + (("reduce", seconds),), est.programs, est.waves)


def _serial_terms(est: Estimate, profile: DeviceProfile, shape: ChainShape, act_elements: float,
                  steps: int) -> Estimate:
    """What the fused kernels do not overlap (measured): the activation's ALU work, and the
    exposed latency of each serial chunk step (weights restaged through shared memory, waits
    on the tensor cores) of the busiest SM."""
    act = act_elements * (ACT_INSTR.get(shape.act, 24) + (1 if shape.gated else 0)) / profile.alu_rate
    lat = steps * profile.step_latency
    times = est.times + (("act", act), ("latency", lat))
    return Estimate(est.seconds + act + lat, est.volumes, times, est.programs, est.waves)


def estimate_resident(shape: ChainShape, t: ResidentTiles, profile: DeviceProfile) -> Estimate | None:
    """The persistent kernel of chain_resident.py: about one program per SM walks the row tiles."""
    if resident_refusal(shape.K, shape.N, shape.L, t, shape.gated):
        return None
    e, g = shape.elt, 2 if shape.gated else 1
    bk, bl = _pow2_ceil(max(16, shape.K)), _pow2_ceil(max(16, shape.L))
    bn = _pow2_ceil(max(16, shape.N)) if t.transposed else min(t.bn, _pow2_ceil(max(16, shape.N)))
    chunks = math.ceil(shape.N / bn)
    threads = t.num_warps * 32
    held = (g * bk * bn + bn * bl) * e // 4 if (t.transposed or t.weights_in_registers) else 0
    regs = (g * t.bm * bn + t.bm * bl + 2 * t.bm * bk // 2 + held) // threads + 40
    smem = (t.bm * bk + t.bm * bn + (0 if t.transposed else g * bk * bn + bn * bl)) * e
    if regs > 255 or smem > profile.smem_per_block:
        return None
    per_sm = min(t.programs_per_sm, _per_sm(profile, smem, regs, t.num_warps))
    if per_sm == 0:
        return None
    row_tiles = math.ceil(shape.M / t.bm)
    programs = min(row_tiles, profile.sms * t.programs_per_sm)
    pm, pn = row_tiles * t.bm, chunks * bn
    flops = 2 * pm * pn * (shape.K * g + bl)
    restaged = programs if (t.transposed or t.weights_in_registers) else row_tiles
    l2 = (shape.M * shape.K + shape.weight_bytes * restaged) * e
    hbm = (shape.M * shape.K + shape.M * shape.L) * e + shape.weight_bytes
    smem_vol = _smem_operand_bytes(flops, t.bm, min(bn, bl), e)
    est = _kernel_time(profile, flops, _mma_rate(profile, t.bm, t.num_warps, e),
                       {"hbm": hbm, "l2": l2, "smem": smem_vol}, programs, per_sm, t.bm * bk * e,
                       math.ceil(row_tiles / programs) * chunks)
    steps = math.ceil(row_tiles / (profile.sms * per_sm)) * chunks
    return _serial_terms(est, profile, shape, pm * pn, steps)


def estimate_gemm(M: int, N: int, K: int, t: GemmTiles, profile: DeviceProfile, elt: int, gated: bool = False,
                  weights_bytes: float = 0.0) -> Estimate | None:
    g = 2 if gated else 1
    smem = t.num_stages * (t.bm * t.bk + g * t.bk * t.bn) * elt
    regs = g * t.bm * t.bn // (t.num_warps * 32) + 40
    if smem > profile.smem_per_block or regs > 255:
        return None
    per_sm = _per_sm(profile, smem, regs, t.num_warps)
    if per_sm == 0:
        return None
    m_t, n_t = math.ceil(M / t.bm), math.ceil(N / t.bn)
    programs = m_t * n_t * t.split_k
    flops = 2 * m_t * t.bm * n_t * t.bn * K * g
    l2 = m_t * n_t * K * (t.bm + g * t.bn) * elt
    weights = weights_bytes or K * N * g * elt
    rereads = 1 if weights <= profile.l2_bytes / 2 else max(1, math.ceil(m_t / t.group_m))
    hbm = M * K * elt + weights * rereads + M * N * elt
    if t.split_k > 1:
        hbm += 2 * t.split_k * M * N * 4
    in_flight = t.num_stages * (t.bm * t.bk + g * t.bk * t.bn) * elt
    est = _kernel_time(profile, flops, _mma_rate(profile, t.bm, t.num_warps, elt, g * t.bm * t.bn),
                       {"hbm": hbm, "l2": l2, "smem": _smem_operand_bytes(flops, t.bm, t.bn, elt)},
                       programs, per_sm, in_flight, math.ceil(K / (t.bk * t.split_k)))
    if t.split_k > 1:
        est = _with_reduction(est, profile, t.split_k, M * N, elt)
    return est


def estimate_cluster(shape: ChainShape, size: int, profile: DeviceProfile) -> Estimate | None:
    e = shape.elt
    if not cluster_dsm.supports(shape.M, shape.N, shape.K, shape.L, size, shape.act,
                                _dtype_of(e), shape.gated):
        return None
    m_t = math.ceil(shape.M / 64)
    programs = m_t * size
    flops = 2 * m_t * 64 * shape.N * (shape.K + shape.L)
    chunks = shape.N // 64
    l2 = m_t * chunks * (64 * shape.K + shape.K * 64 + 64 * shape.L) * e
    hbm = (shape.M * shape.K + shape.M * shape.L) * e + shape.weight_bytes * _weight_rereads(
        shape, profile, m_t, profile.sms)
    dsm = m_t * (size - 1) * 64 * shape.L * 4
    smem = max((64 * 32 + 32 * 64) * 2 + 64 * 68 * 4 + 64 * 72 * 2 + 64 * (shape.L + 8) * 2, 64 * shape.L * 4)
    # wmma (mma.sync) without pipelining: one 64x32 + 32x64 tile in flight per CTA
    est = _kernel_time(profile, flops, profile.mma_flops * 0.45, {"hbm": hbm, "l2": l2, "dsm": dsm},
                       programs, max(1, profile.smem_per_sm // smem), (64 * 32 + 32 * 64) * e,
                       (chunks // size) * (shape.K // 32 + 2), usable_sms=cluster_usable_sms(profile, size))
    est = _serial_terms(est, profile, shape, m_t * 64 * shape.N,
                        math.ceil(programs / cluster_usable_sms(profile, size)) * (chunks // size))
    sync = 2 * profile.dsm_latency * 4  # two cluster barriers per tile
    return Estimate(est.seconds + sync, est.volumes + (("sync", sync),), est.times, est.programs, est.waves)


def _library_gemm(profile: DeviceProfile, flops: float, nbytes: float) -> float:
    return max(flops / (profile.mma_flops * 0.95), nbytes / (profile.hbm_bw * profile.library_stream_eff))


def _library_gemm1(shape: ChainShape, profile: DeviceProfile, conv: bool) -> float:
    """cuBLAS GEMM1 (gated: both), or cuDNN's conv on the channels-last input (plus that copy)."""
    e, g = shape.elt, 2 if shape.gated else 1
    a_bytes = shape.conv_in * e if conv else shape.M * shape.K * e
    t = g * _library_gemm(profile, 2 * shape.M * shape.N * shape.K, a_bytes + shape.K * shape.N * e
                          + shape.M * shape.N * e)
    if conv:
        t += 2 * shape.conv_in * e / profile.hbm_bw + profile.launch
    return t + g * profile.launch


def _library_gemm2(shape: ChainShape, profile: DeviceProfile) -> float:
    e = shape.elt
    return profile.launch + _library_gemm(profile, 2 * shape.M * shape.N * shape.L,
                                          (shape.M * shape.N + shape.N * shape.L + shape.M * shape.L) * e)


def _pass(profile: DeviceProfile, nbytes: float, elements: float = 0, instr: int = 0) -> float:
    """One elementwise kernel: its bytes or its ALU work, whichever binds, plus a launch."""
    return profile.launch + max(nbytes / profile.hbm_bw, elements * instr / profile.alu_rate)


def estimate_library(shape: ChainShape, profile: DeviceProfile) -> Estimate:
    """What eager runs: cuBLAS GEMMs and one elementwise kernel per op (bias add, activation
    (libdevice's erf for GELU), gate product), each a pass over M×N."""
    e, mn = shape.elt, shape.M * shape.N
    t1 = _library_gemm1(shape, profile, conv=False)
    act_name = "gelu_libdevice" if shape.act == "gelu" else shape.act
    act = _pass(profile, 2 * mn * e, mn, ACT_INSTR.get(act_name, 24))
    if shape.gated:
        act += _pass(profile, 3 * mn * e)
    t2 = _library_gemm2(shape, profile)
    return Estimate(t1 + act + t2, (("hbm", shape.io_bytes + 2 * (2 if shape.gated else 1) * mn * e),),
                    (("gemm1", t1), ("act", act), ("gemm2", t2)), 0, 1)


def estimate_cublas_epi(shape: ChainShape, profile: DeviceProfile) -> Estimate:
    """Library GEMM1(s), one fused pass (bias, polynomial activation, gate), library GEMM2."""
    e, g, mn = shape.elt, 2 if shape.gated else 1, shape.M * shape.N
    t1 = _library_gemm1(shape, profile, conv=shape.conv_in > 0)
    act = _pass(profile, (g + 1) * mn * e, mn, ACT_INSTR.get(shape.act, 24) + g - 1)
    t2 = _library_gemm2(shape, profile)
    return Estimate(t1 + act + t2, (("hbm", shape.io_bytes + 2 * g * mn * e),),
                    (("gemm1", t1), ("act", act), ("gemm2", t2)), 0, 1)


# the activations cuBLASLt applies in a GEMM's epilogue -> torch._addmm_activation's use_gelu (its GELU is the tanh form)
LT_ACTS = {"relu": False, "gelu_tanh": True}


def lt_refusal(shape: ChainShape) -> str | None:
    """Why GEMM1 cannot take its activation in cuBLASLt's epilogue, or None."""
    if shape.act not in LT_ACTS:
        return f"cuBLASLt's epilogue has ReLU and tanh-GELU, not {shape.act}"
    if shape.gated:
        return "not for gated chains: the gate product needs a pass of its own"
    if shape.conv_in:
        return "GEMM1 is a convolution (cuDNN)"
    return None


def estimate_cublas_lt(shape: ChainShape, profile: DeviceProfile) -> Estimate:
    """Library GEMM1 with bias and activation in its epilogue, library GEMM2: h is written once and read once."""
    e, mn = shape.elt, shape.M * shape.N
    t1, t2 = _library_gemm1(shape, profile, conv=False), _library_gemm2(shape, profile)
    return Estimate(t1 + t2, (("hbm", shape.io_bytes + 2 * mn * e),), (("gemm1", t1), ("gemm2", t2)), 0, 1)


def _dtype_of(elt: int):
    import torch

    return torch.bfloat16 if elt == 2 else torch.float32


# ---------------------------------------------------------------- the Hopper (Gluon) chain kernel

# The Gluon kernel's activation in FMA-pipe instructions per element (counted in its SASS): GELU in
# packed halves (wgmma_kernel._gelu_pairs_asm), and the SFU's tanh. On the H100 the activation added to
# the kernel's time (13.4 µs without, 18.7 µs with GELU on 16.8M elements): the model adds it too.
WGMMA_ACT_INSTR = {"none": 0, "relu": 1, "gelu": 7.5, "gelu_tanh": 6, "silu": 8}
# A row tile's load-compute-store latency that a lone program per SM leaves exposed (H100: one program
# of 64-row tiles per SM ran 6-8 µs slower than two over ~8 tiles each); and the wait of each streamed
# weight chunk (two-slot ring, synchronous wgmma, a block barrier per chunk: H100, the streamed plans
# ran 2-4 µs over estimates that took the weight traffic as overlapped). Fitted to the H100 run of
# 2026-11-22 (BENCHMARKS.md); not yet checked on other shapes.
WGMMA_TILE_LATENCY = 0.8e-6
WGMMA_CHUNK_WAIT = 0.5e-6


def wgmma_registers(shape: ChainShape, t: WgmmaTiles, resident: bool) -> float:
    """Registers per thread, fitted to ptxas's counts (chain_wgmma.compile_for_sm90; the test checks
    the fit) over x, the accumulator elements per thread: the resident kernel holds two GEMM1
    accumulators (the asynchronous pipeline), the streamed one a single one."""
    x = (t.bm * t.bn + t.bm * shape.L) / (t.num_warps * 32)
    return min(181.0, 2.5 * x - 2) if resident else 1.5 * x - 16


def estimate_wgmma(shape: ChainShape, t: WgmmaTiles, profile: DeviceProfile) -> Estimate | None:
    """chain_wgmma: A and E stream through HBM once; the weights are copied into shared memory once per
    program (resident) or once per row tile (streamed, from L2). Measured on the H100 the parts add:
    HBM time + max(MMA, weight traffic) + activation + the weights' first copy + launch."""
    if shape_refusal(shape.K, shape.N, shape.L, t, shape.act, shape.gated, shape.elt):
        return None
    e, resident = shape.elt, is_resident(shape.K, shape.N, shape.L, t)
    if wgmma_registers(shape, t, resident) * t.num_warps * 32 * t.programs_per_sm > profile.regs_per_sm:
        return None  # fewer programs than the persistent grid would fit an SM: the grid runs in two waves
    row_tiles = math.ceil(shape.M / t.bm)
    programs = min(row_tiles, profile.sms * t.programs_per_sm)
    weights = shape.weight_bytes * (programs if resident else row_tiles)
    hbm = (shape.M * shape.K + shape.M * shape.L) * e + shape.weight_bytes
    flops = 2 * row_tiles * t.bm * shape.N * (shape.K + shape.L)
    times = {"hbm": hbm / profile.hbm_bw, "compute": flops / profile.mma_flops, "l2": weights / profile.l2_bw,
             "act": shape.M * shape.N * WGMMA_ACT_INSTR[shape.act] / profile.alu_rate}
    first_copy = profile.sms * t.programs_per_sm * shape.weight_bytes / profile.l2_bw if resident else 0.0
    tiles_per_program = math.ceil(row_tiles / programs)
    exposed = tiles_per_program * WGMMA_TILE_LATENCY if t.programs_per_sm == 1 else 0.0
    if resident:
        weights_time = times["compute"]
    else:  # a lone program per SM overlaps nothing with its own weight waits
        exposed += tiles_per_program * (shape.N // t.bn) * WGMMA_CHUNK_WAIT
        weights_time = (times["compute"] + times["l2"] if t.programs_per_sm == 1
                        else max(times["compute"], times["l2"]))
    seconds = profile.launch + times["hbm"] + times["act"] + first_copy + exposed + weights_time
    return Estimate(seconds, (("hbm", hbm), ("l2", weights)), tuple(times.items()), programs,
                    math.ceil(row_tiles / programs))



def _pow2_ceil(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


# ---------------------------------------------------------------- the weight-streaming GEMM (Gluon)

# The split-K finish of stream_gemm (partials written, the last program sums them): H100, clean L2,
# GPT-6.7B FFN GEMM2 split 2 took 56.0 µs where GEMM1's weight stream of the same size took 51.2.
STREAM_SPLIT_COST = 2.5e-6


def estimate_stream_gemm(M: int, N: int, K: int, t: StreamTiles, profile: DeviceProfile, elt: int,
                         act: str = "none") -> Estimate | None:
    """stream_gemm: B read from HBM once at `gluon_stream_eff` of the copy rate (a TMA ring keeps
    stages-1 slices in flight per program), and from L2 by every row tile; A re-read from L2 by
    every column of tiles; split-K partials through L2. The bandwidths scale with the SMs the grid
    keeps busy."""
    if stream_shape_refusal(M, N, K, t, act) or elt != 2:
        return None
    m_t, n_t = math.ceil(M / t.bm), math.ceil(N / t.bn)
    programs = m_t * n_t * t.split_k
    per_sm = max(1, profile.smem_per_sm // stream_smem_bytes(t))
    waves = math.ceil(programs / (profile.sms * per_sm))
    share = min(1.0, programs / profile.sms) if waves == 1 else programs / (waves * profile.sms * per_sm)
    weights, partials = K * N * elt, (2 * t.split_k * m_t * t.bm * n_t * t.bn * 4 if t.split_k > 1 else 0)
    hbm = weights + (M * K + M * N) * elt
    l2 = n_t * m_t * t.bm * K * elt + m_t * weights + partials  # each row tile reads every weight tile
    flops = 2 * m_t * t.bm * n_t * t.bn * K
    times = {"hbm": hbm / (profile.hbm_bw * profile.gluon_stream_eff * share), "l2": l2 / (profile.l2_bw * share),
             "compute": flops / (profile.mma_flops * share)}
    seconds = profile.launch + max(times.values()) + (t.split_k - 1) * STREAM_SPLIT_COST
    return Estimate(seconds, (("hbm", hbm), ("l2", l2)), tuple(times.items()), programs, waves)

