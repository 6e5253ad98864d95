"""Plane statistics on Hopper thread-block clusters: batch norm's exchange through distributed shared memory.

A part whose reductions are a mean over whole planes and the centred variance riding on it (batch norm's
statistics over (N, H, W) around C in NCHW) runs as CUDA C++ here instead of Gluon, because Triton 3.6 has no
distributed shared memory (docs/cluster_planes_plan.md). A persistent grid of clusters of `cluster` CTAs walks the
channels; CTA r of a cluster holds planes r·planes .. (r+1)·planes - 1 of the channel in registers while the next
channel's planes stream into its shared memory by 1-D bulk copies. Each CTA pushes its piece's mean and centred sum
of squares into every peer's shared memory with `st.async`, completing bytes on the peer's mbarrier, so no release
waits for stores in flight and no statistic goes through L2 (measured by hand, scripts/batchnorm_cluster_probe.py:
153.8 µs against 165-167 through global memory). The statistics and the exchange are fixed; the epilogue (each
output as an expression of x, the two statistics, per-channel parameters and other inputs at x's coordinates) is
emitted from the IR, rounding every node to its dtype as eager does.

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
from .cluster_planes_cuda import GLUE, HEADER, KERNEL
from .emit import contiguous_strides

THREADS = 256
MAX_PER_THREAD = 128  # elements of a piece one thread holds in registers (fp32)
MAX_PIECE_BYTES = 200 * 1024  # the next piece's buffer in shared memory
CLUSTERS = (8, 16, 4, 2)  # CTAs per channel, the portable size first; 16 needs the non-portable attribute
# Pieces of about 16K elements (64 registers a thread) did best: batch norm 64x256x56x56 fp32 (H100) with clusters
# of 16 x 12544 elements 152.3 µs, of 8 x 25088 153.6; group norm's 65536-element groups take 4 x 16384 and 8 x 8192
PREFERRED_PIECE = 16384
C_TYPES = {torch.float32: "float", torch.bfloat16: "__nv_bfloat16", torch.float16: "__half"}
ROUND = {torch.bfloat16: "rnd_bf16", torch.float16: "rnd_f16"}
INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
         "eq": "==", "ne": "!=", "and": "&&", "or": "||"}
UNARY = {"neg": "(-{0})", "abs": "fabsf({0})", "exp": "expf({0})", "log": "logf({0})", "sqrt": "sqrtf({0})",
         "rsqrt": "rsqrtf({0})", "recip": "(1.0f / {0})", "tanh": "tanhf({0})", "erf": "erff({0})",
         "sigmoid": "(1.0f / (1.0f + expf(-{0})))", "not": "(!{0})", "sin": "sinf({0})", "cos": "cosf({0})",
         "floor": "floorf({0})", "ceil": "ceilf({0})", "round": "rintf({0})", "log1p": "log1pf({0})",
         "expm1": "expm1f({0})",
         # torch keeps a NaN where fmaxf and fminf drop it
         "relu": "({0} != {0} ? {0} : fmaxf({0}, 0.0f))"}
BINARY = {"max": "({0} != {0} || {1} != {1} ? {0} + {1} : fmaxf({0}, {1}))",
          "min": "({0} != {0} || {1} != {1} ? {0} + {1} : fminf({0}, {1}))", "pow": "powf({0}, {1})",
          "atan2": "atan2f({0}, {1})"}
# Nodes rounded to bfloat16 or float16 take the special-function unit's approximations (a few ulp of float32,
# far below half a bf16 step), as the Triton path does: group norm's SiLU epilogue with expf and an IEEE division
# issued ~30 instructions an element, as many cycles as its bytes take at copy bandwidth with 8-16 warps an SM.
FAST = {"exp": "__expf({0})", "sigmoid": "__fdividef(1.0f, 1.0f + __expf(-{0}))", "recip": "__fdividef(1.0f, {0})",
        "div": "__fdividef({0}, {1})"}


class ClusterRefusal(Exception):
    """A part (or a cluster size) this path cannot take; the message says why."""


@dataclass(frozen=True)
class ClusterPlan:
    """What the emitted kernel needs to know about the part."""
    x: str  # the planes' input, contiguous over (outer, channel, *plane) or (channel, outer, *plane)
    n: int  # planes per channel (the outer reduced axis)
    channels: int
    plane: int  # elements of a plane
    planes: int  # planes per CTA
    cluster: int  # CTAs per channel
    mean: str  # the mean reduction and the factor that turns the exact mean into its value (1 for a mean)
    mean_factor: float
    var: str | None  # the centred variance riding on it, and the factor on the centred sum of squares
    var_factor: float
    params: tuple[tuple[str, str], ...]  # (tensor, offset expression in c): per-channel inputs
    streamed: tuple[str, ...]  # other inputs read at x's coordinates, loaded in the epilogue
    outputs: tuple[str, ...]
    channel_major: bool = False  # a channel's planes lie together (group norm's groups), else plane n of
    # every channel before plane n + 1 (batch norm's NCHW)
    view: str | None = None  # the part node that reads x as (channel, outer, *plane) (group norm's grouping)
    plane_params: tuple[tuple[str, str], ...] = ()  # (tensor, offset in c and n): inputs per plane

    def __str__(self) -> str:
        order = "channel-major" if self.channel_major else "outer-major"
        return (f"cluster of {self.cluster} x {self.planes} planes of {self.plane} over {self.channels} channels, "
                f"{order} ({self.x}: {self.mean}{', ' + self.var if self.var else ''} -> {', '.join(self.outputs)})")


def analyze(graph: Graph, plan: PartPlan, strides: dict, cluster: int) -> ClusterPlan:
    """The cluster plan of `plan` with `cluster` CTAs per channel, or ClusterRefusal with the reason.

    The channel is the part's parallel axes flattened; its planes are the outer reduced axis; a plane is the
    inner reduced axes, contiguous. Batch norm over NCHW reads x at (outer, channel, plane); group norm reads
    it through a view node as (channel = (image, group), outer = channel in group, plane)."""
    if plan.p_contiguous or len(plan.L) < 2:
        raise ClusterRefusal("cluster planes need reduced axes (outer, *plane) around the channel, as in NCHW")
    chans = tuple(c for c in plan.P if plan.extents[c] > 1)
    if not chans:
        raise ClusterRefusal("cluster planes need a parallel (channel) axis")
    outer, run = plan.L[0], tuple(plan.L[1:])
    n, channels = plan.extents[outer], math.prod(plan.extents[c] for c in chans)
    plane = math.prod(plan.extents[c] for c in run)
    mean, mean_factor, var, var_factor, src, full = _statistics(graph, plan)
    if full == (outer, *chans, *run):
        channel_major = False
    elif full == (*chans, outer, *run):
        channel_major = True
    else:
        raise ClusterRefusal(f"{src} is read as classes {full}, not (outer, channel, *plane) or (channel, outer, "
                             "*plane)")
    x, view = _source(graph, plan, src)
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
    outputs = tuple(plan.outputs)
    for o in outputs:
        if o in plan.row_level or _own_classes(plan, graph.node_of[o], graph.node_of[o].index) != full:
            raise ClusterRefusal(f"output {o} is not elementwise over {src}'s coordinates")
        if graph.type_of[o].dtype not in C_TYPES:
            raise ClusterRefusal(f"output {o} is {graph.type_of[o].dtype}, not a float type")
    for node in plan.nodes:
        if node.reduce is None and node.name != view:
            if node.name not in plan.row_level and _own_classes(plan, node, node.index) != full:
                raise ClusterRefusal(f"{node.name} is not indexed by {src}'s coordinates")
            _check_expr(graph, plan, node, node.body, full, chans, src)
    return ClusterPlan(x, n, channels, plane, planes, cluster, mean, mean_factor, var, var_factor, params,
                       streamed, outputs, channel_major, view, plane_params)


def _statistics(graph: Graph, plan: PartPlan):
    """(mean, factor, variance or None, factor, the tensor summed, its classes): the part's reductions must be
    one mean over whole planes of an input (or of a view of one) and, optionally, the centred variance on it
    (codegen_split.centred_variances)."""
    variances = centred_variances(graph, plan)
    means = [r for r in plan.reductions if r.name not in variances]
    if len(means) != 1 or len(variances) > 1 or any(r.reduce != "sum" for r in plan.reductions):
        raise ClusterRefusal("cluster planes take one mean and at most the centred variance on it, not "
                             + ", ".join(f"{r.reduce} {r.name}" for r in plan.reductions))
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
    return r.name, scale * plan.L_total, var, var_factor, inner.access.tensor, full


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
        if t == x and (node.name in plan.row_level or _own_classes(plan, node, idx) != full):
            raise ClusterRefusal(f"{node.name} reads {e.access} away from its own coordinates")
        if t not in graph.node_of:
            return  # other inputs: _inputs
        if t in plan.row_level:
            own = [plan.cls.get((node.name, i.name)) if isinstance(i, Var) else None for i in idx]
            if any(not isinstance(i, Lit) and (c is None or c not in chans and plan.extents[c] != 1)
                   for i, c in zip(idx, own)):
                raise ClusterRefusal(f"{node.name} reads {e.access} away from its channel")
        elif _own_classes(plan, node, idx) != full or node.name in plan.row_level:
            raise ClusterRefusal(f"{node.name} reads {e.access} at other coordinates")
    elif not isinstance(e, Const):
        raise ClusterRefusal(f"{node.name}: {type(e).__name__} has no CUDA lowering here")
    if graph.type_of[node.name].dtype not in (*C_TYPES, torch.bool):
        raise ClusterRefusal(f"{node.name} is {graph.type_of[node.name].dtype}, not a float type")


# ---------------------------------------------------------------- the CUDA printer

def _const(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    v = float(v)
    if math.isnan(v):
        return "NAN"
    if math.isinf(v):
        return "INFINITY" if v > 0 else "(-INFINITY)"
    return f"{v!r}f"


class _Printer:
    """CUDA expressions over named values: `names` maps a tensor to the C name of its value at the point."""

    def __init__(self, graph: Graph, names: dict):
        self.graph, self.names = graph, names
        self.fast = False  # printing a node rounded to a 16-bit float (FAST)

    def expr(self, e) -> str:
        if isinstance(e, Read):
            return self.names[e.access.tensor]
        if isinstance(e, Const):
            return _const(e.value)
        if isinstance(e, Cast):
            inner = self.expr(e.arg)
            if e.dtype == torch.bool:
                return f"({inner} != 0)"
            return f"{ROUND[e.dtype]}({inner})" if e.dtype in ROUND else f"((float){inner})"
        args = [self.expr(a) for a in e.args]
        if self.fast and e.op in FAST:
            return FAST[e.op].format(*args)
        if e.op in INFIX:
            return f"({args[0]} {INFIX[e.op]} {args[1]})"
        if e.op in UNARY:
            return UNARY[e.op].format(*args)
        if e.op == "pow" and isinstance(_bare(e.args[1]), Const) and _bare(e.args[1]).value == 2:
            return f"({args[0]} * {args[0]})"
        if e.op in BINARY:
            return BINARY[e.op].format(*args)
        return f"({args[0]} ? {args[1]} : {args[2]})"  # where

    def define(self, name: str, body, c_name: str, code: str | None = None) -> str:
        """`const T c_name = body;` (or `code`) rounded to the node's dtype, remembered for later reads."""
        dtype = self.graph.type_of[name].dtype
        self.fast = dtype in ROUND
        try:
            code = code or self.expr(body)
        finally:
            self.fast = False
        if dtype in ROUND:
            code = f"{ROUND[dtype]}({code})"
        self.names[name] = c_name
        return f"const {'bool' if dtype == torch.bool else 'float'} {c_name} = {code};"


