"""Static cost models of fusion regions, one per target, calibrated by least squares.

Both share one estimate of a region (`estimate_region`): FLOPs and points from dimensions and
densities, with the recomputation the region's loop nest implies (loopnest.py), and memory
traffic where intermediates inside the region cost nothing and region inputs and outputs are
read or written once — once per recomputation for an input a recomputed node streams again.

- dataflow: cycles of a region = max(busiest node's tokens / lanes, bytes / bandwidth) + startup.
  The nodes of a region are pipelined (every primitive has its own clock), so the busiest node
  bounds the region; regions run one after another, so a configuration costs the sum.
- gpu: seconds = bytes / copy bandwidth + launches x launch cost + GEMM FLOPs / GEMM rate +
  other FLOPs / fp32 rate, from a DeviceProfile (profile.py) of measured ceilings; a dense region
  with GEMMs as library calls and stitched kernels step by step (`stepwise_estimate`).

A model's cost is a weighted sum of its features; `calibrate` fits the weights from
(estimate, measured) pairs (simulated cycles, timed kernels) by non-negative least squares.
"""

from __future__ import annotations

import abc
import math
import weakref
from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import networkx as nx
import numpy as np
from scipy.optimize import nnls

from ..ir.expr import count_ops
from ..ir.graph import Graph
from ..targets import get_target
from .loopnest import LoopNest, analyse, analyse_walks, gating_accesses, lane_count, legal_orders, prepare, unify
from .profile import DeviceProfile
from .stats import Densities, iteration_density, stream_densities

INDEX_BYTES = 4  # one crd or seg entry (int32)


@dataclass(frozen=True)
class Estimate:
    """Static estimate of one region (or the sum over a configuration's regions)."""

    nodes: tuple[str, ...]
    flops: float
    bytes: float
    recomputed_flops: float
    critical: float  # tokens of the busiest node, after lanes and tiles
    gemm_flops: float = 0.0
    regions: int = 1
    loop: LoopNest | None = field(default=None, compare=False)
    launches: float = 0.0  # kernel and library launches where a region takes several (0: one per region)

    @property
    def kernel_launches(self) -> float:
        return self.launches or float(self.regions)

    def __str__(self) -> str:
        return (f"{self.regions} region(s): {self.flops:.4g} FLOPs ({self.recomputed_flops:.3g} recomputed), "
                f"{self.bytes:.4g} bytes")

    def __add__(self, other: "Estimate") -> "Estimate":
        return Estimate(self.nodes + other.nodes, self.flops + other.flops, self.bytes + other.bytes,
                        self.recomputed_flops + other.recomputed_flops, self.critical + other.critical,
                        self.gemm_flops + other.gemm_flops, self.regions + other.regions,
                        launches=self.kernel_launches + other.kernel_launches)


_STREAMS: dict = {}  # (id(graph), densities, block) -> (graph, stream densities); graphs are immutable


def _streams(graph: Graph, dens: Densities, block) -> dict[str, float]:
    key = (id(graph), dens, block)
    hit = _STREAMS.get(key)
    if hit is None or hit[0] is not graph:
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        hit = _STREAMS[key] = (graph, stream_densities(graph, dens, block))
    return hit[1]


def stored_bytes(graph: Graph, name: str, density: float, block: int | None = None) -> float:
    """Bytes of a tensor in memory: dense values, or values + coordinates + segments."""
    ttype = graph.type_of[name]
    es = ttype.dtype.itemsize
    numel = math.prod(ttype.shape) if ttype.shape else 1
    fmt = ttype.format
    if fmt.is_dense:
        return float(numel * es)
    rows = ttype.shape[fmt.mode_order[0]] if ttype.shape else 1
    b = (fmt.block[0] if fmt.block else block) or 1
    tiles = numel / (b * b) * density
    return tiles * (b * b * es + INDEX_BYTES) + (rows / b + 1) * INDEX_BYTES


