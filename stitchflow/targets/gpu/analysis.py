"""Region analysis for the gpu target: which nodes can be generated, and how a group of them
maps onto one kernel.

Every loop variable of every node is unified with the variables of the nodes it reads
(registers can only carry a value from producer to consumer when both index it the same
way), which gives the group's *axis classes*. The classes that the reductions reduce are the
*local* axes L, walked inside one program (whole, or in chunks); the others are the
*parallel* axes P, spread over programs. A group whose reductions reduce different axis sets,
or whose intermediates are read through index arithmetic, is refused here with a reason, and
the caller splits it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...ir.expr import Access, Call, Cast, Const, Read
from ...ir.graph import SCATTER_OPS, Graph, Node
from ...ir.index import Lit, Mod, Sum, Var, rename
from ...ir.unify import VarClasses

GENERATED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
                    torch.int16, torch.int8, torch.uint8, torch.bool)


class NotStitchable(Exception):
    """A group of nodes that one generated kernel cannot run (the message says why)."""


def product_factors(e) -> list | None:
    """Factors of a product body (reads, constants), seeing through casts to float types."""
    if isinstance(e, Cast) and e.dtype.is_floating_point:
        inner = product_factors(e.arg)
        return None if inner is None else [Cast(e.dtype, f) if isinstance(f, Read) else f for f in inner]
    if isinstance(e, Call) and e.op == "mul":
        left, right = product_factors(e.args[0]), product_factors(e.args[1])
        return None if left is None or right is None else left + right
    if isinstance(e, (Read, Const)):
        return [e]
    return None


def factor_access(f):
    return f.arg.access if isinstance(f, Cast) else f.access if isinstance(f, Read) else None


def is_contraction(node: Node) -> bool:
    """A GEMM-like node: a sum of products of two reads that each keep an output variable the
    other lacks (M and N dims), e.g. Y[i,j] = sum_k A[i,k] * B[k,j]."""
    if node.reduce != "sum" or not node.reduce_vars or node.is_scatter:
        return False
    factors = product_factors(node.body)
    if factors is None:
        return False
    accesses = [a for a in map(factor_access, factors) if a is not None]
    out = set(node.out_vars)
    for k, a in enumerate(accesses):
        for b in accesses[k + 1:]:  # x·xᵀ is a GEMM too; x·x (a square) is not: no own out vars
            only_a = (a.vars - b.vars) & out
            only_b = (b.vars - a.vars) & out
            shared_red = a.vars & b.vars & set(node.reduce_vars)
            if only_a and only_b and shared_red:
                return True
    return False


def node_refusal(graph: Graph, node: Node) -> str | None:
    """Why `node` cannot be part of a generated kernel (None when it can)."""
    if node.is_scatter:
        return f"scatter ({SCATTER_OPS[node.reduce]}, runs through torch)"
    if is_contraction(node):
        return "contraction / GEMM outside any fused chain (runs as torch's GEMM)"
    if node.reduce == "prod":
        return "product reduction (runs through torch)"
    types = [graph.type_of[t] for t in (*node.inputs, node.name)]
    if any(not t.format.is_dense for t in types):
        return "reads or writes a sparse tensor (runs through torch)"
    if any(t.dtype not in GENERATED_DTYPES for t in types):
        return "dtype without a generated path"
    return None


@dataclass
class PartPlan:
    """One connected component of a group: the nodes of one tiled loop nest."""

    nodes: tuple[Node, ...]
    cls: dict  # (node name, var) -> class id
    extents: dict  # class id -> extent
    L: tuple  # local (reduced) classes, outer to inner
    P: tuple  # parallel classes, outer to inner
    stage: dict  # reduction name -> stage index; row-level node -> stage after which it is ready
    final_stage: int
    row_level: frozenset  # nodes whose value has no local axis (reductions, per-row math)
    outputs: tuple[str, ...]  # node outputs the part must store
    p_contiguous: bool  # the memory-contiguous class is parallel (column-reduction style)
    big_elem_bytes: int = 4
    cross_parallel: bool = False  # a large tensor is contiguous along the innermost parallel class
    online: dict = None  # sum reduction -> the max it is rescaled by (online softmax)
    scatters: tuple = ()  # (value, scatter node): the value is stored into the scatter's output (scatter_stores)
    scatter_only: frozenset = frozenset()  # values no one reads but their scatters: not stored themselves

    @property
    def transposed(self) -> bool:
        """Elementwise, with a large tensor contiguous along a parallel class: a transpose."""
        return self.cross_parallel and not self.reductions

    @property
    def crossed(self) -> bool:
        """A reduction whose large tensors disagree on the contiguous axis (one along a parallel
        class, others along the local ones)."""
        return self.cross_parallel and bool(self.reductions)

    @property
    def P_total(self) -> int:
        return _prod(self.extents[c] for c in self.P)

    @property
    def L_total(self) -> int:
        return _prod(self.extents[c] for c in self.L)

    @property
    def reductions(self) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.reduce)

    def classes_of(self, node: Node, vars_) -> set:
        return {self.cls[(node.name, v)] for v in vars_}


def _prod(xs) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def inlinable(graph: Graph, node: Node, names: set, known: dict | None = None) -> bool:
    """An elementwise node whose inputs are inputs of the group or inlinable themselves: a
    consumer that reads it through index arithmetic (a reshape of a concatenation, say)
    recomputes it at its own indices instead of reading it back from memory. `known` keeps the
    answers for one `names`: producers shared by many paths (an unrolled loop's) are asked once."""
    known = {} if known is None else known
    if node.name not in known:
        known[node.name] = not (node.reduce or node.is_scatter) and all(
            t not in names or inlinable(graph, graph.node_of[t], names, known) for t in node.inputs)
    return known[node.name]


def register_read(graph: Graph, consumer: Node, a: Access) -> bool:
    """The consumer reads the intermediate `a.tensor` point for point (each index a bare
    variable over the dimension's whole extent, or 0 of a kept size-1 dim), so the value can
    stay in registers. A variable that runs past the dimension (a concatenation reading one
    side over the other's range, under a `where`) is index arithmetic, like a reshape."""
    shape = graph.type_of[a.tensor].shape
    for i, size in zip(a.indices, shape):
        if isinstance(i, Var):
            if consumer.extents[i.name] != size:
                return False
        elif not (i == Lit(0) and size == 1):
            return False
    return True


def unify(graph: Graph, nodes) -> VarClasses:
    """Axis classes. A consumer's variable and the producer variable it reads through a plain
    index must be one class (any other access of an intermediate cannot stay in registers).
    Variables that index the same dimension of the same input are joined too, where that
    puts no two variables of one node together: then a max over x[i,k] and an exp over
    x[i,j] walk the same axis, as a softmax needs."""
    names = {n.name for n in nodes}
    uf = VarClasses()
    external: dict = {}
    known: dict = {}  # inlinable's answers over `names`
    for n in nodes:
        for v, _ in n.dims:
            uf.find((n.name, v))
        for a in n.accesses:
            if any(t in names for t in a.tensors - {a.tensor}):
                raise NotStitchable(f"{n.name} gathers through an intermediate of the group")
            if a.tensor not in names:
                for d, i in enumerate(a.indices):
                    if isinstance(i, Var):
                        external.setdefault((a.tensor, d), []).append((n.name, i.name))
                continue
            producer = graph.node_of[a.tensor]
            if not register_read(graph, n, a):
                if inlinable(graph, producer, names, known):
                    continue  # recomputed at the consumer's indices (emit.inline_body)
                raise NotStitchable(f"{n.name} reads {a} through index arithmetic")
            for pv, cv in zip(producer.out_vars, a.indices):
                if not isinstance(cv, Var):
                    continue  # a kept size-1 dim (keepdim=True) read at 0: a broadcast
                if uf.conflicts((producer.name, pv), (n.name, cv.name)):
                    raise NotStitchable(f"{n.name} reads {a} with one axis in two places")
                uf.union((producer.name, pv), (n.name, cv.name))
    for uses in external.values():
        for other in uses[1:]:
            uf.union(uses[0], other)  # refused (no-op) where it would join two variables of one node
    return uf


def components(graph: Graph, nodes, uf: VarClasses, memo: dict | None = None) -> list[list[Node]]:
    """Parts: nodes that share an axis class run in one loop nest, unless that nest would be
    a cross product (see _split_cross); independent parts can be packed. `memo` keeps the spreads
    of loop nests across calls on one graph (see _spread)."""
    out = []
    for g in _shared_class_groups(nodes, uf):
        out += _split_cross(graph, g, uf, {} if memo is None else memo)
    order = {n.name: k for k, n in enumerate(nodes)}
    return sorted(out, key=lambda g: order[g[0].name])


def _split_cross(graph: Graph, group: list[Node], uf: VarClasses, memo: dict) -> list[list[Node]]:
    """A part's loop nest is the product of its parallel axis classes, and every node is
    evaluated (and stored) at every point of it. Nodes that only share some classes through
    reading the same input (q·cos and -q[..., 64:] of a rotary embedding share the position
    axis of q, not the head or feature axes) would be recomputed and stored once per point of
    the classes they lack. So a group is cut into its data-flow components (nodes joined by
    register reads), and a component joins another's loop nest only where that makes no node
    run over parallel classes it lacks (two maps of one input then still read it once)."""
    names = {n.name for n in group}
    flows = [f for flow in _flows(graph, group, names) for f in _uncrossed(graph, flow, names, uf, memo)]
    if len(flows) == 1:
        return [group]
    order = {n.name: k for k, n in enumerate(group)}
    parts: list[list[Node]] = []
    spreads: list[dict] = []  # each part's _spread ({} for a flow that cannot share one nest even alone)
    for flow in flows:
        alone = _spread(graph, flow, uf, memo)
        for k, part in enumerate(parts if alone is not None else ()):
            merged = sorted(part + flow, key=lambda n: order[n.name])
            spread = _spread(graph, merged, uf, memo)
            if spread is not None and all(spread[n.name] <= max(alone.get(n.name, 1), spreads[k].get(n.name, 1))
                                          for n in merged):
                parts[k], spreads[k] = merged, spread
                break
        else:
            parts.append(list(flow))
            spreads.append(alone or {})
    return parts


def _flows(graph: Graph, nodes: list[Node], names: set, cut: frozenset = frozenset()) -> list[list[Node]]:
    """The data-flow components of `nodes`: nodes joined by register reads, except reads of the nodes in `cut`."""
    parent = {n.name: n.name for n in nodes}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for n in nodes:
        for a in n.accesses:
            if a.tensor in parent and a.tensor not in cut and register_read(graph, n, a):
                parent[find(a.tensor)] = find(n.name)
    flows: dict = {}
    for n in nodes:
        flows.setdefault(find(n.name), []).append(n)
    return list(flows.values())


def _uncrossed(graph: Graph, flow: list[Node], names: set, uf: VarClasses, memo: dict) -> list[list[Node]]:
    """A data-flow component whose own loop nest is a cross product, no node of it running over the whole nest: a
    rotary embedding's cos and sin tables, computed in the graph over (position, feature) and read by Q over 32
    heads and by K over 8, put both heads axes in one nest, so that every node ran (and stored) once per head of
    the other (Llama's first layer at 4 x 512 tokens: 421 µs on an H200). Such a component is cut at the nodes it
    evaluates at more than one point that their consumers can recompute (elementwise over the group's inputs):
    each consumer then recomputes them at its own indices, and the merge in _split_cross joins back what shares a
    nest without a cross. A component with a node over the whole nest is a broadcast (batch norm's per-channel
    values beside its outputs), and one with reductions is left whole too: the cut would part a reduction from
    its readers."""
    if any(n.reduce for n in flow):
        return [flow]
    spread = _spread(graph, flow, uf, memo)
    if spread is None or min(spread.values()) <= 1:  # a node runs over the whole nest: a broadcast, not a cross
        return [flow]
    known: dict = {}
    cut = frozenset(n.name for n in flow if spread[n.name] > 1 and inlinable(graph, n, names, known))
    return _flows(graph, flow, names, cut) if cut else [flow]


def _spread(graph: Graph, nodes: list[Node], uf: VarClasses, memo: dict) -> dict | None:
    """Per node: how many points of the loop nest `nodes` would share evaluate it at once
    (the product of the parallel classes it does not index); None when they cannot share one.
    A nest's plan depends on its nodes and on how their variables fall into classes, which is
    the memo's key: a group grown by one node at a time asks again for nine in ten of its nests."""
    ids: dict = {}
    key = tuple((n.name, tuple(ids.setdefault(uf.find((n.name, v)), len(ids)) for v, _ in n.dims)) for n in nodes)
    if key not in memo:
        memo[key] = _spread_of_plan(graph, nodes, uf)
    return memo[key]


def _spread_of_plan(graph: Graph, nodes: list[Node], uf: VarClasses) -> dict | None:
    try:
        plan = plan_part(graph, nodes, uf, set())
    except NotStitchable:
        return None
    out = {}
    for n in nodes:
        own = plan.classes_of(n, [v for v, _ in n.dims])
        out[n.name] = _prod(plan.extents[c] for c in plan.P if c not in own)
    return out


def _shared_class_groups(nodes, uf: VarClasses) -> list[list[Node]]:
    """Groups of nodes that share an axis class. A node without axes (a 0-d result, such as
    sqrt(x.sum())) shares none, so it joins the group of the producers it reads."""
    owner: dict = {}  # axis class -> group
    group_of: dict = {}  # node -> group
    groups: list[list[Node]] = []
    for n in nodes:
        roots = {uf.find((n.name, v)) for v, _ in n.dims}
        hits = sorted({owner[r] for r in roots if r in owner} if roots else {group_of[t] for t in n.inputs if t in group_of})
        if not hits:
            groups.append([n])
            g = len(groups) - 1
        else:
            g = hits[0]
            for other in hits[1:]:
                for moved in groups[other]:
                    group_of[moved.name] = g
                groups[g] += groups[other]
                for r, o in list(owner.items()):
                    if o == other:
                        owner[r] = g
                groups[other] = []
            groups[g].append(n)
        group_of[n.name] = g
        for r in roots:
            owner[r] = g
    order = {n.name: k for k, n in enumerate(nodes)}
    return [sorted(g, key=lambda n: order[n.name]) for g in groups if g]


def _inner_var(index) -> str | None:
    """The variable that moves fastest in an index expression (coefficient 1), if any."""
    if isinstance(index, Var):
        return index.name
    if isinstance(index, Sum):
        for c, a in index.terms:
            if c == 1 and isinstance(a, Var):
                return a.name
    if isinstance(index, Mod):
        return _inner_var(index.arg)
    return None


def _tensor_uses(graph: Graph, nodes):
    """(tensor name, numel, element bytes, index exprs, reading node) for every access and store."""
    for n in nodes:
        t = graph.type_of[n.name]
        yield n.name, _prod(t.shape), t.dtype.itemsize, n.index, n
        for a in n.accesses:
            t = graph.type_of[a.tensor]
            yield a.tensor, _prod(t.shape), t.dtype.itemsize, a.indices, n


def class_strides(graph: Graph, nodes, cls) -> tuple[dict, int]:
    """Stride of each class in the largest tensor it indexes (contiguous layout assumed), used
    to order classes so that the innermost one moves fastest; and the largest element size."""
    best: dict = {}
    uses = sorted(_tensor_uses(graph, nodes), key=lambda u: -u[1] * u[2])
    names = {n.name for n in nodes}
    external = [u for u in uses if u[0] not in names]  # what the kernel actually moves
    big_bytes = (external or uses)[0][2] if uses else 4
    for tensor, numel, itemsize, index, n in uses:
        shape = graph.type_of[tensor].shape
        stride = 1
        for d in reversed(range(len(index))):
            v = _inner_var(index[d])
            if v is not None:
                c = cls[(n.name, v)]
                if c not in best:
                    best[c] = (numel, stride)
            stride *= shape[d]
    return best, big_bytes


def plan_part(graph: Graph, nodes: list[Node], uf: VarClasses, outside_users: set) -> PartPlan:
    ids: dict = {}
    cls: dict = {}
    extents: dict = {}
    for n in nodes:
        for v, e in n.dims:
            c = ids.setdefault(uf.find((n.name, v)), len(ids))
            cls[(n.name, v)] = c
            if extents.setdefault(c, e) != e:
                raise NotStitchable(f"{n.name}: variable {v} has extent {e}, its class has {extents[c]}")
        if len({cls[(n.name, v)] for v, _ in n.dims}) != len(n.dims):
            raise NotStitchable(f"{n.name} indexes one axis twice (a diagonal)")
    red_sets = {frozenset(cls[(n.name, v)] for v in n.reduce_vars) for n in nodes if n.reduce}
    if len(red_sets) > 1:
        raise NotStitchable("reductions over different axes in one loop nest")
    strides, big_bytes = class_strides(graph, nodes, cls)
    order = sorted(extents, key=lambda c: -strides.get(c, (0, 1 << 62))[1])  # outer -> inner
    inner = min(strides, key=lambda c: (-strides[c][0], strides[c][1])) if strides else None
    if red_sets:
        (red,) = red_sets
        L = tuple(c for c in order if c in red)
    else:
        L = (inner,) if inner is not None else ()
    P = tuple(c for c in order if c not in L)
    _check_reductions_cover(nodes, cls, extents, P)
    cross = _cross_inner(graph, nodes, cls, L)
    if cross is not None and cross in P:  # a large tensor is contiguous along a parallel axis
        P = tuple(c for c in P if c != cross) + (cross,)
    online = _online_pairs(graph, nodes, cls)
    stage, final, row_level = _stages(graph, nodes, cls, set(L), online)
    outputs = tuple(n.name for n in nodes if n.name in outside_users)
    return PartPlan(tuple(nodes), cls, extents, L, P, stage, final, frozenset(row_level), outputs,
                    p_contiguous=inner is not None and inner in P, big_elem_bytes=big_bytes, online=online,
                    cross_parallel=cross is not None and cross in P)


def _check_reductions_cover(nodes, cls, extents, P) -> None:
    """Every program of a part evaluates each of its nodes at its own points, so a reduction whose
    result its readers broadcast along a parallel axis of their own (an RMS norm backward's row sum
    read by elementwise work over another tensor's feature axis: no shared input joins the two axes)
    would be reduced again at every point of that axis: 4096 times over in a Llama block. Such a
    reduction ends the kernel before its readers, which read its result from memory."""
    for n in nodes:
        if not n.reduce or n.is_scatter:
            continue
        own = {cls[(n.name, v)] for v, _ in n.dims}
        lacking = [extents[c] for c in P if c not in own and extents[c] > 1]
        if lacking:
            raise NotStitchable(f"{n.name}, a reduction, would be computed again at each of {_prod(lacking)} "
                                "points of a parallel axis it does not index (its readers broadcast it along an "
                                "axis of their own)")


def _cross_inner(graph: Graph, nodes, cls, L) -> int | None:
    """The contiguous class of a large external tensor or output that is not the innermost
    local class: a transpose, which wants square tiles so both sides stay coalesced."""
    names = {n.name for n in nodes}
    uses = sorted(_tensor_uses(graph, nodes), key=lambda u: -u[1] * u[2])
    if not uses or not L:
        return None
    biggest = uses[0][1] * uses[0][2]
    for tensor, numel, itemsize, index, n in uses:
        if numel * itemsize * 4 < biggest or (tensor in names and n.name != tensor):
            continue
        v = _inner_var(index[-1]) if index else None
        if v is not None and cls[(n.name, v)] != L[-1]:
            return cls[(n.name, v)]
    return None


def _canonical(e, node, cls):
    """A body with every variable renamed to its axis class, to compare bodies across nodes."""
    names = {v: f"_c{cls[(node.name, v)]}" for v, _ in node.dims}
    if isinstance(e, Read):
        return Read(Access(e.access.tensor, tuple(rename(i, names) for i in e.access.indices)))
    if isinstance(e, Call):
        return Call(e.op, tuple(_canonical(a, node, cls) for a in e.args))
    if isinstance(e, Cast):
        return Cast(e.dtype, _canonical(e.arg, node, cls))
    return e


def _strip_f32(e):
    while isinstance(e, Cast) and e.dtype == torch.float32:
        e = e.arg
    return e


def _online_pairs(graph: Graph, nodes, cls) -> dict:
    """Sum reductions of exp(A - M) with M = max(A) over the same axes: the sum can be taken
    in the pass that finds M, rescaling as the maximum grows (online softmax)."""
    by_name = {n.name: n for n in nodes}
    pairs = {}
    for r2 in nodes:
        if r2.reduce != "sum":
            continue
        body, owner = _strip_f32(r2.body), r2
        if isinstance(body, Read) and body.access.tensor in by_name and not by_name[body.access.tensor].reduce:
            owner = by_name[body.access.tensor]
            if graph.type_of[owner.name].dtype not in (torch.float32, torch.float64):
                continue
            body = _strip_f32(owner.body)
        if not (isinstance(body, Call) and body.op == "exp" and isinstance(body.args[0], Call)
                and body.args[0].op == "sub" and isinstance(body.args[0].args[1], Read)):
            continue
        a, m = body.args[0].args
        r1 = by_name.get(m.access.tensor)
        if r1 is None or r1.reduce != "max" or {cls[(r1.name, v)] for v in r1.reduce_vars} != \
                {cls[(r2.name, v)] for v in r2.reduce_vars}:
            continue
        if _canonical(a, owner, cls) == _canonical(r1.body, r1, cls):
            pairs[r2.name] = r1.name
    return pairs


def _stages(graph: Graph, nodes, cls, L: set, online: dict):
    """Stage of each reduction (1 + stage of the reductions it needs; an online sum shares
    its max's stage), readiness of row-level nodes, and the final stage where full-space
    outputs are written."""
    need: dict = {}  # node -> first stage where its value can be computed
    stage: dict = {}
    row_level = set()
    names = {n.name for n in nodes}
    for n in nodes:
        deps = [t for t in n.inputs if t in names]
        ready = max((need[d] for d in deps), default=0)
        if n.reduce:
            stage[n.name] = stage[online[n.name]] if n.name in online else ready
            need[n.name] = stage[n.name] + 1
            row_level.add(n.name)
        else:
            need[n.name] = ready
            if not ({cls[(n.name, v)] for v in n.out_vars} & L):
                row_level.add(n.name)
                stage[n.name] = ready
    final = max((need[n.name] for n in nodes if n.reduce), default=0)
    return stage, final, row_level

