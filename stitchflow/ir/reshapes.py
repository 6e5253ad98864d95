"""Flattened rows split back: a GEMM over a view of a 3-D value, computed in the value's own shape.

Code often flattens the leading axes before a matrix product and unflattens after it (GPT-2's
Conv1D: `x.view(-1, d) @ W`, then `.view(b, t, n)`). In the IR the views are index arithmetic:
the GEMM reads `x[r // t, r % t, k]` and its readers read `y[t*b + s, n]`. The matchers of chains
and epilogues look for plain accesses (the same point in every tensor), so such a GEMM and its
bias, activation and next GEMM stay apart.

`unflatten_rows` splits the flattened variable back (r = t*b + s, the output gains an axis) and
re-indexes every reader. The split spreads: a node whose plain access would become arithmetic
splits the same way, and so does the producer of what a split node reads at that variable. It
gives up, changing nothing, where the spread reaches a graph output, a reduction variable, a
scatter or a gathered index: every access that was plain stays plain, and one at least becomes
plain. Values are dense and row-major in the IR, so no element of any output changes.
"""

from __future__ import annotations

import dataclasses
import math

from .expr import Access, Read, map_reads, substitute_expr
from .graph import Graph, Node
from .index import Lit, Var, add, floordiv, free_vars, fresh_name, gathered_tensors, mod, scale
from .types import dense

Splits = dict[str, dict[str, tuple[int, ...]]]  # node -> {variable: the sizes it splits into}


def unflatten_rows(graph: Graph) -> Graph:
    """The graph with every flattened-rows view that can be split back split (the graph itself if none)."""
    tried: set = set()
    k, changed = 0, False
    while k < len(graph.nodes):  # a split keeps the nodes and their order: the scan goes on where it was
        node = graph.nodes[k]
        seed = next(((v, s) for v, s in _seeds(graph, node) if (node.name, v, s) not in tried), None)
        if seed is None:
            k += 1
            continue
        tried.add((node.name, *seed))
        grown = _grow(graph, {node.name: {seed[0]: seed[1]}})
        if grown is not None:
            graph = _applied(graph, *grown)
            changed = True
    return graph.validate() if changed else graph


def _seeds(graph: Graph, node: Node):
    """(variable, sizes) such that splitting the variable into `sizes` may make a read of `node` plain: the
    indices that one variable alone makes (in order, apart where heads are merged between them, with size-1
    zeros beside them), over dimensions whose product is its extent. `_grow` keeps a split only if it gains."""
    if node.is_scatter:
        return
    for access in node.accesses:
        if access.is_plain:
            continue
        shape = graph.type_of[access.tensor].shape
        for var in sorted(access.vars & set(node.out_vars)):
            run = _run_of(access, shape, var)
            if run is not None and math.prod(shape[c] for c in run) == node.extents[var]:
                yield var, tuple(shape[c] for c in run)


def _run_of(access: Access, shape, var: str) -> tuple[int, ...] | None:
    """The positions of `access` that index by `var` alone (a head merge spreads them apart), with size-1
    zeros beside them; None where `var` also appears mixed with another variable, or in one position only."""
    mine = [c for c, e in enumerate(access.indices) if free_vars(e) == {var}]
    if not mine or any(var in free_vars(e) for c, e in enumerate(access.indices) if c not in mine):
        return None
    lo, hi = mine[0], mine[-1]
    while lo > 0 and access.indices[lo - 1] == Lit(0) and shape[lo - 1] == 1:
        lo -= 1
    while hi + 1 < len(shape) and access.indices[hi + 1] == Lit(0) and shape[hi + 1] == 1:
        hi += 1
    run = tuple(range(lo, mine[0])) + tuple(mine) + tuple(range(mine[-1] + 1, hi + 1))
    return run if len(run) > 1 else None


def _grow(graph: Graph, splits: Splits) -> tuple[Splits, dict[str, Node]] | None:
    """Splits closed under the spread (see the module's docstring) and the nodes they rewrite, or None."""
    if not all(_can_split(graph, graph.node_of[n], v, s) for n, vs in splits.items() for v, s in vs.items()):
        return None
    for _ in range(len(graph.nodes) + 1):
        rewritten = _rewritten(graph, splits)
        if rewritten is None:
            return None
        lost = [(name, old, new) for name, node in rewritten.items()
                for old, new in zip(graph.node_of[name].accesses, node.accesses) if old.is_plain and not new.is_plain]
        if not lost:
            gained = sum(new.is_plain for node in rewritten.values() for new in node.accesses)
            had = sum(old.is_plain for name in rewritten for old in graph.node_of[name].accesses)
            return (splits, rewritten) if gained > had else None
        added, tensors = False, _tensor_splits(graph, splits)
        for name, old, new in lost:
            wanted = _requests(graph, splits, tensors, graph.node_of[name], old)
            if wanted is None:
                return None
            for target, var, sizes in wanted:
                known = splits.get(target, {}).get(var)
                if known is None and not _can_split(graph, graph.node_of[target], var, sizes):
                    return None
                if known is not None and known != sizes:
                    return None
                added |= known is None
                splits.setdefault(target, {})[var] = sizes
        if not added:
            return None
    return None


