"""A fusion region as one expression per output: producers inlined into their consumers.

Inside a region an intermediate is never written, so each use of a producer becomes a copy of
the producer's expression with the producer's output variables replaced by the consumer's
index expressions (index variables unified across producers and consumers) and its reduction
variables renamed apart. What is left at the leaves are *views* of tensors read from memory.
Reductions stay nested (`Red`) where the IR nests them: the lowering computes a nested
reduction where the dataflow order reaches its first reduction variable.

Two rewrites keep the streams simple and shared:
- a reduction variable used only as `k // c` and `k % c` (a head merge) is split in two;
- a nested reduction's variable is renamed to a variable of the enclosing expression when
  that makes it read the same views (softmax, layernorm): the row is then streamed once and
  fanned out to the reducer and to its consumer instead of being recomputed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from ...ir import expr as E
from ...ir.graph import Graph, Node, Region
from ...ir.index import Div, Gather, Mod, Sum, Var, add, free_vars, gathered_tensors, rename, scale, substitute
from .ops import SUPPORTED


@dataclass(frozen=True)
class View:
    """A read of a tensor from memory through index expressions over the region's variables."""

    tensor: str
    index: tuple

    def __str__(self) -> str:
        return f"{self.tensor}[{','.join(map(str, self.index))}]"

    @functools.cached_property
    def vars(self) -> frozenset[str]:
        return frozenset().union(*(free_vars(i) for i in self.index))

    @property
    def plain(self) -> bool:
        names = [i.name for i in self.index if isinstance(i, Var)]
        return len(names) == len(self.index) and len(set(names)) == len(names)


@dataclass(frozen=True)
class Konst:
    value: float

    def __str__(self) -> str:
        return repr(self.value)


@dataclass(frozen=True)
class Op:
    op: str
    args: tuple
    dtype: str = ""

    def __str__(self) -> str:
        return f"{self.op}({', '.join(map(str, self.args))})"


@dataclass(frozen=True)
class Red:
    op: str
    rvars: tuple[str, ...]
    body: object

    def __str__(self) -> str:
        return f"{self.op}_{','.join(self.rvars)}({self.body})"


@dataclass(frozen=True)
class Leaf:
    """A nested reduction computed earlier in the walk: a value stream ("val") or an on-chip
    buffer scanned like a compressed tensor over `vars` ("buf")."""

    id: int
    kind: str
    vars: tuple[str, ...] = ()

    def __str__(self) -> str:
        return f"{self.kind}{self.id}[{','.join(self.vars)}]"


Expr = object  # View | Konst | Op | Red | Leaf


# ---------------------------------------------------------------- traversal

@functools.lru_cache(maxsize=None)
def free(e) -> frozenset[str]:
    if isinstance(e, View):
        return e.vars
    if isinstance(e, Leaf):
        return frozenset(e.vars)
    if isinstance(e, Op):
        return frozenset().union(*(free(a) for a in e.args))
    if isinstance(e, Red):
        return free(e.body) - set(e.rvars)
    return frozenset()


@functools.lru_cache(maxsize=None)
def all_vars(e) -> frozenset[str]:
    if isinstance(e, Op):
        return frozenset().union(*(all_vars(a) for a in e.args))
    if isinstance(e, Red):
        return all_vars(e.body) | set(e.rvars)
    return free(e)


@functools.lru_cache(maxsize=None)
def leaves(e) -> tuple:
    """Views and computed leaves, first-use order, unique."""
    if isinstance(e, (View, Leaf)):
        return (e,)
    if isinstance(e, Op):
        out: dict = {}
        for a in e.args:
            out.update(dict.fromkeys(leaves(a)))
        return tuple(out)
    if isinstance(e, Red):
        return leaves(e.body)
    return ()


def views(e) -> frozenset:
    return frozenset(x for x in leaves(e) if isinstance(x, View))


def replace(e, old, new):
    if e == old:
        return new
    if isinstance(e, Op):
        return Op(e.op, tuple(replace(a, old, new) for a in e.args), e.dtype)
    if isinstance(e, Red):
        return Red(e.op, e.rvars, replace(e.body, old, new))
    return e


def rename_vars(e, names: dict):
    if isinstance(e, View):
        return View(e.tensor, tuple(rename(i, names) for i in e.index))
    if isinstance(e, Op):
        return Op(e.op, tuple(rename_vars(a, names) for a in e.args), e.dtype)
    if isinstance(e, Red):
        return Red(e.op, tuple(names.get(v, v) for v in e.rvars), rename_vars(e.body, names))
    return e


def nested(e) -> tuple:
    """The reductions directly inside e (not inside another reduction)."""
    if isinstance(e, Red):
        return (e,)
    if isinstance(e, Op):
        out: dict = {}
        for a in e.args:
            out.update(dict.fromkeys(nested(a)))
        return tuple(out)
    return ()