def _memory_density(graph: Graph, dens: Densities, streams, name: str, block) -> float:
    """Density of a tensor read from memory: inputs and parameters as stored; an intermediate
    written by another region in its type's format (dense: every coordinate)."""
    if name in graph.node_of:
        return 1.0 if graph.type_of[name].format.is_dense else streams[name]
    return dens.storage(graph, name, block)


def region_density(graph: Graph, dens: Densities, block: int | None = None):
    """The densities estimate_region reads, as a function (tensor, inside) -> density: a node's
    result streamed inside its region, or any tensor as read from memory (RegionKeys keys on them)."""
    streams = _streams(graph, dens, block)

    def density(name: str, inside: bool = True) -> float:
        if inside and name in graph.node_of:
            return streams[name]
        return _memory_density(graph, dens, streams, name, block)

    return density


def is_contraction(node) -> bool:
    return node.reduce == "sum" and bool(node.reduce_vars) and len(gating_accesses(node.body)) >= 2


@dataclass(frozen=True)
class _Context:
    graph: Graph
    members: frozenset[str]
    dens: Densities
    streams: dict
    block: int | None

    def density(self, name: str, inside: bool = True) -> float:
        if inside and name in self.members:
            return self.streams[name]
        return _memory_density(self.graph, self.dens, self.streams, name, self.block)


def _node_work(ctx: _Context, name: str) -> tuple[float, float, bool]:
    """(points, FLOPs per point, is a contraction) of one evaluation of the node."""
    node = ctx.graph.node_of[name]
    points = math.prod(node.extents.values()) * iteration_density(node, ctx.density)
    per_point = count_ops(node.body) + (1 if node.reduce_vars and not node.is_scatter else 0)
    return points, float(per_point), is_contraction(node)


def _traffic(ctx: _Context) -> tuple[dict[str, float], float]:
    """Bytes of each region input (by reader, to scale by recomputation) and of the outputs."""
    graph, members = ctx.graph, ctx.members
    inputs: dict[str, float] = {}
    out = 0.0
    for name in members:
        for t in graph.node_of[name].inputs:
            if t not in members and t not in inputs:
                inputs[t] = stored_bytes(graph, t, ctx.density(t, False), ctx.block)
        if name in graph.outputs or any(c not in members for c in graph.consumers.get(name, ())):
            out += stored_bytes(graph, name, ctx.density(name, False), ctx.block)
    return inputs, out


def _estimate_with(ctx: _Context, nodes: Sequence[str], nest: LoopNest, work, traffic, par, block,
                   stage_of: Mapping[str, int] | None = None) -> Estimate:
    flops = recomputed = gemm = 0.0
    busiest: dict[int, float] = {}
    reread: dict[str, float] = {}
    inputs, out_bytes = traffic
    for nn in nest.nests:
        points, per_point, contraction, reads = work[nn.node]
        w = points * per_point
        flops += w * nn.factor
        recomputed += w * max(0.0, nn.factor - 1.0)
        gemm += w * nn.factor if contraction else 0.0
        stage = (stage_of or {}).get(nn.node, 0)
        busiest[stage] = max(busiest.get(stage, 0.0), points * nn.factor)
        for t in reads:  # an input a recomputed node streams is read again per recomputation
            reread[t] = max(reread.get(t, 1.0), nn.factor)
    lanes = lane_count(nest.order, dict(nest.extents), par)
    # stages run one after another (an accumulator is read once it is complete), the nodes of a
    # stage as one pipeline paced by its busiest; a b x b tile token carries b^2 values at an
    # initiation interval of b (spec/dataflow.md)
    critical = sum(busiest.values()) / lanes / (block or 1)
    total_bytes = out_bytes + sum(b * reread.get(t, 1.0) for t, b in inputs.items())
    return Estimate(tuple(nodes), flops, total_bytes, recomputed, critical, gemm, 1, nest)