def _can_split(graph: Graph, node: Node, var: str, sizes) -> bool:
    if node.is_scatter or var not in node.out_vars or node.name in graph.outputs:
        return False  # a reduction variable split would make a GEMM's one reduction two
    return math.prod(sizes) == node.extents[var] and graph.type_of[node.name].format == dense(len(node.index))


def _tensor_splits(graph: Graph, splits: Splits) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{tensor: (the dimension split, its sizes)} of the split nodes' outputs."""
    found = {}
    for name, vs in splits.items():
        node = graph.node_of[name]
        for var, sizes in vs.items():
            found[name] = (node.out_vars.index(var), sizes)
    return found


def _rewritten(graph: Graph, splits: Splits) -> dict[str, Node] | None:
    """The split nodes and the readers of their outputs, rewritten; None where a split output is a gathered index."""
    tensors = _tensor_splits(graph, splits)
    if any(len(vs) > 1 for vs in splits.values()):
        return None  # one output dimension split per node keeps the bookkeeping simple; no case needs more
    readers = {r for t in tensors for r in graph.consumers.get(t, ())}
    out = {}
    for name in readers | set(splits):
        node = graph.node_of[name]
        if any(set(tensors) & (a.tensors - {a.tensor}) for a in node.accesses) or \
                any(set(tensors) & gathered_tensors(i) for i in node.index):
            return None
        out[name] = _rewrite_node(node, splits.get(name, {}), tensors)
    return out


def _rewrite_node(node: Node, var_splits: dict, tensors: dict) -> Node:
    ranges = node.extents
    body = map_reads(node.body, lambda a: Read(_reindexed(a, tensors, ranges)))
    if not var_splits:
        return dataclasses.replace(node, body=body)
    ((var, sizes),) = var_splits.items()
    taken = set(ranges)
    names = tuple(fresh_name(f"{var}{d}", taken) for d in range(len(sizes)))
    value = add(*(scale(Var(n), math.prod(sizes[d + 1:])) for d, n in enumerate(names)))
    dims = tuple(p for v, e in node.dims for p in (tuple(zip(names, sizes)) if v == var else ((v, e),)))
    new_ranges = dict(dims)
    body = substitute_expr(body, {var: value}, new_ranges)
    index = tuple(j for i in node.index for j in (tuple(map(Var, names)) if i == Var(var) else (i,)))
    return dataclasses.replace(node, body=body, index=index, dims=dims)


def _reindexed(access: Access, tensors: dict, ranges) -> Access:
    """A read of a split tensor at the split dimension's row-major coordinates."""
    if access.tensor not in tensors:
        return access
    dim, sizes = tensors[access.tensor]
    e = access.indices[dim]
    parts = []
    for d, size in enumerate(sizes):
        part = floordiv(e, math.prod(sizes[d + 1:]), ranges)
        parts.append(part if d == 0 else mod(part, size, ranges))
    return Access(access.tensor, access.indices[:dim] + tuple(parts) + access.indices[dim + 1:])


def _requests(graph: Graph, splits: Splits, tensors: dict, node: Node,
              old: Access) -> list[tuple[str, str, tuple]] | None:
    """The splits that would keep the plain access `old` of `node` plain: its variable at the split
    dimension of a split tensor split alike, or the read tensor split where a split variable reads it;
    None where that tensor is no node's (an input or a parameter) or a scatter's. `tensors`: `_tensor_splits`."""
    mine = splits.get(node.name, {})
    wanted = []
    for c, index in enumerate(old.indices):
        var = index.name
        if old.tensor in tensors and tensors[old.tensor][0] == c:
            wanted.append((node.name, var, tensors[old.tensor][1]))
        elif var in mine:
            producer = graph.node_of.get(old.tensor)
            if producer is None or not isinstance(producer.index[c], Var):
                return None
            wanted.append((producer.name, producer.index[c].name, mine[var]))
    return wanted


def _applied(graph: Graph, splits: Splits, rewritten: dict[str, Node]) -> Graph:
    types = dict(graph.types)
    for name, (dim, sizes) in _tensor_splits(graph, splits).items():
        t = types[name]
        shape = t.shape[:dim] + sizes + t.shape[dim + 1:]
        types[name] = dataclasses.replace(t, shape=shape, format=dense(len(shape)))
    nodes = tuple(rewritten.get(n.name, n) for n in graph.nodes)
    return dataclasses.replace(graph, nodes=nodes, types=tuple(types.items()))  # validated once, at the end