# ---------------------------------------------------------------- building

REDUCERS = ("sum", "max")  # what a dataflow Reduce primitive accumulates (spec/dataflow.md)


REUSE_LIMIT = 16  # regions of more nodes share, rather than recompute, every producer read twice


def buffered_producers(graph: Graph, nodes, buffer=(), reuse_limit: int = REUSE_LIMIT) -> frozenset[str]:
    """The region nodes a fused region writes once into an on-chip buffer and reads from there,
    instead of recomputing them inside each consumer's loops (the static cost model asks too):
    those in `buffer` (the option); producers read more than once where some read uses index
    arithmetic (QKV split into heads: inlined, they would be recomputed per use and per head);
    and, in regions of more than `reuse_limit` nodes, every producer read more than once."""
    members = set(nodes)
    uses: dict[str, list] = {}
    for name in nodes:
        for a in graph.node_of[name].accesses:
            if a.tensor in members:
                uses.setdefault(a.tensor, []).append(a)
    found = set(buffer)
    found |= {t for t, acc in uses.items() if len(acc) > 1 and not all(a.is_plain for a in acc)}
    if len(members) > reuse_limit:
        found |= {t for t, acc in uses.items() if len(acc) > 1}
    return frozenset(found)


class RegionExprs:
    """The expressions of a region's outputs; `problems` lists what the target cannot run."""

    def __init__(self, graph: Graph, region: Region, unify: bool = True, buffer=(), reuse_limit: int = REUSE_LIMIT):
        self.graph = graph
        self.nodes = {n: graph.node_of[n] for n in region.nodes}
        self.problems: list[str] = []
        self.outputs: dict[str, tuple] = {}  # name -> (expr, out vars, extents)
        self.buffered = set(buffered_producers(graph, region.nodes, buffer, reuse_limit))
        needed = set(self.needed(graph, region)) | self.buffered
        for name in [n for n in region.nodes if n in needed]:
            self.extent: dict[str, int] = {}
            self.used: set[str] = set()
            self.outputs[name] = self.build(self.nodes[name], unify)

    @staticmethod
    def needed(graph: Graph, region: Region) -> list[str]:
        inside = set(region.nodes)
        return [n for n in region.nodes
                if n in graph.outputs or any(c not in inside for c in graph.consumers.get(n, ()))]

    def fresh(self, base: str) -> str:
        name, k = base, 0
        while name in self.used:
            k += 1
            name = f"{base}{k}"
        self.used.add(name)
        return name

    def build(self, node: Node, unify: bool):
        if node.is_scatter:
            self.problems.append(f"node {node.name} scatters into its output ({node}); the dataflow target "
                                 "writes outputs at plain coordinates only")
            return Konst(0.0), (), {}
        node = split_vars(node)
        mapping = {}
        for v in node.out_vars:
            g = self.fresh(v)
            self.extent[g] = node.extents[v]
            mapping[v] = Var(g)
        out_vars = tuple(mapping[v].name for v in node.out_vars)
        expr = self.node_expr(node, mapping)
        expr = canonical(expr, {})
        if unify:
            scope = set(out_vars) | (set(expr.rvars) if isinstance(expr, Red) else set())
            body = expr.body if isinstance(expr, Red) else expr
            body = unify_reductions(body, scope, self.extent)
            expr = canonical(Red(expr.op, expr.rvars, body) if isinstance(expr, Red) else body, {})
        return expr, out_vars, dict(self.extent)

    def node_expr(self, node: Node, mapping: dict):
        mapping = dict(mapping)
        rnames = []
        for v in node.reduce_vars:
            g = self.fresh(v)
            self.extent[g] = node.extents[v]
            mapping[v] = Var(g)
            rnames.append(g)
        body = self.convert(node.body, mapping, node)
        if node.reduce and node.reduce_vars:
            if node.reduce not in REDUCERS:
                self.problems.append(f"node {node.name} reduces by {node.reduce}, which has no dataflow reducer "
                                     f"({', '.join(REDUCERS)})")
            return Red(node.reduce, tuple(rnames), body)
        return body

    def convert(self, e, mapping, node: Node):
        if isinstance(e, E.Read):
            return self.read(e.access, mapping, node)
        if isinstance(e, E.Const):
            return Konst(float(e.value))
        if isinstance(e, E.Call):
            if e.op not in SUPPORTED:
                self.problems.append(f"node {node.name} uses op {e.op}, which has no dataflow ALU")
            return Op(e.op, tuple(self.convert(a, mapping, node) for a in e.args))
        if isinstance(e, E.Cast):
            return Op("cast", (self.convert(e.arg, mapping, node),), str(e.dtype).removeprefix("torch."))
        self.problems.append(f"node {node.name} reads the coordinate value {e} (an iota), which the dataflow "
                             "target does not stream")
        return Konst(0.0)

    def read(self, access: E.Access, mapping, node: Node):
        idx = tuple(substitute(i, mapping, self.extent) for i in access.indices)
        for i in idx:
            for t in gathered_tensors(i):
                if t in self.nodes:
                    self.problems.append(f"access {access} in {node.name} gathers through {t}, computed in the "
                                         "same region; the dataflow target cannot stream an indirect index")
        producer = self.nodes.get(access.tensor)
        if producer is None or access.tensor in self.buffered:
            return View(access.tensor, idx)
        if producer.is_scatter:
            self.problems.append(f"node {producer.name} scatters into its output; it cannot be fused")
            return Konst(0.0)
        inner = {v: i for v, i in zip((x.name for x in producer.index), idx)}
        return self.node_expr(split_vars(producer), inner)