def pipeline_stages(graph: Graph, nodes: Sequence[str], prep, order: Sequence[str]) -> dict[str, int]:
    """Stage of each node in a dataflow region: a reduction whose outermost reduction variable
    the order puts outside one of its kept variables accumulates (a sparse accumulator or an
    on-chip buffer) and is read only once complete, so its consumers start a new stage, as do
    those of a buffered producer; other producers stream into their consumers token by token
    (same stage)."""
    pos = {u: k for k, u in enumerate(order)}
    own = {name: vars_ for name, vars_, _, _ in prep.rows}
    rvars = dict(prep.reduction_vars)
    members = set(nodes)
    stage: dict[str, int] = {}
    for name, _, _, _ in prep.rows:  # producers first (prepare sorts by graph order)
        s = 0
        for t in graph.node_of[name].inputs:
            if t in members:
                ends = t in prep.buffered or _accumulates(own[t], rvars.get(t), pos)
                s = max(s, stage[t] + (1 if ends else 0))
        stage[name] = s
    return stage


def _accumulates(own: frozenset, reduced: frozenset | None, pos: Mapping[str, int]) -> bool:
    if not reduced:
        return False
    kept = [pos[u] for u in own - reduced if u in pos]
    return bool(kept) and min(pos[u] for u in reduced if u in pos) < max(kept)


def estimate_region(graph: Graph, nodes: Sequence[str], dens: Densities, options: Mapping | None = None,
                    concordant_only: bool = True, score=None, hoist: bool | None = None,
                    buffered: frozenset[str] = frozenset()) -> Estimate:
    """Estimate a region under options {"order": k, "par": {level: lanes}, "block": b, "hoist":
    bool}. With no order, every legal order is tried and the one `score` (default: FLOPs) likes
    best is kept. `concordant_only=False` drops the storage-order constraints (a GPU kernel reads
    any order). `hoist` is the default of options["hoist"] (loopnest.py: True buffers nested
    reductions, False streams them inside their consumers, None places nodes by the order only);
    `buffered` names the nodes the target writes once on chip (never recomputed)."""
    options = dict(options or {})
    block, par = options.get("block"), options.get("par") or {}
    hoist = options.get("hoist", hoist)
    ctx = _Context(graph, frozenset(nodes), dens, _streams(graph, dens, block), block)
    rv = unify(graph, nodes)
    orders, concordant = legal_orders(graph, nodes, rv, constrained=concordant_only)
    pick = options.get("order")
    candidates = [orders[int(pick) % len(orders)]] if pick is not None else orders
    prep = prepare(graph, nodes, rv, ctx.density, buffered if hoist is not None else frozenset())
    traffic = _traffic(ctx)
    work = {}
    for name in nodes:
        reads = tuple(t for t in graph.node_of[name].inputs if t in traffic[0])
        work[name] = (*_node_work(ctx, name), reads)
    if prep.buffered:  # each walk its own order, as the target lowers it; a buffer's readers in the next stage
        def walk_orders(walk):
            return candidates if pick is not None else legal_orders(graph, walk, rv, constrained=concordant_only)[0]

        nest = analyse_walks(prep, walk_orders, concordant, hoist, {n: w[0] for n, w in work.items()})
        stages = pipeline_stages(graph, nodes, prep, nest.order)
        return _estimate_with(ctx, nodes, nest, work, traffic, par, block, stages)
    best = None
    for order in candidates:
        nest = analyse(prep, order, concordant, hoist)
        est = _estimate_with(ctx, nodes, nest, work, traffic, par, block)
        key = score(est) if score else (est.flops, est.bytes)
        if best is None or key < best[0]:
            best = (key, est, nest)
    if hoist is None:
        return best[1]
    # the order is picked as the target picks it (its work, every node pipelined); the cycles
    # of that order then count its accumulation stages one after another
    stages = pipeline_stages(graph, nodes, prep, best[2].order)
    return _estimate_with(ctx, nodes, best[2], work, traffic, par, block, stages)


