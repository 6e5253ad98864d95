"""The CUDA printer of cluster_planes: IR expressions as CUDA C, and the statistics, exchange combine and epilogue
of a cluster plan filled into the fixed kernel text of cluster_planes_cuda.

Two kinds of statistics ride the same exchange of two floats per CTA: a mean and the centred variance on it (batch
norm's, group norm's, a layer norm's over a long row), and a maximum with the sum of exp(a - max) taken against it
(softmax's over a long row). The epilogue prints every other node of the part from the IR, rounding each to its
dtype as eager does."""

from __future__ import annotations

import math

import torch

from ...ir.expr import Cast, Const, Read, reads
from ...ir.graph import Graph
from .analysis import PartPlan
from .codegen_split import _bare
from .cluster_planes_cuda import GLUE, HEADER, KERNEL

THREADS = 256
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
# float32 exponentials as Triton's tl.exp lowers them in the generated kernels (ex2.approx of x·log2 e): with expf a
# softmax over rows of 65536 floats ran 303 µs on clusters of 4 and 337 on clusters of 8 (91 registers: 30 clusters
# fit), with __expf 295 and 290 (72 registers: three CTAs an SM, 45 clusters), H200, copy of the bytes 255
# (scripts/cluster_rows_probe.py; the combine's eight rescaling expf alone held the 19 registers); divisions stay
# IEEE
FAST_F32 = {"exp"}



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
        if e.op in FAST and (self.fast or e.op in FAST_F32):
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


def emit_source(graph: Graph, plan: PartPlan, cp, name: str = "planes_kernel") -> str:
    """The CUDA source of cluster plan `cp`: its statistics, the fixed exchange, the epilogue printed from the IR."""
    taken: set = {"xv", "n", "mref", "mmax", "ssum", "mean", "m2"}
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
    stats, combine, row = _statistics_code(printer, plan, cp.stats, taken)
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
            "@STATS@": "\n".join(stats), "@COMBINE@": "\n".join(combine), "@ROW@": "\n".join(row),
            "@VEC_LOADS@": "\n".join(vec_loads), "@ELEMENT@": "\n".join(element),
            "@VEC_STORES@": "\n".join(vec_stores)}
    source = KERNEL
    for key, value in subs.items():
        source = source.replace(key, str(value))
    return source


def _statistics_code(printer: _Printer, plan: PartPlan, stats, taken: set) -> tuple[list, list, list]:
    """(the piece's two numbers `sa`, `sb` from its registers v[k][e]; the row's statistics from every CTA's pair
    as_[r], bs_[r]; the reductions' nodes defined from them), per kind of statistics."""
    if stats.kind == "moments":
        mean = "mean" if abs(stats.mean_factor - 1) < 1e-12 else f"(mean * {_const(stats.mean_factor)})"
        row = [f"    {printer.define(stats.mean, None, _ident('s_', stats.mean, taken), mean)}"]
        if stats.var:
            var = f"(m2 * {_const(stats.var_factor)})"
            row.append(f"    {printer.define(stats.var, None, _ident('s_', stats.var, taken), var)}")
        return MOMENTS_STATS, MOMENTS_COMBINE, row
    nodes = {n.name: n for n in plan.nodes}
    largest = _element_loop(printer, plan, nodes[stats.max].body, taken, "mx = nanmax(mx, {});")
    printer.names[stats.max] = "mref"  # each term against the piece's own maximum (0 while it is -inf)
    terms = _element_loop(printer, plan, nodes[stats.sum].body, taken, "s += {};")
    code = ["    float mx = -INFINITY;", *largest, "    const float sa = block_max<THREADS>(mx, red[0]);",
            "    const float mref = sa == -INFINITY ? 0.f : sa;", "    float s = 0.f;", *terms,
            "    const float sb = block_sum<THREADS>(s, red[1]);"]
    row = [f"    {printer.define(stats.max, None, _ident('s_', stats.max, taken), 'mmax')}",
           f"    {printer.define(stats.sum, None, _ident('s_', stats.sum, taken), 'ssum')}"]
    return code, SOFTMAX_COMBINE, row


