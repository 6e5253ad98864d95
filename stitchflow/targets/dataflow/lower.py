"""Lowering of a region's output expressions to a dataflow graph, level by level in a dataflow
order (a total order of the expression's index variables).

The walk keeps, for every leaf of the expression (a tensor view or a computed leaf), the
stream that positions it at the current loop depth (a ref stream; a value stream for computed
values) and a driver stream with the depth's structure. At each variable v of the scope:

1. nested reductions whose first variable comes no later than v are computed now (a sub-walk
   from the current streams): a value stream when all their free variables are already
   iterated, else an on-chip buffer (sparse accumulator) scanned later like a compressed
   tensor (a whole tensor buffered before the loops that read it has its first level dense,
   addressed by coordinate: `addressed`). A producer placed inside loops it does not depend
   on is recomputed per coordinate: that is the recomputation FuseFlow studies, and it shows
   in stream lengths;
2. the join of v follows the expression: intersections for products, unions for ops with
   f(0, ..) = 0, every coordinate for others; compressed levels are scanned and joined, dense
   levels located at the joined coordinates, a dense range scanned where no stored level
   gives every coordinate;
3. leaves lacking v are repeated over the joined coordinates.

At the bottom the expression's ALU tree combines the leaves' values. Returning up the walk,
a reduction variable is reduced (innermost) or sparse-accumulated (with free variables
inside it). Parallel lanes fork after a level's join and merge before its reduction.

Sparsity blocking (options block=b): a blocked variable's coordinates are block indices and
every value stream carries one tile axis per blocked variable of its expression (`Result.axes`,
`vaxes`): a view's in storage order, an ALU's in dataflow order. At the bottom a sum's blocked
reduction variables are contracted inside the root ALU (a product: the b x b tile multiply);
reducers and accumulators add whole tiles (a max, or a reduction variable the ALU could not
contract, is reduced over its tile axis there); writers scatter tiles and crop zero padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...ir.errors import TargetError
from ...ir.graph import Graph
from .graph import Builder, Dataflow, Output
from .ops import PRODUCTS, zero_preserving
from .rexpr import Konst, Leaf, Op, Red, View, all_vars, free, leaves, replace

TRUE = True


@dataclass
class State:
    refs: dict
    driver: int
    depth: tuple = ()


@dataclass(frozen=True)
class Result:
    levels: tuple = ()
    crds: tuple = ()
    values: int = -1
    axes: tuple = ()  # the tile axes (blocked variables) of the values, in array order


@dataclass
class ViewInfo:
    storage: int
    vars: tuple
    kinds: tuple
    sizes: tuple
    tile: tuple = ()


@dataclass
class Lowerer:
    graph: Graph
    region: str
    options: dict
    buffered: frozenset = frozenset()
    internal_ok: bool = False  # estimating one output alone: buffers it reads are not lowered
    needed: frozenset = frozenset()  # outputs read outside the region
    b: Builder = field(default_factory=Builder)

    def __post_init__(self):
        self.root = self.b.one("root", (), ["ref"], label="root")
        self.view_info: dict = {}
        self.leaf_info: dict = {}
        self.leaf_axes: dict = {}  # computed leaf -> the tile axes of its values
        self.padded: frozenset = frozenset()  # variables padded to whole tiles (pad_safe)
        self.branch_memo: dict = {}
        self.out_vars: frozenset = frozenset()  # the output variables of the tensor being lowered
        self.n_leaves = 0
        self.hoist = self.options.get("hoist", True)
        self.par = dict(self.options.get("par") or {})
        self.block = self.options.get("block")
        self.outputs: list[Output] = []
        self.orders: dict[str, tuple] = {}
        self.internal: dict[str, int] = {}  # buffered intermediate -> its on-chip tensor stream
        self.reformat: set = set()  # views re-stored in the dataflow order at load

    # ------------------------------------------------------------ entry

    def lower_output(self, name: str, expr, out_vars: tuple, extents: dict, order: tuple):
        self.pos = {v: k for k, v in enumerate(order)}
        self.out_vars = frozenset(out_vars)
        self.extent = extents
        self.orders[name] = tuple(order)
        self.view_info = {}
        self.padded = pad_safe(expr, extents, self.block) if self.block else frozenset()
        if isinstance(expr, Red):
            body, rvars, op = expr.body, set(expr.rvars), expr.op
        else:
            body, rvars, op = expr, set(), None
        levels = tuple(sorted(set(out_vars) | rvars, key=self.pos.__getitem__))
        state = State({leaf: self.root for leaf in leaves(body)}, self.root)
        res = self.walk(body, levels, 0, rvars, op, state, top=True)
        ttype = self.graph.type_of[name]
        dims = tuple(out_vars.index(v) for v in res.levels)
        tile = tuple(self.tile_of(v) for v in res.levels) if self.block else ()
        want = tuple(v for v in res.levels if v in res.axes)  # tile axes in coordinate-column order
        if set(want) != set(res.axes):
            raise TargetError(f"internal: values of {name} carry tile axes {res.axes} for levels {res.levels}")
        perm = tuple(res.axes.index(v) for v in want) if want != res.axes else ()
        params = (("name", name), ("shape", ttype.shape), ("dims", dims), ("tile", tile),
                  ("dtype", str(ttype.dtype).removeprefix("torch.")), ("tile_perm", perm))
        kind = "buffer_write" if name in self.buffered else "write"
        out = self.b.one(kind, res.crds + (res.values, self.root), ["tensor"], params, label=name)
        if name in self.buffered:
            self.internal[name] = out
        if name not in self.buffered or name in self.needed:
            self.outputs.append(Output(name, out))

    def dataflow(self, notes=()) -> Dataflow:
        order = next(iter(self.orders.values())) if len(self.orders) == 1 else tuple(
            f"{k}:{' '.join(v)}" for k, v in self.orders.items())
        used = {v for o in self.orders.values() for v in o}
        extents = tuple(sorted((v, n) for v, n in self.extent.items() if v in used))
        return Dataflow(self.region, tuple(order), tuple(self.b.prims), tuple(self.b.streams),
                        tuple(self.outputs), extents, tuple(notes))

    # ------------------------------------------------------------ the walk

    def walk(self, expr, levels, idx, rvars, op, st: State, top=False) -> Result:
        limit = self.pos[levels[idx]] if idx < len(levels) else len(self.pos) + 1
        expr, st = self.branch_due(expr, limit, st)
        if idx == len(levels):
            return self.bottom(expr, rvars, op, st)
        v = levels[idx]
        parent = st.driver
        c_v, inner = self.advance(expr, v, st)
        lanes = self.par.get(v) if top else None
        if lanes and lanes > 1 and v not in rvars:
            from .parallel import parallel_walk

            res = parallel_walk(self, expr, levels, idx, rvars, op, inner, c_v, lanes)
        else:
            res = self.walk(expr, levels, idx + 1, rvars, op, inner, top)
            res = Result((v,) + res.levels, (c_v,) + res.crds, res.values, res.axes)
        if v in rvars:
            res = self.reduce_level(res, parent, op)
        return res

    def branch_due(self, expr, limit: int, st: State):
        while True:  # one at a time: computing one can rewrite the others (shared parts)
            due = self.due(expr, limit)
            if not due:
                break
            leaf, stream = self.branch(due[0], st)
            expr = replace(expr, due[0], leaf)
            st.refs[leaf] = stream
        keep = set(leaves(expr))
        return expr, State({k: s for k, s in st.refs.items() if k in keep}, st.driver, st.depth)

    def due(self, e, limit: int) -> list:
        out: list = []

        def visit(x):
            if isinstance(x, Red):
                if min(self.pos[r] for r in x.rvars) <= limit:
                    out.append(x)
                elif self.hoist:
                    visit(x.body)
            elif isinstance(x, Op):
                for a in x.args:
                    visit(a)

        visit(e)
        return list(dict.fromkeys(out))

    def branch(self, n: Red, st: State):
        """Compute nested reduction n from the current streams: a value stream, or a buffer."""
        mine = leaves(n)
        levels = tuple(sorted(set(n.rvars) | (free(n) - set(st.depth)), key=self.pos.__getitem__))
        key = (n, tuple((leaf, st.refs[leaf]) for leaf in mine), levels, st.driver)
        if key in self.branch_memo:
            return self.branch_memo[key]
        sub = State({leaf: st.refs[leaf] for leaf in mine}, st.driver, st.depth)
        res = self.walk(n.body, levels, 0, set(n.rvars), n.op, sub)
        self.n_leaves += 1
        if not res.levels:
            leaf, stream = Leaf(self.n_leaves, "val"), res.values
            self.leaf_axes[leaf] = res.axes
        else:
            sizes = tuple(self.size_of(v) for v in res.levels)
            dense = 1 if self.addressed(res.levels, st) else 0
            params = (("sizes", sizes), ("tile", self.storage_tile(res.levels)), ("dense", dense))
            buf = self.b.one("buffer", (res.values,) + res.crds + (st.driver,), ["storage"], params,
                             label=f"{n.op}_{','.join(n.rvars)} over {','.join(res.levels)}", depth=st.depth)
            leaf = Leaf(self.n_leaves, "buf", res.levels)
            self.leaf_axes[leaf] = res.axes
            formats = ("d",) + ("d",) * dense + ("c",) * (len(res.levels) - dense)
            self.leaf_info[leaf] = ViewInfo(buf, ("#",) + res.levels, formats, (0,) + sizes,
                                            self.storage_tile(res.levels))
            stream = self.b.one("iota", (st.driver,), ["ref"], label=str(leaf), depth=st.depth)
        self.branch_memo[key] = (leaf, stream)
        return leaf, stream

    def addressed(self, levels: tuple, st: State) -> bool:
        """Whether a buffer's first level is stored dense, addressed by its coordinate as an on-chip array is:
        a whole tensor buffered before any loop and read under an output loop it does not carry (GCN's layer 2
        reads row k1 of layer 1 at each A[i, k1]). Compressed, its readers intersected each row with every
        stored row: N steps a row, N² over a graph."""
        first = self.pos[levels[0]]
        return not st.depth and any(self.pos[u] < first for u in self.out_vars if u not in levels and u in self.pos)

    def reduce_level(self, res: Result, parent: int, op: str) -> Result:
        v = res.levels[0]
        depth = self.b.streams[parent].depth
        axes = tuple(a for a in res.axes if a != v)  # v's tile axis is summed (or maxed) away
        if len(res.levels) == 1:
            params = (("op", op), ("extent", self.size_of(v)), ("tile_axes", self.tile_axes_of(res, v)))
            vals = self.b.one("reduce", (res.values, parent), ["val"], params, label=f"{op}_{v}", depth=depth)
            return Result((), (), vals, axes)
        kept = res.levels[1:]
        sizes = tuple(self.size_of(x) for x in res.levels)
        params = (("op", op), ("reduced", (0,)), ("sizes", sizes), ("tile", self.storage_tile(kept)),
                  ("tile_axes", self.tile_axes_of(res, v)))
        st = self.b.one("spacc", (res.values,) + res.crds + (parent,), ["storage"], params,
                        label=f"{op}_{v} keeping {','.join(kept)}", depth=depth)
        refs = self.b.one("iota", (parent,), ["ref"], label=f"spacc {v}", depth=depth)
        crds = []
        for k, x in enumerate(kept):
            depth = depth + (x,)
            c, refs = self.b.add("scan", (st, refs), ["crd", "ref"], (("level", 1 + k),),
                                 label=f"spacc_{v}.{x}", depth=depth)
            crds.append(c)
        vals = self.b.one("read", (st, refs), ["val"], label=f"spacc_{v}", depth=depth)
        return Result(kept, tuple(crds), vals, axes)

    # ------------------------------------------------------------ one level

    def advance(self, expr, v: str, st: State):
        lv = leaves(expr)
        having = [x for x in lv if v in self.vars_of(x)]
        dense = [x for x in having if self.kind_at(x, v) == "d"]
        comp = [x for x in having if self.kind_at(x, v) == "c"]
        formula = self.jspec(expr, v)
        depth = st.depth + (v,)
        size = self.size_of(v)
        refs = {}
        scans = {x: self.scan(x, v, st.refs[x], depth) for x in comp}
        if formula is None or formula is TRUE:
            if dense:
                src = dense[0]
                c, refs[src] = self.scan(src, v, st.refs[src], depth)
                dense = dense[1:]
            else:
                src = None
                c = self.b.one("range", (st.driver,), ["crd"], (("size", size),), label=v, depth=depth)
            if comp:
                first = [(c, refs[src] if src is not None else c)]
                outs = self.join(first + [scans[x] for x in comp], 0, v, depth)
                c = outs[0]
                if src is not None:
                    refs[src] = outs[1]
                refs.update(zip(comp, outs[2:]))
        else:
            f = self.index_formula(formula, comp)
            if len(comp) == 1 and f == 0:
                c, refs[comp[0]] = scans[comp[0]]
            else:
                outs = self.join([scans[x] for x in comp], f, v, depth)
                c = outs[0]
                refs.update(zip(comp, outs[1:]))
        for x in dense:
            refs[x] = self.b.one("locate", (c, st.refs[x]), ["ref"], (("size", size),), label=f"{x}.{v}", depth=depth)
        others = [x for x in lv if x not in refs]
        if others:
            sig = self.b.one("repsig", (c,), ["signal"], label=v, depth=depth)
            for x in others:
                kind = "val" if isinstance(x, Leaf) and x.kind == "val" else "ref"
                refs[x] = self.b.one("repeat", (st.refs[x], sig), [kind], label=f"{x} over {v}", depth=depth)
        return c, State(refs, c, depth)

    def join(self, pairs, formula, v, depth):
        ins = tuple(s for pair in pairs for s in pair)
        kinds = ["crd"] + ["ref"] * len(pairs)
        name = "intersect" if _only(formula, "and") else "union" if _only(formula, "or") else "join"
        return self.b.add("join", ins, kinds, (("formula", formula),), label=f"{name} {v}", depth=depth)

    def scan(self, x, v, ref, depth):
        info = self.info(x)
        level = info.vars.index(v)
        missing = [u for u in info.vars[:level] if u not in depth and u != "#"]
        if missing:
            raise TargetError(f"internal: scanning {x} at {v} before its levels {missing}")
        return self.b.add("scan", (info.storage, ref), ["crd", "ref"], (("level", level),),
                          label=f"{x}.{v}", depth=depth)

    def jspec(self, e, v):
        """The join of variable v for expression e: None (constant along v), TRUE (every
        coordinate), a compressed leaf, or ("and" | "or", parts)."""
        if isinstance(e, (View, Leaf)) and not (isinstance(e, Leaf) and e.kind == "val"):
            if v not in self.vars_of(e):
                return None
            return TRUE if self.kind_at(e, v) == "d" else e
        if isinstance(e, (Konst, Leaf)):
            return None
        if isinstance(e, Red):
            return self.jspec(e.body, v) if v in free(e) else None
        kids = [self.jspec(a, v) for a in e.args]
        if all(k is None for k in kids):
            return None
        if e.op == "cast":
            return kids[0]
        if e.op in PRODUCTS:
            return _and([k for k in kids if k is not None])
        if e.op == "div" and kids[1] is None:
            return kids[0]
        consts = {k: a.value for k, a in enumerate(e.args) if isinstance(a, Konst)}
        if zero_preserving(e.op, consts, len(e.args)):
            return _or([k if k is not None else (None if isinstance(a, Konst) else TRUE)
                        for k, a in zip(kids, e.args)])
        return TRUE

    @staticmethod
    def index_formula(f, comp):
        if isinstance(f, tuple):
            return (f[0], tuple(Lowerer.index_formula(x, comp) for x in f[1]))
        return comp.index(f)

    # ------------------------------------------------------------ values

    def bottom(self, expr, rvars, op, st: State) -> Result:
        """The values at the innermost level. With blocking, a sum's blocked reduction variables
        are contracted inside the tile ALU at the root (a product: the b x b tile multiply); the
        reducers then add whole tiles."""
        contract = ()
        if self.block and op == "sum" and isinstance(expr, Op) and expr.op != "cast":
            axes = self.op_axes(expr)
            contract = tuple(a for a in axes if a in rvars)
        vals = self.value(expr, st, contract)
        return Result((), (), vals, tuple(a for a in self.vaxes(expr) if a not in contract))

    def value(self, e, st: State, contract: tuple = ()) -> int:
        depth = st.depth
        if isinstance(e, Konst):
            return self.b.one("fill", (st.driver,), ["val"], (("value", e.value),), label=repr(e.value), depth=depth)
        if isinstance(e, Leaf) and e.kind == "val":
            return st.refs[e]
        if isinstance(e, (View, Leaf)):
            return self.b.one("read", (self.info(e).storage, st.refs[e]), ["val"], label=str(e), depth=depth)
        if isinstance(e, Red):
            raise TargetError(f"reduction {e} was not placed by the walk")
        consts = {k: a.value for k, a in enumerate(e.args) if isinstance(a, Konst)}
        if len(consts) == len(e.args):
            from .ops import apply_op

            folded = float(apply_op(e.op, list(consts.values()), e.dtype or None))
            return self.value(Konst(folded), st)
        ins = tuple(self.value(a, st) for a in e.args if not isinstance(a, Konst))
        axes_in = tuple(self.vaxes(a) for a in e.args) if self.block else None
        params = (("op", e.op), ("arity", len(e.args)), ("consts", tuple(sorted(consts.items()))),
                  ("dtype", e.dtype or None), ("axes_in", axes_in), ("axes_out", self.op_axes(e)))
        if contract:
            params += (("contract", tuple(contract)),)
        label = f"{e.op} (tile contract {','.join(contract)})" if contract else e.op
        return self.b.one("alu", ins, ["val"], params, label=label, depth=depth)

    # ------------------------------------------------------------ leaves and storage

    def vars_of(self, x) -> tuple:
        if isinstance(x, Leaf) and x.kind == "val":
            return ()
        return self.info(x).vars

    def kind_at(self, x, v) -> str:
        info = self.info(x)
        return info.kinds[info.vars.index(v)]

    def info(self, x) -> ViewInfo:
        if isinstance(x, Leaf):
            return self.leaf_info[x]
        if x not in self.view_info:
            self.view_info[x] = self.load(x)
        return self.view_info[x]

    def load(self, view: View) -> ViewInfo:
        ttype = self.graph.type_of[view.tensor]
        fmt = ttype.format
        if fmt.is_sparse and (fmt.block is None or self.block) and view.plain and str(view) in self.reformat:
            vars_ = tuple(sorted(view.vars, key=self.pos.__getitem__))  # re-stored in this order
            kinds = tuple(str(lv) for lv in fmt.levels)
            modes, index = tuple(view.index.index(_var(v)) for v in vars_), None
        elif fmt.is_sparse and view.plain and (fmt.block is None or self.block):
            vars_ = tuple(view.index[m].name for m in fmt.mode_order)
            kinds = tuple(str(lv) for lv in fmt.levels)
            modes, index = fmt.mode_order, None
        else:  # dense (or read through index arithmetic): any order, addresses computed
            vars_ = tuple(sorted(view.vars, key=self.pos.__getitem__))
            kinds = ("d",) * len(vars_)
            whole = all(self.extent[i.name] == n for i, n in zip(view.index, ttype.shape)) if view.plain else False
            if whole:  # a view over part of a dimension (y[:, :5]) is addressed, not scanned whole
                modes, index = tuple(view.index.index(_var(v)) for v in vars_), None
            else:
                modes, index = None, view.index
            if fmt.is_sparse and self.block is None and not view.plain:
                raise TargetError(f"access {view} of sparse tensor {view.tensor} uses index arithmetic")
        if self.block and index is None and not fmt.is_dense:
            kinds = tuple(str(lv) for lv in fmt.levels)
        tile = self.storage_tile(vars_)
        sizes = tuple(self.size_of(v) for v in vars_)
        params = (("tensor", view.tensor), ("kinds", kinds), ("modes", modes), ("index", index),
                  ("vars", vars_), ("extents", tuple((v, self.extent[v]) for v in vars_)), ("tile", tile))
        ins = ()
        if view.tensor in self.buffered:
            if view.tensor not in self.internal and not self.internal_ok:
                raise TargetError(f"internal: buffer {view.tensor} read before it is written")
            ins = (self.internal[view.tensor],) if view.tensor in self.internal else ()
        sid = self.b.one("load", ins, ["storage"], params, label=str(view))
        return ViewInfo(sid, vars_, kinds, sizes, tile)

    # ------------------------------------------------------------ blocking hooks

    def tile_of(self, v) -> int:
        """b where v is blocked: b divides its extent, or its extent is padded with zeros up to
        a multiple of b (where that cannot change the result, see pad_safe); else 1 (scalar)."""
        b = self.block
        if not b:
            return 1
        return b if self.extent[v] % b == 0 or v in self.padded else 1

    def size_of(self, v) -> int:
        t = self.tile_of(v)
        return -(-self.extent[v] // t)

    def storage_tile(self, vars_) -> tuple:
        return tuple(self.tile_of(v) for v in vars_) if self.block else ()

    def vaxes(self, e) -> tuple:
        """The tile axes (blocked variables) of e's value stream, in the order of its arrays:
        a view's in its storage's level order, a computed leaf's as it was computed, an ALU's
        in dataflow order."""
        if not self.block or isinstance(e, Konst):
            return ()
        if isinstance(e, Leaf):
            return self.leaf_axes[e]
        if isinstance(e, View):
            return tuple(v for v in self.info(e).vars if v != "#" and self.tile_of(v) > 1)
        if isinstance(e, Op):
            return self.op_axes(e)
        raise TargetError(f"internal: no tile axes for {e}")

    def op_axes(self, e) -> tuple:
        if not self.block:
            return ()
        vs = set().union(*(self.vaxes(a) for a in e.args))
        return tuple(sorted(vs, key=self.pos.__getitem__))

    def tile_axes_of(self, res: Result, v) -> tuple:
        return (res.axes.index(v),) if v in res.axes else ()


def _var(name):
    from ...ir.index import Var

    return Var(name)


def _and(parts):
    parts = [p for p in parts if p is not TRUE]
    flat = []
    for p in parts:
        flat += list(p[1]) if isinstance(p, tuple) and p[0] == "and" else [p]
    if not flat:
        return TRUE
    return flat[0] if len(flat) == 1 else ("and", tuple(dict.fromkeys(flat)))


def _or(parts):
    parts = [p for p in parts if p is not None]
    if any(p is TRUE for p in parts):
        return TRUE
    flat = []
    for p in parts:
        flat += list(p[1]) if isinstance(p, tuple) and p[0] == "or" else [p]
    if not flat:
        return None
    return flat[0] if len(flat) == 1 else ("or", tuple(dict.fromkeys(flat)))


def _only(f, op) -> bool:
    if isinstance(f, int) or f is TRUE:
        return True
    return f[0] == op and all(_only(x, op) for x in f[1])


def pad_safe(expr, extents: dict, b: int) -> frozenset:
    """Variables whose extent b does not divide but that may be padded with zeros to a multiple
    of b: every reduction over them is a sum of a body that is zero wherever they are padded
    (the padded entries of every stored tensor are zero). Elsewhere padded entries only reach
    padded output positions, which the writers crop. Other variables stay scalar (tile 1), and
    so does a variable shorter than one tile (a head index of 2 is not worth 16-wide tiles)."""
    odd = {v for v, n in extents.items() if n % b and n >= b}
    reds: list = []

    def collect(e):
        if isinstance(e, Red):
            reds.append(e)
            collect(e.body)
        elif isinstance(e, Op):
            for a in e.args:
                collect(a)

    collect(expr)
    bad = {v for r in reds for v in r.rvars if v in odd and (r.op != "sum" or not _zero_on_pad(r.body, v))}
    return frozenset(odd - bad)


def _zero_on_pad(e, v) -> bool:
    """e is zero at every padded coordinate of v."""
    if isinstance(e, View):
        return v in e.vars
    if isinstance(e, Konst):
        return e.value == 0
    if isinstance(e, Red):
        return v in free(e) and _zero_on_pad(e.body, v)
    if not isinstance(e, Op):
        return False
    zero = [_zero_on_pad(a, v) for a in e.args]
    if e.op in PRODUCTS:  # 0 * nan is nan: the other factors must stay finite
        return any(zero) and all(_finite_on_pad(a, v) for a in e.args)
    if e.op == "cast":
        return zero[0]
    if e.op == "div":
        return zero[0] and v not in free(e.args[1])  # 0 / 0 would be nan
    if not all(z or isinstance(a, Konst) for z, a in zip(zero, e.args)):
        return False
    consts = {k: a.value for k, a in enumerate(e.args) if isinstance(a, Konst)}
    return zero_preserving(e.op, consts, len(e.args))


def _finite_on_pad(e, v) -> bool:
    """e cannot be nan or infinite at a padded coordinate of v (no division by, or log, of
    something that depends on v)."""
    if isinstance(e, Red):
        return _finite_on_pad(e.body, v)
    if not isinstance(e, Op):
        return True
    if e.op in ("div", "recip", "rsqrt", "log", "pow"):
        touched = e.args[1:] if e.op == "div" else e.args
        if any(v in all_vars(a) for a in touched):
            return False
    return all(_finite_on_pad(a, v) for a in e.args)
