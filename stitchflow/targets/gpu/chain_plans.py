"""Plans for compute chains: enumerate each kind's legal tilings, price them with the cost model
(chain_cost), rank them, and pick the shortlist the autotuner times on the device.

Legality (capacity, refusals of the kernels) is checked where each kind is enumerated; ranking is
one sort by estimated time, with the vendor library as the reference our kernels must beat by the
model's error (`LIBRARY_MARGIN`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

from . import cluster_dsm
from .chain_cost import (ACT_INSTR, ChainShape, DeviceProfile, Estimate, Plan, _library_gemm1, _pow2_ceil,
                         estimate_cluster, estimate_cublas_epi, estimate_cublas_lt, estimate_fused, estimate_gemm,
                         estimate_library, estimate_resident, estimate_stream_gemm, estimate_wgmma, lt_refusal)
from .chain_kernels import ChainTiles, GemmTiles
from .chain_resident import ResidentTiles, resident_refusal
from .chain_wgmma import GLUON_ACTS, WgmmaTiles, gluon_refusal, is_resident
from .stream_gemm import StreamTiles
from .stream_gemm import shape_refusal as stream_shape_refusal

ALL_KINDS = ("fused", "resident", "wgmma", "stream", "two_pass", "cluster", "cublas_epi", "cublas_lt", "cublas_pro",
             "library")
STREAM_MAX_ROWS = 256   # longer A is compute-bound: the library's persistent GEMMs own it


def cublas_pro_plans(shape: ChainShape, profile: DeviceProfile, keep: int = 3) -> list[Plan]:
    """Library GEMM1, then our GEMM2 with the activation applied to h as it is loaded: every
    column tile of E re-applies it, so its ALU work grows with L / bn."""
    if shape.gated:
        return []
    t1 = _library_gemm1(shape, profile, conv=shape.conv_in > 0)
    plans = []
    for s2, t2, e2 in _gemm_options(shape.M, shape.L, shape.N, profile, shape.elt, False, False, 3 * keep):
        act = shape.M * shape.N * math.ceil(shape.L / t2.bn) * ACT_INSTR.get(shape.act, 24) / profile.alu_rate
        est = Estimate(t1 + s2 + act, e2.volumes, (("gemm1", t1), ("gemm2", s2), ("act", act)), e2.programs, e2.waves)
        levels = (("A", "hbm"), ("B", "library"), ("h", "hbm"), ("D", "smem"), ("E", "hbm"))
        plans.append(Plan("cublas_pro", "G1[library] G2[m:S l:S n:T, act on load]", levels, gemm2=t2, estimate=est))
    return sorted(plans, key=lambda p: p.estimate.seconds)[:keep]


def _with_im2col(plan: Plan, shape: ChainShape, profile: DeviceProfile) -> Plan:
    """Matrix plans on a conv build im2col inside each call: the padded channels-last copy of x,
    then the strided gather of M×K elements at the measured gather rate."""
    e = shape.elt
    extra = 2 * profile.launch + 2 * shape.conv_in * e / profile.hbm_bw + shape.M * shape.K * e / profile.gather_bw
    est = plan.estimate
    est = Estimate(est.seconds + extra, est.volumes, est.times + (("im2col", extra),), est.programs, est.waves)
    return dataclasses.replace(plan, estimate=est)


def _fits(tile: int, dim: int, smallest: int = 16, least: int = 16) -> bool:
    """Prune tiles far past the problem (a tile may exceed its dimension only up to the next power
    of two) and tiles below `least` where the dimension is larger: a k step under 64 or an n tile
    under 32 leaves the tensor cores waiting on loop overhead that the model prices only roughly."""
    return min(least, _pow2_ceil(dim)) <= tile <= max(smallest, _pow2_ceil(dim))


def _warps_for(tile_elements: int) -> int:
    """Measured on the H200 (bench/chains.py, first run): 8 warps paid only from about 128x128
    accumulator elements per program; below that 4 warps ran up to 1.7x faster."""
    return 8 if tile_elements >= 128 * 128 else 4


def fused_plans(shape: ChainShape, profile: DeviceProfile) -> list[Plan]:
    plans = []
    for bm, bn, bk, bl, warps, stages in itertools.product((16, 32, 64, 128), (16, 32, 64, 128), (16, 32, 64, 128),
                                                           (16, 32, 64, 128, 256), (4, 8), (2, 3)):
        if not (_fits(bm, shape.M) and _fits(bn, shape.N, least=32) and _fits(bk, shape.K, least=64)
                and _fits(bl, shape.L)):
            continue
        if math.ceil(shape.L / bl) > 4:  # each l tile recomputes GEMM1: more than 4x is never worth it
            continue
        if warps != _warps_for(bm * (bn + bl)):
            continue
        n_chunks = math.ceil(shape.N / bn)
        for split in (1, 2, 4, 8, 16, 32):
            if split > n_chunks:
                break
            t = ChainTiles(bm, bn, bk, bl, split, warps, stages)
            est = estimate_fused(shape, t, profile)
            if est is None:
                continue
            sched = f"m:S l:{'S' if shape.L > bl else 'T'} n:{'S' if split > 1 else 'T'} k:T"
            levels = (("A", "smem"), ("B", "smem"), ("h", "registers"), ("D", "smem"),
                      ("partials", "hbm" if split > 1 else "registers"), ("E", "hbm"))
            plans.append(Plan("fused", sched, levels, chain=t, estimate=est))
    return plans


def resident_plans(shape: ChainShape, profile: DeviceProfile) -> list[Plan]:
    """The persistent kernel's plans: row tile, N chunk, warps, programs per SM, orientation."""
    if resident_refusal(shape.K, shape.N, shape.L, None, shape.gated):
        return []
    plans = []
    for bm, bn, warps, per_sm, transposed in itertools.product((64, 128), (64, 128, 256), (4, 8), (1, 2),
                                                               (False, True)):
        if transposed and (bn != 64 or shape.elt == 4):  # N whole, 16-bit operands: see resident_chain
            continue
        if not (_fits(bm, shape.M) and _fits(bn, shape.N, least=32)):
            continue
        t = ResidentTiles(bm, bn, warps, 1, False, per_sm, True, transposed)
        if transposed and resident_refusal(shape.K, shape.N, shape.L, t, shape.gated):
            continue
        est = estimate_resident(shape, t, profile)
        if est is None:
            continue
        levels = (("A", "smem"), ("B", "registers" if transposed else "smem"), ("h", "registers"),
                  ("D", "registers" if transposed else "smem"), ("E", "hbm"))
        plans.append(Plan("resident", "m:S(persistent) n:T(unrolled) k:T l:T", levels, resident=t, estimate=est))
    return plans


