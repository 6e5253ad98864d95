"""Plane and row statistics on Hopper thread-block clusters: the exchange through distributed shared memory.

A part whose reductions are a mean over whole planes and the centred variance riding on it (batch norm's
statistics over (N, H, W) around C in NCHW) runs as CUDA C++ here instead of Gluon, because Triton 3.6 has no
distributed shared memory (docs/cluster_planes_plan.md). A persistent grid of clusters of `cluster` CTAs walks the
channels; CTA r of a cluster holds planes r·planes .. (r+1)·planes - 1 of the channel in registers while the next
channel's planes stream into its shared memory by 1-D bulk copies. Each CTA pushes its piece's two statistics into
every peer's shared memory with `st.async`, completing bytes on the peer's mbarrier, so no release waits for stores
in flight and no statistic goes through L2 (measured by hand, scripts/batchnorm_cluster_probe.py: 153.8 µs against
165-167 through global memory). The epilogue (each output as an expression of x, the statistics, per-channel
parameters and other inputs at x's coordinates) is emitted from the IR, rounding every node to its dtype as eager
does (cluster_planes_emit).

A row too long for one program (a softmax over 65536 elements) takes the same kernel: the row is the channel, cut
into `cluster` contiguous pieces, and the pair exchanged is the piece's maximum and its sum of exp(a - max), which
the peers rescale to the row's maximum, where the Triton split meets its pieces through global memory.

`analyze` says why a part cannot take this path; `ClusterLaunch` compiles (torch's load_inline for sm_90a, cached
under $STITCHFLOW_CACHE/gpu/cuda) and runs it with the same interface as runtime.Launch.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from ...ir.expr import Call, Cast, Const, Read, reads
from ...ir.graph import Graph
from ...ir.index import Lit, Sum, Var, bounds
from .analysis import PartPlan
from .codegen_split import _bare, _scaled, centred_variances
from .cluster_planes_emit import BINARY, C_TYPES, INFIX, THREADS, UNARY, emit_module, needed_nodes
from .emit import contiguous_strides
from .mapping import MAX_ROW_IN_REGISTERS

MAX_PER_THREAD = 128  # elements of a piece one thread holds in registers (fp32)
MAX_PIECE_BYTES = 200 * 1024  # the next piece's buffer in shared memory
CLUSTERS = (8, 16, 4, 2)  # CTAs per channel, the portable size first; 16 needs the non-portable attribute
# Pieces of about 16K elements (64 registers a thread) did best: batch norm 64x256x56x56 fp32 (H100) with clusters
# of 16 x 12544 elements 152.3 µs, of 8 x 25088 153.6; group norm's 65536-element groups take 4 x 16384 and 8 x 8192
PREFERRED_PIECE = 16384


class ClusterRefusal(Exception):
    """A part (or a cluster size) this path cannot take; the message says why."""


@dataclass(frozen=True)
class Moments:
    """A mean over the reduced axes and, optionally, the centred variance riding on it (batch norm's statistics)."""
    mean: str
    mean_factor: float  # turns the exact mean into the node's value (1 for a mean)
    var: str | None = None
    var_factor: float = 0.0  # on the centred sum of squares
    kind = "moments"

    def __str__(self) -> str:
        return f"mean {self.mean}" + (f", variance {self.var}" if self.var else "")


@dataclass(frozen=True)
class MaxSumExp:
    """A maximum and the sum of exp(a - max) taken in its pass (a softmax's statistics, analysis._online_pairs)."""
    max: str
    sum: str
    kind = "softmax"

    def __str__(self) -> str:
        return f"max {self.max}, sum of exponentials {self.sum}"


@dataclass(frozen=True)
class ClusterPlan:
    """What the emitted kernel needs to know about the part."""
    x: str  # the planes' input, contiguous over (outer, channel, *plane) or (channel, outer, *plane)
    n: int  # planes per channel (the outer reduced axis; for a row, its pieces)
    channels: int
    plane: int  # elements of a plane
    planes: int  # planes per CTA
    cluster: int  # CTAs per channel
    stats: Moments | MaxSumExp
    params: tuple[tuple[str, str], ...]  # (tensor, offset expression in c): per-channel inputs
    streamed: tuple[str, ...]  # other inputs read at x's coordinates, loaded in the epilogue
    outputs: tuple[str, ...]
    channel_major: bool = False  # a channel's planes lie together (group norm's groups), else plane n of
    # every channel before plane n + 1 (batch norm's NCHW)
    view: str | None = None  # the part node that reads x as (channel, outer, *plane) (group norm's grouping)
    plane_params: tuple[tuple[str, str], ...] = ()  # (tensor, offset in c and n): inputs per plane
    rows: bool = False  # one contiguous reduced axis (a long row) cut into `cluster` pieces

    def __str__(self) -> str:
        if self.rows:
            where = (f"cluster of {self.cluster} pieces of {self.plane} per row of {self.n * self.plane}, "
                     f"{self.channels} rows")
        else:
            order = "channel-major" if self.channel_major else "outer-major"
            where = (f"cluster of {self.cluster} x {self.planes} planes of {self.plane} over {self.channels} channels, "
                     f"{order}")
        return f"{where} ({self.x}: {self.stats} -> {', '.join(self.outputs)})"


def analyze(graph: Graph, plan: PartPlan, strides: dict, cluster: int) -> ClusterPlan:
    """The cluster plan of `plan` with `cluster` CTAs per channel, or ClusterRefusal with the reason.

    The channel is the part's parallel axes flattened; its planes are the outer reduced axis; a plane is the
    inner reduced axes, contiguous. Batch norm over NCHW reads x at (outer, channel, plane); group norm reads
    it through a view node as (channel = (image, group), outer = channel in group, plane). A part with one
    reduced axis, contiguous and too long for one program (a softmax over 65536 elements), takes its rows as
    channels, each cut into `cluster` contiguous pieces."""
    if plan.p_contiguous or not plan.L:
        raise ClusterRefusal("cluster planes need contiguous reduced axes around the channel, as in NCHW or a row")
    chans = tuple(c for c in plan.P if plan.extents[c] > 1)
    if not chans:
        raise ClusterRefusal("cluster planes need a parallel (channel) axis")
    channels = math.prod(plan.extents[c] for c in chans)
    stats, src, full = _statistics(graph, plan)
    rows = len(plan.L) == 1
    n, plane, channel_major = _row_geometry(plan, chans, full, src, cluster) if rows else \
        _plane_geometry(plan, chans, full, src)
    x, view = _source(graph, plan, src)
    if rows and view:
        raise ClusterRefusal(f"the row is read through the view {view}")
    _check_layout(graph, plan, strides, x, view or src, full)
    if n % cluster:
        raise ClusterRefusal(f"{n} planes per channel do not split over clusters of {cluster}")
    planes, dtype = n // cluster, graph.type_of[x].dtype
    if (plane * dtype.itemsize) % 16:
        raise ClusterRefusal(f"planes of {plane} x {dtype} are not whole 16-byte vectors (bulk copies)")
    if planes * plane > MAX_PER_THREAD * THREADS or planes * plane * dtype.itemsize > MAX_PIECE_BYTES:
        raise ClusterRefusal(f"a piece of {planes} planes of {plane} over {THREADS} threads exceeds "
                             f"{MAX_PER_THREAD} registers or {MAX_PIECE_BYTES} bytes of shared memory per CTA")
    params, plane_params, streamed = _inputs(graph, plan, strides, src, x, view, full, chans)
    if rows and plane_params:
        raise ClusterRefusal(f"{', '.join(t for t, _ in plane_params)} vary along the row but are not read at "
                             f"{src}'s coordinates")
    if isinstance(stats, MaxSumExp):
        _check_terms(plan, stats, src)
    outputs = tuple(plan.outputs)
    for o in outputs:
        if o in plan.row_level or _own_classes(plan, graph.node_of[o], graph.node_of[o].index) != full:
            raise ClusterRefusal(f"output {o} is not elementwise over {src}'s coordinates")
        if graph.type_of[o].dtype not in C_TYPES:
            raise ClusterRefusal(f"output {o} is {graph.type_of[o].dtype}, not a float type")
    for node in plan.nodes:
        if node.name != view:
            if node.reduce is None and node.name not in plan.row_level and _own_classes(plan, node, node.index) != full:
                raise ClusterRefusal(f"{node.name} is not indexed by {src}'s coordinates")
            if node.reduce is None or isinstance(stats, MaxSumExp):  # a softmax prints its reductions' bodies
                _check_expr(graph, plan, node, node.body, full, chans, src)
    return ClusterPlan(x, n, channels, plane, planes, cluster, stats, params, streamed, outputs, channel_major, view,
                       plane_params, rows)


def _plane_geometry(plan: PartPlan, chans: tuple, full: tuple, src: str) -> tuple[int, int, bool]:
    """(planes per channel, elements of a plane, channel-major) of reduced axes (outer, *plane)."""
    outer, run = plan.L[0], tuple(plan.L[1:])
    if full == (outer, *chans, *run):
        channel_major = False
    elif full == (*chans, outer, *run):
        channel_major = True
    else:
        raise ClusterRefusal(f"{src} is read as classes {full}, not (outer, channel, *plane) or (channel, outer, "
                             "*plane)")
    return plan.extents[outer], math.prod(plan.extents[c] for c in run), channel_major


def _row_geometry(plan: PartPlan, chans: tuple, full: tuple, src: str, cluster: int) -> tuple[int, int, bool]:
    """A row as `cluster` adjacent pieces: (pieces, elements of a piece, channel-major)."""
    (row,) = plan.L
    length = plan.extents[row]
    if tuple(c for c in full if plan.extents[c] > 1 or c == row) != (*chans, row):  # axes of 1 aside
        raise ClusterRefusal(f"{src} is read as classes {full}, not (row, element)")
    if length <= MAX_ROW_IN_REGISTERS:
        raise ClusterRefusal(f"a row of {length} fits one program ({MAX_ROW_IN_REGISTERS} elements in registers)")
    if length % cluster:
        raise ClusterRefusal(f"a row of {length} does not split over clusters of {cluster}")
    return cluster, length // cluster, True


def _statistics(graph: Graph, plan: PartPlan):
    """(the statistics, the tensor they read, its classes): the part's reductions must be one mean over the reduced
    axes of an input (or of a view of one) and, optionally, the centred variance on it
    (codegen_split.centred_variances); or a maximum of an expression of one input and the sum of exp(a - max)
    riding on it (a softmax)."""
    online = plan.online or {}
    if len(plan.reductions) == 2 and len(online) == 1:
        (total, largest), = online.items()
        return MaxSumExp(largest, total), *_source_of(graph, plan, graph.node_of[largest], largest)
    variances = centred_variances(graph, plan)
    means = [r for r in plan.reductions if r.name not in variances]
    if len(means) != 1 or len(variances) > 1 or any(r.reduce != "sum" for r in plan.reductions):
        raise ClusterRefusal("cluster planes take one mean and at most the centred variance on it, or a softmax's "
                             "max and sum of exponentials, not " + ", ".join(f"{r.reduce} {r.name}"
                                                                             for r in plan.reductions))
    r = means[0]
    body = _bare(r.body)
    inner, scale = (body, 1.0) if isinstance(body, Read) else (_scaled(body) or (None, 0.0))
    inner = _bare(inner) if inner is not None else None
    if not isinstance(inner, Read) or (inner.access.tensor in graph.node_of
                                       and not isinstance(graph.node_of[inner.access.tensor].body, Read)):
        raise ClusterRefusal(f"{r.name} is not a sum of an input's elements")
    full = _own_classes(plan, r, inner.access.indices)
    if full is None or None in full or len(set(full)) != len(full):
        raise ClusterRefusal(f"{r.name} reads {inner.access} away from its own coordinates")
    var, var_factor = None, 0.0
    for name, (of, c) in variances.items():
        if of != r.name:
            raise ClusterRefusal(f"the variance {name} is not centred on {r.name}")
        var, var_factor = name, c
    return Moments(r.name, scale * plan.L_total, var, var_factor), inner.access.tensor, full


def _source_of(graph: Graph, plan: PartPlan, node, name: str) -> tuple[str, tuple]:
    """(the one input a maximum's body reads, directly or through the part's elementwise nodes; its classes)."""
    readers = [(n, a) for n in (node, *needed_nodes(plan, node.body)) for a in reads(n.body)
               if a.tensor not in {m.name for m in plan.nodes}]
    if len({a.tensor for _, a in readers}) != 1 or readers[0][1].tensor in graph.node_of:
        raise ClusterRefusal(f"the maximum {name} is not taken over an expression of one input")
    reader, access = readers[0]
    full = _own_classes(plan, reader, access.indices)
    if full is None or None in full or len(set(full)) != len(full):
        raise ClusterRefusal(f"{name} reads {access} away from its own coordinates")
    return access.tensor, full


def _check_terms(plan: PartPlan, stats: MaxSumExp, src: str) -> None:
    """A softmax's terms are summed before the exchange, so they may read only the input, the piece's maximum
    and the part's elementwise nodes of those."""
    part = {n.name: n for n in plan.nodes}
    for node in [part[stats.sum], *needed_nodes(plan, part[stats.sum].body)]:
        for a in reads(node.body):
            if a.tensor not in (src, stats.max) and (a.tensor not in part or a.tensor in plan.row_level):
                raise ClusterRefusal(f"{node.name} reads {a.tensor}, which the sum of exponentials cannot "
                                     "read before the exchange")


def _source(graph: Graph, plan: PartPlan, src: str) -> tuple[str, str | None]:
    """(the input whose planes are copied, the view node reading it or None)."""
    if src not in graph.node_of:
        return src, None
    view = graph.node_of[src]
    if view.name not in {m.name for m in plan.nodes} or view.reduce is not None:
        raise ClusterRefusal(f"{src} is computed outside this part")
    x = view.body.access.tensor
    if x in graph.node_of:
        raise ClusterRefusal(f"{src} views {x}, which is not an input")
    return x, view.name


def _check_layout(graph: Graph, plan: PartPlan, strides: dict, x: str, reader: str, full: tuple) -> None:
    """x, as its reader (the mean, or the view node) addresses it, must be contiguous in the order `full`."""
    ty = graph.type_of[x]
    if ty.dtype not in C_TYPES:
        raise ClusterRefusal(f"{x} is {ty.dtype}, not a float type")
    node = graph.node_of[reader] if reader in graph.node_of else None
    if node is None:  # x read directly: by the mean
        shape = tuple(plan.extents[c] for c in full)
        if tuple(ty.shape) != shape or tuple(strides[x]) != contiguous_strides(shape):
            raise ClusterRefusal(f"{x} is not a contiguous {list(shape)} tensor (outer, channel, plane)")
        return
    coef = _coefficients(plan, node, node.body.access.indices, ty.shape, strides[x])
    want = dict(zip(full, contiguous_strides(tuple(plan.extents[c] for c in full))))
    if coef != want:
        raise ClusterRefusal(f"{node.name} does not read {x} contiguously in the order of its classes {full}")


def _coefficients(plan: PartPlan, node, indices, shape, strides) -> dict | None:
    """{class: address stride} of tensor[indices] as node reads it, if the address is affine in whole classes
    with no offset and every index in range of `shape` (None: not checked); else None."""
    coef: dict = {}
    for idx, size, stride in zip(indices, shape or [None] * len(indices), strides):
        if isinstance(idx, Lit):
            if idx.value:
                return None
            continue
        terms = idx.terms if isinstance(idx, Sum) else ((1, idx),)
        if isinstance(idx, Sum) and idx.const or size is not None and bounds(idx, node.extents)[1] > size - 1:
            return None
        for c, v in terms:
            cls = plan.cls.get((node.name, v.name)) if isinstance(v, Var) else None
            if cls is None or c < 0 or node.extents.get(v.name) != plan.extents[cls]:
                return None
            if plan.extents[cls] > 1:
                coef[cls] = coef.get(cls, 0) + c * stride
    return coef


def _own_classes(plan: PartPlan, node, indices) -> tuple | None:
    if not all(isinstance(i, Var) for i in indices):
        return None
    return tuple(plan.cls.get((node.name, i.name)) for i in indices)


def _offset(plan: PartPlan, node, indices, strides, chans: tuple, outer: int | None) -> str | None:
    """The address of tensor[indices] as C in the flattened channel `c` (and the plane's outer index `n` where
    `outer` is given), or None where it depends on other classes."""
    coef = _coefficients(plan, node, indices, None, strides)
    if coef is None or any(k not in chans and k != outer for k in coef):
        return None
    terms = []
    for pos, k in enumerate(chans):
        if k not in coef:
            continue
        below = math.prod(plan.extents[o] for o in chans[pos + 1:])
        coord = "c" if below == 1 else f"(c / {below})"
        coord = coord if pos == 0 else f"({coord} % {plan.extents[k]})"
        terms.append(f"{coord} * {coef[k]}")
    if outer in coef:
        terms.append(f"n * {coef[outer]}")
    return " + ".join(terms) or "0"


def _inputs(graph: Graph, plan: PartPlan, strides: dict, src: str, x: str, view: str | None, full: tuple,
            chans: tuple):
    """Per-channel parameters (tensor, offset of channel c), per-plane ones (offset in c and n), and inputs
    streamed at x's coordinates."""
    part = {n.name for n in plan.nodes}
    params: dict[str, str] = {}
    plane_params: dict[str, str] = {}
    streamed: list[str] = []
    for node in plan.nodes:
        if node.reduce is not None or node.name == view:
            continue
        for a in reads(node.body):
            t = a.tensor
            if t in part or t == src:
                continue
            channel = _offset(plan, node, a.indices, strides[t], chans, None)
            per_plane = None if channel is not None else _offset(plan, node, a.indices, strides[t], chans, plan.L[0])
            if channel is not None:
                if params.get(t, channel) != channel:
                    raise ClusterRefusal(f"{t} is read at two different per-channel offsets")
                params[t] = channel
            elif per_plane is not None:
                if plane_params.get(t, per_plane) != per_plane:
                    raise ClusterRefusal(f"{t} is read at two different per-plane offsets")
                plane_params[t] = per_plane
            elif view is None and _own_classes(plan, node, a.indices) == full:
                _check_layout(graph, plan, strides, t, src, full)
                if t not in streamed:
                    streamed.append(t)
            else:
                raise ClusterRefusal(f"{node.name} reads {a} neither per channel, per plane nor at {src}'s "
                                     "coordinates")
            if graph.type_of[t].dtype not in C_TYPES:
                raise ClusterRefusal(f"{t} is {graph.type_of[t].dtype}, not a float type")
    return tuple(params.items()), tuple(plane_params.items()), tuple(streamed)


def _check_expr(graph: Graph, plan: PartPlan, node, e, full, chans, x) -> None:
    """Refuse what the CUDA printer cannot say, and reads of part nodes at other coordinates."""
    if isinstance(e, Cast):
        if e.dtype not in C_TYPES and e.dtype != torch.bool:
            raise ClusterRefusal(f"{node.name} casts to {e.dtype}")
        return _check_expr(graph, plan, node, e.arg, full, chans, x)
    if isinstance(e, Call):
        if e.op not in INFIX and e.op not in UNARY and e.op not in BINARY and e.op != "where":
            raise ClusterRefusal(f"{node.name}: scalar op {e.op} has no CUDA lowering here")
        for a in e.args:
            _check_expr(graph, plan, node, a, full, chans, x)
    elif isinstance(e, Read):
        t, idx = e.access.tensor, e.access.indices
        per_row = node.name in plan.row_level and node.reduce is None  # a reduction reads at its own point
        if t == x and (per_row or _own_classes(plan, node, idx) != full):
            raise ClusterRefusal(f"{node.name} reads {e.access} away from its own coordinates")
        if t not in graph.node_of:
            return  # other inputs: _inputs
        if t in plan.row_level:
            own = [plan.cls.get((node.name, i.name)) if isinstance(i, Var) else None for i in idx]
            if any(not isinstance(i, Lit) and (c is None or c not in chans and plan.extents[c] != 1)
                   for i, c in zip(idx, own)):
                raise ClusterRefusal(f"{node.name} reads {e.access} away from its channel")
        elif _own_classes(plan, node, idx) != full or per_row:
            raise ClusterRefusal(f"{node.name} reads {e.access} at other coordinates")
    elif not isinstance(e, Const):
        raise ClusterRefusal(f"{node.name}: {type(e).__name__} has no CUDA lowering here")
    if graph.type_of[node.name].dtype not in (*C_TYPES, torch.bool):
        raise ClusterRefusal(f"{node.name} is {graph.type_of[node.name].dtype}, not a float type")


# ---------------------------------------------------------------- compile and launch

_EXTENSIONS: dict = {}


def unavailable(device: torch.device) -> str | None:
    """Why cluster kernels cannot run on `device` (None: they can)."""
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    if device.type != "cuda":
        return "cluster planes run on CUDA devices"
    if torch.cuda.get_device_capability(device)[0] < 9:
        return "thread-block clusters and distributed shared memory need Hopper (sm_90) or later"
    if CUDA_HOME is None:
        return "no CUDA toolkit (nvcc) to compile cluster kernels with (set CUDA_HOME)"
    if not is_ninja_available():
        return "torch's load_inline needs ninja to compile cluster kernels (pip install ninja)"
    return None


def load(cuda: str, glue: str, cache: str):
    """Compile (nvcc for sm_90a, through torch's load_inline) once per source; builds stay under `cache`."""
    key = hashlib.sha256((cuda + glue).encode()).hexdigest()[:20]
    if key not in _EXTENSIONS:
        import os

        from torch.utils.cpp_extension import load_inline

        build = os.path.join(cache, f"planes_{key}")
        os.makedirs(build, exist_ok=True)
        _EXTENSIONS[key] = load_inline(
            name=f"stitchflow_planes_{key}", cpp_sources=[glue], cuda_sources=[cuda], functions=["run"],
            extra_cuda_cflags=["-O3", "-gencode=arch=compute_90a,code=sm_90a", "-std=c++17"],
            build_directory=build, verbose=False)
    return _EXTENSIONS[key]


class ClusterLaunch:
    """Runs one variant of a compiled cluster-planes module with runtime.Launch's interface: outputs
    allocated (contiguous), written into `env`."""

    def __init__(self, graph: Graph, plan: PartPlan, plans: list[ClusterPlan], variant: int, title: str,
                 cache: str, launches=None):
        self.cp, self.variant, self.title, self.launches = plans[variant], variant, title, launches
        self.cuda, self.glue = emit_module(graph, plan, plans)
        self.ext = load(self.cuda, self.glue, cache)
        self.inputs = (self.cp.x, *dict(self.cp.params), *dict(self.cp.plane_params), *self.cp.streamed)
        self.out_specs = [(graph.type_of[t].shape, graph.type_of[t].dtype) for t in self.cp.outputs]
        self.clusters: dict = {}  # device -> clusters launched (the channels, or as many as fit at once)

    def _clusters(self, device, stream: int) -> int:
        if device not in self.clusters:
            fits = self.ext.run([torch.empty(0, device=device)], ~self.variant, 0, stream)
            if fits < 1:
                raise ClusterRefusal(f"not one cluster of {self.cp.cluster} CTAs fits on {device}")
            self.clusters[device] = min(fits, self.cp.channels)
        return self.clusters[device]

    def __call__(self, env) -> None:
        ins = [env[t] for t in self.inputs]
        device = ins[0].device
        outs = [torch.empty(shape, dtype=dt, device=device) for shape, dt in self.out_specs]
        stream = torch.cuda.current_stream(device).cuda_stream
        self.ext.run(ins + outs, self.variant, self._clusters(device, stream), stream)
        if self.launches is not None:
            self.launches[self.title] += 1
        for name, value in zip(self.cp.outputs, outs):
            env[name] = value


def cluster_plans(graph: Graph, plan: PartPlan, strides: dict) -> tuple[list[ClusterPlan], list[str]]:
    """The cluster sizes this part can take (plans), pieces nearest PREFERRED_PIECE elements first (the larger
    cluster on a tie), and why each other size cannot (refusals)."""
    plans, why = [], []
    for size in CLUSTERS:
        try:
            plans.append(analyze(graph, plan, strides, size))
        except ClusterRefusal as err:
            why.append(f"cluster of {size}: {err}")
    plans.sort(key=lambda cp: (abs(math.log2(cp.planes * cp.plane / PREFERRED_PIECE)), -cp.cluster))
    return plans, why