def split_vars(node: Node) -> Node:
    """Split a reduction variable k used as k // c and k % c into (k_h, k_l), k = c*k_h + k_l."""
    found: dict[str, set[int]] = {}

    def visit(i):
        if isinstance(i, (Div, Mod)) and isinstance(i.arg, Var):
            found.setdefault(i.arg.name, set()).add(i.divisor if isinstance(i, Div) else i.modulus)
        if isinstance(i, Sum):
            for _, a in i.terms:
                visit(a)
        elif isinstance(i, (Div, Mod)):
            visit(i.arg)
        elif isinstance(i, Gather):
            for x in i.indices:
                visit(x)

    for a in node.accesses:
        for i in a.indices:
            visit(i)
    dims = dict(node.dims)
    subst, new_dims = {}, []
    for v, n in node.dims:
        cs = found.get(v, set())
        if v in node.reduce_vars and len(cs) == 1 and n % next(iter(cs)) == 0 and n > next(iter(cs)):
            c = next(iter(cs))
            hi, lo = _unused(v + "h", dims), _unused(v + "l", dims)
            subst[v] = add(scale(Var(hi), c), Var(lo))
            new_dims += [(hi, n // c), (lo, c)]
        else:
            new_dims.append((v, n))
    if not subst:
        return node
    ranges = dict(new_dims)

    def fix(access: E.Access) -> E.Expr:
        return E.Read(E.Access(access.tensor, tuple(substitute(i, subst, ranges) for i in access.indices)))

    return dataclasses.replace(node, body=E.map_reads(node.body, fix), dims=tuple(new_dims))


def _unused(name: str, dims: dict) -> str:
    while name in dims:
        name += "_"
    return name


def canonical(e, seen: dict):
    """Replace every reduction by the first alpha-equivalent one (the same computation inlined
    at several uses, up to the names of its bound variables), so that they are one expression:
    computed once and fanned out rather than recomputed."""
    if isinstance(e, Op):
        return Op(e.op, tuple(canonical(a, seen) for a in e.args), e.dtype)
    if not isinstance(e, Red):
        return e
    key = alpha(e, {}, [0])
    if key not in seen:
        seen[key] = Red(e.op, e.rvars, canonical(e.body, seen))
    return seen[key]


def alpha(e, env: dict, counter: list):
    """e with every bound variable renamed to a placeholder numbered in binding order."""
    if isinstance(e, View):
        return View(e.tensor, tuple(rename(i, env) for i in e.index)) if env else e
    if isinstance(e, Op):
        return Op(e.op, tuple(alpha(a, env, counter) for a in e.args), e.dtype)
    if isinstance(e, Red):
        names = []
        for _ in e.rvars:
            names.append(f"#{counter[0]}")
            counter[0] += 1
        inner = {**env, **dict(zip(e.rvars, names))}
        return Red(e.op, tuple(names), alpha(e.body, inner, counter))
    return e


def unify_reductions(e, scope: set, extent: dict):
    """Rename each single-variable nested reduction's variable to a scope variable of the
    same extent when that makes the reduction read views the enclosing expression reads."""
    done: set = set()
    while True:  # one at a time: rewriting one rewrites copies of it inside the others
        todo = [n for n in nested(e) if n not in done]
        if not todo:
            return e
        n = todo[0]
        new = n
        if len(n.rvars) == 1:
            r = n.rvars[0]
            outside = views(replace(e, n, Konst(0.0)))
            for f in sorted(scope):
                if extent.get(f) != extent.get(r) or f in free(n) or f == r:
                    continue
                cand = rename_vars(n, {r: f})
                if views(cand.body) & outside:
                    new = cand
                    break
        inner = unify_reductions(new.body, set(free(new)) | set(new.rvars), extent)
        new = Red(new.op, new.rvars, inner)
        e = replace(e, n, new)
        done.add(new)