HOPPER_NAMES = ("H100", "H200", "H800", "H20", "GH200")


def wgmma_plans(shape: ChainShape, profile: DeviceProfile) -> list[Plan]:
    """The Hopper (Gluon, wgmma + TMA) chain kernel's plans; none on other GPUs."""
    if not any(name in profile.name for name in HOPPER_NAMES) or gluon_refusal():
        return []
    plans = []
    for (bm, warps), bn, stages, per_sm in itertools.product(((64, 4), (128, 8)), (64, 128, 256), (2, 3), (1, 2)):
        t = WgmmaTiles(bm, bn, warps, stages, 2, per_sm)
        est = estimate_wgmma(shape, t, profile)
        if est is not None:
            weights = "smem" if is_resident(shape.K, shape.N, shape.L, t) else "smem ring from L2"
            levels = (("A", "smem (TMA)"), ("B", weights), ("h", "registers"), ("D", weights), ("E", "hbm (TMA)"))
            plans.append(Plan("wgmma", "m:S(persistent) n:T(unrolled) k:T l:T", levels, wgmma=t, estimate=est))
    return plans

def _gemm_options(M: int, N: int, K: int, profile: DeviceProfile, elt: int, gated: bool, split_ok: bool, keep: int):
    found = []
    for bm, bn, bk, warps, stages in itertools.product((16, 32, 64, 128), (16, 32, 64, 128, 256), (16, 32, 64, 128),
                                                       (4, 8), (3, 4, 5)):
        if not (_fits(bm, M) and _fits(bn, N, least=32) and _fits(bk, K, least=64)) or warps != _warps_for(bm * bn):
            continue
        for split in (1, 2, 4, 8, 16) if split_ok else (1,):
            if split > 1 and K // split < 4 * bk:
                break
            t = GemmTiles(bm, bn, bk, split, 8, warps, stages)
            est = estimate_gemm(M, N, K, t, profile, elt, gated)
            if est is not None:
                found.append((est.seconds, t, est))
    found.sort(key=lambda x: x[0])
    return found[:keep]