def order_count(graph: Graph, nodes: Sequence[str]) -> int:
    return len(legal_orders(graph, nodes)[0])


class _Weighted(abc.ABC):
    """Cost = weights . features(estimate); calibrate() refits the weights."""

    weights: tuple[float, ...]
    feature_names: tuple[str, ...] = ()

    def cost(self, est: Estimate) -> float:
        return float(np.dot(self.weights, self.features(est)))

    def total(self, estimates: Sequence[Estimate]) -> float:
        """Cost of a configuration: its regions run one after another."""
        return sum(self.cost(e) for e in estimates)

    def config_features(self, estimates) -> tuple[float, ...]:
        if isinstance(estimates, Estimate):
            return self.features(estimates)
        return tuple(np.sum([self.features(e) for e in estimates], axis=0))

    @abc.abstractmethod
    def features(self, est: Estimate) -> tuple[float, ...]:
        """The quantities the model weighs (cycles, seconds of traffic, launches...)."""

    def calibrate(self, samples: Sequence[tuple], relative: bool = False):
        """Fit non-negative scale factors by least squares: measured ~ weights . features.
        A sample is (region Estimate or a configuration's list of them, measured value);
        `relative` weighs each sample by 1/measured (relative errors, whatever the sizes)."""
        if not samples:
            return self
        a = np.array([self.config_features(e) for e, _ in samples], dtype=float)
        y = np.array([m for _, m in samples], dtype=float)
        if relative:
            a, y = a / y[:, None], np.ones_like(y)
        cols = a.any(axis=0)  # a feature that never appears keeps its weight
        fitted, _ = nnls(a[:, cols], y)
        weights = np.array(self.weights, dtype=float)
        weights[cols] = fitted
        return replace(self, weights=tuple(float(w) for w in weights))


@dataclass(frozen=True)
class DataflowCostModel(_Weighted):
    """Static cycles on the dataflow target (see the module docstring)."""

    densities: Densities = Densities()
    bytes_per_cycle: float = 64.0  # one 64-byte memory beat per cycle (assumed; calibrate)
    startup_cycles: float = 20.0  # fill and drain of one region's pipeline (a few hops per primitive)
    weights: tuple[float, ...] = (1.0, 1.0)
    feature_names = ("region cycles", "region startups")
    unit = "cycles"
    target = "dataflow"

    def __str__(self) -> str:
        return f"dataflow static model ({self.densities}, weights {self.weights})"

    def estimate(self, graph: Graph, nodes: Sequence[str], options: Mapping | None = None) -> Estimate:
        # the dataflow target hoists by default (its option hoist=True) and buffers reused producers
        buffered = get_target("dataflow").buffered(graph, nodes, options)
        return estimate_region(graph, nodes, self.densities, options, True, self._order_score, hoist=True,
                               buffered=buffered)

    def _order_score(self, est: Estimate) -> float:
        return self.cost(est)

    def features(self, est: Estimate) -> tuple[float, ...]:
        return max(est.critical, est.bytes / self.bytes_per_cycle), est.regions * self.startup_cycles


REGION_OVERHEAD = 0.25  # a region's dispatch, in kernel launches


@dataclass(frozen=True)
class GpuCostModel(_Weighted):
    """Seconds on a GPU from a DeviceProfile; one launch per region."""

    densities: Densities = Densities()
    profile: DeviceProfile = DeviceProfile()
    weights: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0)
    feature_names = ("memory", "launches", "gemm", "fp32")
    unit = "seconds"
    target = "gpu"

    def __str__(self) -> str:
        return f"gpu model ({self.profile.name}, {self.densities}, weights {self.weights})"

    def estimate(self, graph: Graph, nodes: Sequence[str], options: Mapping | None = None) -> Estimate:
        """A dense region holding GEMMs step by step (`stepwise_estimate`), any other region as its
        fused loop nests."""
        steps = stepwise_estimate(graph, nodes, self.densities, options, self.cost)
        return steps if steps is not None else estimate_region(graph, nodes, self.densities, options, False, self.cost)

    def features(self, est: Estimate) -> tuple[float, ...]:
        p = self.profile
        # a region's own dispatch (a program step on the host) beside its launches: where cutting a
        # region saves nothing else, one region is cheaper than two
        launches = est.kernel_launches + REGION_OVERHEAD * est.regions
        return (est.bytes / p.copy_bandwidth, launches * p.launch_s, est.gemm_flops / p.gemm_rate,
                (est.flops - est.gemm_flops) / p.fp32_rate)