def _element_loop(printer: _Printer, plan: PartPlan, body, taken: set, step: str) -> list[str]:
    """A loop over the piece's elements (xv) that defines the part's elementwise nodes `body` reads, in the
    part's order, then folds `body` into an accumulator by `step`."""
    lines = []
    for node in needed_nodes(plan, body):
        lines.append(f"        {printer.define(node.name, node.body, _ident('t_', node.name, taken))}")
    lines.append(f"        {step.format(printer.expr(body))}")
    return ["    #pragma unroll", "    for (int k = 0; k < PER_T; ++k) {",
            "      if (k * THREADS + tid >= PIECEV) continue;",
            "      #pragma unroll", "      for (int e = 0; e < VEC; ++e) {", "        const float xv = v[k][e];",
            *lines, "      }", "    }"]


def needed_nodes(plan: PartPlan, body) -> list:
    """The part's elementwise nodes (not per row) that `body` reads, directly or through each other, in order."""
    part = {n.name: n for n in plan.nodes if n.reduce is None and n.name not in plan.row_level}
    need, stack = set(), [a.tensor for a in reads(body)]
    while stack:
        t = stack.pop()
        if t in part and t not in need:
            need.add(t)
            stack += [a.tensor for a in reads(part[t].body)]
    return [n for n in plan.nodes if n.name in need]


# the mean and the centred sum of squares of the piece (padding lanes hold zeros), and their combine by Chan,
# Golub and LeVeque: the pieces' centred sums plus the spread of their means
MOMENTS_STATS = """    float s = 0.f;
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      #pragma unroll
      for (int e = 0; e < VEC; ++e) s += v[k][e];
    }
    const float sa = block_sum<THREADS>(s, red[0]) / NLOC;
    float q = 0.f;
    #pragma unroll
    for (int k = 0; k < PER_T; ++k) {
      if (k * THREADS + tid < PIECEV) {
        #pragma unroll
        for (int e = 0; e < VEC; ++e) { const float d = v[k][e] - sa; q += d * d; }
      }
    }
    const float sb = block_sum<THREADS>(q, red[1]);""".split("\n")
MOMENTS_COMBINE = """    float sum_m = 0.f;
    #pragma unroll
    for (int r = 0; r < CL; ++r) sum_m += as_[r];
    const float mean = sum_m / CL;
    float m2 = 0.f;
    #pragma unroll
    for (int r = 0; r < CL; ++r) m2 += bs_[r] + NLOC * (as_[r] - mean) * (as_[r] - mean);""".split("\n")
# the row's maximum (NaN kept, as torch does) and every piece's sum rescaled to it; a piece of only -inf summed
# zeros against 0, so its scale is taken as 0 rather than exp(-inf - -inf)
SOFTMAX_COMBINE = """    float mmax = -INFINITY;
    #pragma unroll
    for (int r = 0; r < CL; ++r) mmax = nanmax(mmax, as_[r]);
    float ssum = 0.f;
    #pragma unroll
    for (int r = 0; r < CL; ++r) ssum += as_[r] == -INFINITY ? 0.f : bs_[r] * __expf(as_[r] - mmax);""".split("\n")


def emit_module(graph: Graph, plan: PartPlan, plans: list) -> tuple[str, str]:
    """(CUDA source, C++ glue) of one extension holding a kernel per cluster plan: one nvcc run for them all.
    The glue's `run(tensors, variant, nclusters, stream)` launches variant `variant` (or, for ~variant, returns
    how many of its clusters fit at once)."""
    names = [f"planes_{k}" for k in range(len(plans))]
    cuda = HEADER + "".join(emit_source(graph, plan, cp, name) for cp, name in zip(plans, names))
    decls = "\n".join(f"cudaError_t {n}_launch(const void* const*, int, cudaStream_t, int*);" for n in names)
    cases = "\n".join(f"    case {k}: err = {n}_launch(ptrs.data(), (int)nclusters, stream, variant < 0 ? &fits : "
                      f"nullptr); break;" for k, n in enumerate(names))
    return cuda, GLUE.replace("@DECLS@", decls).replace("@CASES@", cases)