def two_pass_plans(shape: ChainShape, profile: DeviceProfile, keep: int = 6) -> list[Plan]:
    e = shape.elt
    first = _gemm_options(shape.M, shape.N, shape.K, profile, e, shape.gated, False, keep)
    second = _gemm_options(shape.M, shape.L, shape.N, profile, e, False, True, keep)
    plans = []
    # GEMM1's epilogue applies the activation to all M×N elements: ALU work its tiles do not hide
    act = shape.M * shape.N * (ACT_INSTR.get(shape.act, 24) + (1 if shape.gated else 0)) / profile.alu_rate
    first = [(s1 + act, t1, e1) for s1, t1, e1 in first]
    for (s1, t1, e1), (s2, t2, e2) in itertools.product(first, second):
        sched = f"G1[m:S n:S k:T] G2[m:S l:S n:{'S' if t2.split_k > 1 else 'T'}]"
        levels = (("A", "smem"), ("B", "smem"), ("h", "hbm"), ("D", "smem"), ("E", "hbm"))
        volumes = tuple((f"g1.{k}", v) for k, v in e1.volumes) + tuple((f"g2.{k}", v) for k, v in e2.volumes)
        est = Estimate(s1 + s2, volumes, (("gemm1", s1), ("gemm2", s2)), e1.programs + e2.programs,
                       max(e1.waves, e2.waves))
        plans.append(Plan("two_pass", sched, levels, gemm1=t1, gemm2=t2, estimate=est))
    return plans