def stepwise_estimate(graph: Graph, nodes: Sequence[str], dens: Densities, options: Mapping | None = None,
                      score=None) -> Estimate | None:
    """A dense region as the gpu target runs it where it fuses nothing across a GEMM: each dense
    contraction a library call, the other nodes stitched kernels, one per connected piece, each step
    reading its inputs and writing what others read (the estimate's `launches` counts the steps).
    The fused loop-nest estimate charges a region holding GEMMs with recomputing their producers at
    every output point, which no GPU kernel does: a planner believing it cuts elementwise chains
    between GEMMs and stores the cut (a training step's softmax backward: its gradient in float32,
    512 MB, written and read back). None where the region holds no dense contraction or reads a
    sparse tensor (sparse products are the fused estimate's)."""
    if any(not graph.type_of[t].format.is_dense for n in nodes for t in graph.node_of[n].inputs):
        return None
    gemms = [n for n in nodes if is_contraction(graph.node_of[n])]
    if not gemms:
        return None
    rest = [n for n in nodes if n not in gemms]
    links = nx.Graph()
    links.add_nodes_from(rest)
    links.add_edges_from((t, n) for n in rest for t in graph.node_of[n].inputs if t in links)
    order = {name: k for k, name in enumerate(nodes)}
    parts = [[g] for g in gemms] + [sorted(p, key=order.__getitem__) for p in nx.connected_components(links)]
    ests = [_part_estimate(graph, tuple(part), dens, options, score) for part in parts]
    total = sum(ests[1:], ests[0])
    return replace(total, nodes=tuple(nodes), loop=None, regions=1, launches=float(len(parts)))


# graph id -> {(part, densities, options, score): Estimate}: a planner estimates thousands of candidate regions,
# and those holding GEMMs share most of their steps (a lone GEMM, a chain of elementwise nodes between two)
_PART_ESTIMATES: dict[int, dict] = {}


def _part_estimate(graph: Graph, part: tuple, dens: Densities, options: Mapping | None, score) -> Estimate:
    """estimate_region of one step of a stepwise estimate, once per graph (Estimates are immutable)."""
    cache = _PART_ESTIMATES.get(id(graph))
    if cache is None:
        cache = _PART_ESTIMATES[id(graph)] = {}
        weakref.finalize(graph, _PART_ESTIMATES.pop, id(graph), None)
    try:
        key = (part, dens, repr(sorted((options or {}).items())), score)
        hash(key)
    except TypeError:  # a score or densities that cannot be a key: estimated every time
        return estimate_region(graph, part, dens, options, False, score)
    if key not in cache:
        cache[key] = estimate_region(graph, part, dens, options, False, score)
    return cache[key]


# models whose estimate of a region is estimate_region's under their densities: it depends on the
# region only through what regionkey.RegionKeys keys on (subclasses may estimate otherwise)
STRUCTURAL = (DataflowCostModel, GpuCostModel)


def model_for(target: str, densities: Densities | None = None, profile: DeviceProfile | None = None):
    """The static cost model of a target: the gpu model for "gpu", else the dataflow model
    (the reference target runs anything; the dataflow estimate is the target-neutral one)."""
    densities = densities or Densities()
    if target == "gpu":
        return GpuCostModel(densities, profile or DeviceProfile())
    return DataflowCostModel(densities)