def _ident(prefix: str, name: str, taken: set) -> str:
    base = prefix + "".join(ch if ch.isalnum() else "_" for ch in name)
    out, k = base, 1
    while out in taken:
        out, k = f"{base}_{k}", k + 1
    taken.add(out)
    return out


def emit_source(graph: Graph, plan: PartPlan, cp: ClusterPlan, name: str = "planes_kernel") -> str:
    """The CUDA source of `cp`: the fixed statistics and exchange, the epilogue printed from the IR."""
    taken: set = {"xv", "n"}
    names = {cp.x: "xv", **({cp.view: "xv"} if cp.view else {})}
    printer = _Printer(graph, names)
    per_plane = dict(cp.plane_params)
    ctype = {t: C_TYPES[graph.type_of[t].dtype] for t in (cp.x, *dict(cp.params), *per_plane, *cp.streamed,
                                                          *cp.outputs)}
    params, casts, param_loads, plane_loads = [], [f"(const {ctype[cp.x]}*)ptrs[0], "], [], []
    for k, (t, offset) in enumerate((*cp.params, *cp.plane_params)):
        arg = _ident("in_", t, taken)
        params.append(f"const {ctype[t]}* __restrict__ {arg}, ")
        casts.append(f"(const {ctype[t]}*)ptrs[{1 + k}], ")
        names[t] = _ident("p_", t, taken)
        (plane_loads if t in per_plane else param_loads).append(
            f"{'        ' if t in per_plane else '    '}const float {names[t]} = to_f({arg}[{offset}]);")
    if plane_loads:
        plane_loads.insert(0, "        const int n = n0 + p;")
    vec_loads, element, vec_stores = [], [], []
    first_streamed = 1 + len(cp.params) + len(per_plane)
    for k, t in enumerate(cp.streamed):
        arg, vec = _ident("in_", t, taken), _ident("vec_", t, taken)
        params.append(f"const {ctype[t]}* __restrict__ {arg}, ")
        casts.append(f"(const {ctype[t]}*)ptrs[{first_streamed + k}], ")
        vec_loads.append(f"        const Vec<{ctype[t]}, VEC> {vec} = reinterpret_cast<const Vec<{ctype[t]}, VEC>*>"
                         f"({arg})[off];")
        names[t] = _ident("e_", t, taken)
        element.append(f"          const float {names[t]} = to_f({vec}.a[e]);")
    first_out = first_streamed + len(cp.streamed)
    out_vecs = {}
    for k, t in enumerate(cp.outputs):
        arg = _ident("out_", t, taken)
        params.append(f"{ctype[t]}* __restrict__ {arg}, ")
        casts.append(f"({ctype[t]}*)ptrs[{first_out + k}], ")
        out_vecs[t] = _ident("o_", t, taken)
        vec_loads.append(f"        Vec<{ctype[t]}, VEC> {out_vecs[t]};")
        vec_stores.append(f"        reinterpret_cast<Vec<{ctype[t]}, VEC>*>({arg})[off] = {out_vecs[t]};")
    mean = "mean" if abs(cp.mean_factor - 1) < 1e-12 else f"(mean * {_const(cp.mean_factor)})"
    row = [f"    {printer.define(cp.mean, None, _ident('s_', cp.mean, taken), mean)}"]
    if cp.var:
        row.append(f"    {printer.define(cp.var, None, _ident('s_', cp.var, taken), f'(m2 * {_const(cp.var_factor)})')}")
    for node in plan.nodes:
        if node.reduce is not None or node.name == cp.view:
            continue
        if node.name in plan.row_level:
            row.append(f"    {printer.define(node.name, node.body, _ident('s_', node.name, taken))}")
        else:
            element.append(f"          {printer.define(node.name, node.body, _ident('v_', node.name, taken))}")
    for t in cp.outputs:
        element.append(f"          {out_vecs[t]}.a[e] = from_f<{ctype[t]}>({names[t]});")
    minb = 2 if cp.planes * cp.plane <= 64 * THREADS else 1  # pieces of at most 64 registers: two CTAs per SM
    plane_at = "(size_t)c * NPL + n" if cp.channel_major else "(size_t)n * C + c"
    subs = {"@CL@": cp.cluster, "@PLANES@": cp.planes, "@C@": cp.channels, "@NPL@": cp.n, "@HW@": cp.plane,
            "@PLANE_AT@": plane_at, "@PLANE_PARAMS@": "\n".join(plane_loads),
            "@VEC@": 16 // graph.type_of[cp.x].dtype.itemsize, "@XT@": ctype[cp.x], "@MINB@": minb, "@NAME@": name,
            "@PARAMS@": "".join(params), "@CASTS@": "".join(casts), "@PARAM_LOADS@": "\n".join(param_loads),
            "@ROW@": "\n".join(row), "@VEC_LOADS@": "\n".join(vec_loads), "@ELEMENT@": "\n".join(element),
            "@VEC_STORES@": "\n".join(vec_stores)}
    source = KERNEL
    for key, value in subs.items():
        source = source.replace(key, str(value))
    return source


def emit_module(graph: Graph, plan: PartPlan, plans: list[ClusterPlan]) -> tuple[str, str]:
    """(CUDA source, C++ glue) of one extension holding a kernel per cluster plan: one nvcc run for them all.
    The glue's `run(tensors, variant, nclusters, stream)` launches variant `variant` (or, for ~variant, returns
    how many of its clusters fit at once)."""
    names = [f"planes_{k}" for k in range(len(plans))]
    cuda = HEADER + "".join(emit_source(graph, plan, cp, name) for cp, name in zip(plans, names))
    decls = "\n".join(f"cudaError_t {n}_launch(const void* const*, int, cudaStream_t, int*);" for n in names)
    cases = "\n".join(f"    case {k}: err = {n}_launch(ptrs.data(), (int)nclusters, stream, variant < 0 ? &fits : "
                      f"nullptr); break;" for k, n in enumerate(names))
    return cuda, GLUE.replace("@DECLS@", decls).replace("@CASES@", cases)


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