def _stream_options(M: int, N: int, K: int, act: str, profile: DeviceProfile, elt: int, splits, keep: int):
    found = []
    # one row tile: 64-row tiles on 128 rows (two tiles read each weight tile, filling the SMs without
    # split-K, as max-autotune's Triton GEMM2 does) ran slower on the H100: GEMM2 60.7 µs against 57.0
    # with split-K 2, GEMM1 61-98 against 52.7 (scripts/stream_probe.py)
    bm = 64 if M <= 64 else 128
    for bn, bk, split in itertools.product((128, 256, 64), (64, 128), splits):  # ties: measured order
        stages = max(2, min(8, (profile.smem_per_block - 1024) // ((bm + bn) * bk * 2)))
        # the fewest warps whose accumulators fit registers (H100: 128x64 split-K 2 ran 56.0 µs with 4
        # warps, 4-5% slower with 8)
        t = next((t for w in (4, 8) if not stream_shape_refusal(M, N, K, t := StreamTiles(bm, bn, bk, stages, split, w),
                                                                  act)), None)
        if t is None:
            continue
        est = estimate_stream_gemm(M, N, K, t, profile, elt, act)
        if est is not None:
            found.append((est.seconds, t, est))
    return sorted(found, key=lambda x: x[0])[:keep]


def stream_plans(shape: ChainShape, profile: DeviceProfile, keep: int = 3) -> list[Plan]:
    """Two Gluon weight-streaming GEMMs (Hopper): act(A·B + b) in GEMM1's epilogue, split-K GEMM2."""
    if stream_refusal_for(shape, profile):
        return []
    first = _stream_options(shape.M, shape.N, shape.K, shape.act, profile, shape.elt, (1,), keep)
    second = _stream_options(shape.M, shape.L, shape.N, "none", profile, shape.elt, (1, 2, 4), keep)
    levels = (("A", "smem (TMA)"), ("B", "smem ring (TMA)"), ("h", "hbm"), ("D", "smem ring (TMA)"), ("E", "hbm"))
    plans = []
    for (s1, t1, e1), (s2, t2, e2) in itertools.product(first, second):
        est = Estimate(s1 + s2, tuple((f"g1.{k}", v) for k, v in e1.volumes) + tuple((f"g2.{k}", v) for k, v in
                                                                                     e2.volumes),
                       (("gemm1", s1), ("gemm2", s2)), e1.programs + e2.programs, max(e1.waves, e2.waves))
        sched = f"G1[m:S n:S k:T] G2[m:S l:S n:{'S' if t2.split_k > 1 else 'T'}]"
        plans.append(Plan("stream", sched, levels, streams=(t1, t2), estimate=est))
    return plans


def stream_refusal_for(shape: ChainShape, profile: DeviceProfile) -> str | None:
    """Why a chain of this shape gets no stream plan (None: it can have one)."""
    if not any(name in profile.name for name in HOPPER_NAMES):
        return f"needs a Hopper GPU; the profile is {profile.name}"
    if gluon_refusal():
        return gluon_refusal()
    if shape.gated or shape.conv_in:
        return "gated and conv chains are not in the stream GEMM (one B operand, matrix A)"
    if shape.act not in GLUON_ACTS or shape.elt != 2:
        return f"activation {shape.act!r} or {8 * shape.elt}-bit operands are not in the stream GEMM"
    if shape.M > STREAM_MAX_ROWS:
        return f"M={shape.M} > {STREAM_MAX_ROWS}: compute-bound, not a weight stream"
    return None


def cluster_plans(shape: ChainShape, profile: DeviceProfile) -> list[Plan]:
    plans = []
    for size in cluster_dsm.CLUSTER_SIZES:
        est = estimate_cluster(shape, size, profile)
        if est is not None:
            levels = (("A", "smem"), ("B", "smem"), ("h", "smem"), ("D", "smem"), ("partials", "dsm"), ("E", "hbm"))
            plans.append(Plan("cluster", "m:S n:S(cluster) l:T k:T", levels, cluster=size, estimate=est))
    return plans


def rank_plans(shape: ChainShape, profile: DeviceProfile, kinds=ALL_KINDS) -> list[Plan]:
    """Every legal plan that fits, cheapest first."""
    plans: list[Plan] = []
    if "fused" in kinds:
        plans += fused_plans(shape, profile)
    if "resident" in kinds:
        plans += resident_plans(shape, profile)
    if "wgmma" in kinds and not shape.conv_in:
        plans += wgmma_plans(shape, profile)
    if "two_pass" in kinds:
        plans += two_pass_plans(shape, profile)
    if "stream" in kinds:
        plans += stream_plans(shape, profile)
    if "cluster" in kinds:
        plans += cluster_plans(shape, profile)
    if "library" in kinds:
        plans.append(Plan("library", "eager", (("h", "hbm"),), estimate=estimate_library(shape, profile)))
    if shape.conv_in:
        plans = [_with_im2col(p, shape, profile) for p in plans]
    if "cublas_epi" in kinds:
        levels = (("A", "hbm"), ("B", "library"), ("h", "hbm"), ("D", "library"), ("E", "hbm"))
        plans.append(Plan("cublas_epi", "G1[library] act G2[library]", levels,
                          estimate=estimate_cublas_epi(shape, profile)))
    if "cublas_lt" in kinds and lt_refusal(shape) is None:
        levels = (("A", "hbm"), ("B", "library"), ("h", "hbm"), ("D", "library"), ("E", "hbm"))
        plans.append(Plan("cublas_lt", "G1[library, act] G2[library]", levels,
                          estimate=estimate_cublas_lt(shape, profile)))
    if "cublas_pro" in kinds:
        plans += cublas_pro_plans(shape, profile)
    plans.sort(key=_rank_key)
    return plans


# The vendor library plans (cuBLAS/cuDNN with at most our elementwise pass) are the reference. Our
# kernels rank above them only when estimated faster by the model's error: on the H100 the Triton
# weight-streaming plans estimated 2-3% faster than cuBLAS for decode shapes ran 10-30% slower.
LIBRARY_KINDS = ("library", "cublas_epi", "cublas_lt")
LIBRARY_MARGIN = 1.10


def _rank_key(plan: Plan) -> float:
    return plan.estimate.seconds * (1.0 if plan.kind in LIBRARY_KINDS else LIBRARY_MARGIN)


def shortlist(shape: ChainShape, profile: DeviceProfile, k: int = 10,
              kinds=tuple(k for k in ALL_KINDS if k != "cluster")) -> list[Plan]:
    """The top k plans, keeping the best of each kind in view so profiling can correct the model."""
    ranked = rank_plans(shape, profile, kinds)
    chosen, seen = [], set()
    best_each = [p for p in (next((p for p in ranked if p.kind == kind), None) for kind in kinds) if p is not None]
    for plan in ranked:  # one plan per tile shape: pipelining depth alone rarely changes the ranking
        tiles = plan.chain or plan.gemm1 or plan.resident
        key = (plan.kind, plan.cluster, plan.wgmma and dataclasses.replace(plan.wgmma, a_stages=0),
               tiles and dataclasses.replace(tiles, num_stages=0),
               plan.gemm2 and dataclasses.replace(plan.gemm2, num_stages=0), plan.streams)
        if key not in seen and len(chosen) < max(0, k - len(best_each)) and plan not in best_each:
            seen.add(key)
            chosen.append(plan)
    return sorted(chosen + best_each, key=_rank_key)


# ---------------------------------------------------------------- explanations

def _why_no_plan(kind: str, shape: ChainShape, profile: DeviceProfile) -> str:
    from .chain_wgmma import shape_refusal

    if kind == "wgmma":
        if not any(n in profile.name for n in HOPPER_NAMES):
            return f"needs a Hopper GPU; the profile is {profile.name}"
        if gluon_refusal():
            return gluon_refusal()
        return shape_refusal(shape.K, shape.N, shape.L, WgmmaTiles(), shape.act, shape.gated, shape.elt) or \
            "no tiling fits shared memory and registers"
    if kind == "stream":
        return stream_refusal_for(shape, profile) or "no tiling fits shared memory"
    if kind == "resident":
        return resident_refusal(shape.K, shape.N, shape.L, None, shape.gated) or "no tiling fits"
    if kind == "cluster":
        return "no cluster size fits (cluster_dsm.supports)"
    if kind == "cublas_lt":
        return lt_refusal(shape)
    if kind == "cublas_pro" and shape.gated:
        return "not for gated chains: the gate needs both GEMM1 outputs whole"
    return "no tiling fits shared memory and registers"


def explain_shape(shape: ChainShape, profile: DeviceProfile, top: int = 5) -> list[str]:
    """The ranking for one chain: the best plans with their estimates and bounds, the best of every
    other kind, and why a kind has no plan at all."""
    ranked = rank_plans(shape, profile)
    lines = [f"{i + 1}. {p}" for i, p in enumerate(ranked[:top])]
    shown = {p.kind for p in ranked[:top]}
    for kind in dict.fromkeys(p.kind for p in ranked[top:]):
        if kind not in shown:
            best = next(p for p in ranked if p.kind == kind)
            lines.append(f"   best {kind}: {best}")
    for kind in ALL_KINDS:
        if all(p.kind != kind for p in ranked):
            lines.append(f"   no {kind} plan: {_why_no_plan(kind, shape, profile)}")
    return lines
