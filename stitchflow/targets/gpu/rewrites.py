"""IR rewrites the gpu target applies to a graph before grouping it into kernels.

Sums over a few terms become additions, and maxima (and sums of what lies in memory) over sliding
windows of a few taps, i.e. pools, elementwise maxima and sums (`unroll_small_sums`). GQA's key and value gradients sum
over the query heads of a group (4 in Llama 3), and RoPE's backward reads that sum transposed: as
a reduction, the part takes the reduction's mapping, whose tiles keep the read's contiguous axis
fast and wrote the outputs two bytes per 256-byte row (96 µs for 8 MB in a Llama step on an H100);
as an elementwise part it takes square tiles that Triton transposes through shared memory.

One-hot select-sums become gathers. `s[i] = sum_k where(k == t[i], v[i,k], 0)` (cross-entropy
picking the target's log-probability, written as eager code often writes it) reads every
v[i,k] to keep one. It equals `where(0 <= t[i] < K, v[i, t[i]], 0)`: at most one k matches,
and every other term is an exact zero, so the rewrite changes no rounding. The selected value
is the body of v's elementwise producers evaluated at the gathered index, so after the
rewrite only the reductions that v needs (a log-softmax's max and sum) still stream over the
row: one read of the logits instead of a second pass that re-reads them for the select.

Scatter-adds over constant blocks of positions become gathers (`window_scatters`): nearest
upsampling's gradient, as AOTAutograd writes it, adds each output gradient into the input
position it was copied from, out[.., l // s, ..] += g[.., l, ..]; each input position sums its
own s (s·s in 2-D) gradients instead, with no scatter, no index tensors and no zeroed buffer.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import math

import torch

from ...ir.expr import Call, Cast, Const, IndexValue, Read, map_reads, substitute_expr
from ...ir.graph import Graph, Node
from ...ir.interpret import eval_node
from ...ir.index import Gather, Lit, Mod, Var, add, affine_terms, free_vars, fresh_name, scale
from .analysis import is_contraction
from .emit import inline_body

INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def gather_one_hots(graph: Graph) -> Graph:
    """The graph with every one-hot select-sum replaced by a gather (and the nodes only that
    sum read dropped); the graph itself when there is none."""
    changed = {}
    for node in graph.nodes:
        new = one_hot_gather(graph, node)
        if new is not None:
            changed[node.name] = new
    if not changed:
        return graph
    nodes = tuple(changed.get(n.name, n) for n in graph.nodes)
    return drop_dead(dataclasses.replace(graph, nodes=nodes))


SMALL_SUM = 8  # terms a sum may have to be unrolled
SMALL_WINDOW = 16  # taps a sliding window (a pool, a pool's gradient) may have to be unrolled


def unroll_small_sums(graph: Graph) -> Graph:
    """The graph with small reductions written as one elementwise expression of their terms:

    - a floating-point sum over at most SMALL_SUM terms whose operand is read from memory (an
      input, a GEMM's product) by this sum alone. Where other nodes read the operand, or a
      producer would be stitched into the same kernel, the summed axis stays a loop axis of the
      part (a layer norm over a short row), which the reduction's mapping serves;
    - a floating-point max or sum over a sliding window of at most SMALL_WINDOW taps (a read's
      index moves with both an output and a window coordinate: max pooling, a stride-1 average
      pool, a max pool's gradient gathered from the windows that may hold each position). As a
      reduction the window is the fast axis of the part's tiles: 9 taps padded to 16 lanes whose
      addresses jump by a row, where the output's contiguous axis (channels, for a channels-last
      pool) should be; unrolled, each tap is one coalesced read of a tile of outputs, which the
      taps' neighbours share through the cache (ResNet-18's stem pool and its indices: 313 µs ->
      43 µs on an H100, torch.compile 49). Unrolled taps are costly to compute twice, so the
      grouping keeps them out of a kernel that would need them in two of its passes
      (`grouping.recomputed_stencils`: the stem's pool gradient had become part of the batch norm
      backward it feeds and was gathered again in each phase of its split, 582 µs against 408).

    A sum's terms are added in its accumulation type (float32, float64 for float64), so rounding
    happens once, as the sum's; a max is exact in any order. Not GEMM-like products (they run as
    library GEMMs)."""
    changed = {}
    readers = collections.Counter(t for n in graph.nodes for t in set(n.inputs))
    for node in graph.nodes:
        if _unrollable(graph, node, readers):
            changed[node.name] = _unrolled(graph, node)
    if not changed:
        return graph
    return dataclasses.replace(graph, nodes=tuple(changed.get(n.name, n) for n in graph.nodes))


def window_scatters(graph: Graph, params: dict) -> Graph:
    """The graph with each scatter-add over constant blocks, out[.., c[l], ..] += v[.., l, ..] where c
    (a parameter, or a node computed from coordinates alone) is arange(n) // s, written as a sum of
    windows, out[.., p, ..] =
    sum_{r < s} v[.., s·p + r, ..], unrolled where it has at most SMALL_WINDOW terms. Torch ran the
    scatter (a U-Net's nearest-upsampling gradients) with int64 index tensors of the gradient's size,
    three adds and an index_add per upsampling: 150 µs of the step on an H100; the sum is a stitched
    kernel's node like any other. Each window is one output's s gradients, so nothing else is summed
    and the terms add in float32 as the scatter's accumulation did."""
    changed = {}
    for node in graph.nodes:
        blocks = _constant_blocks(graph, node, params)
        if blocks:
            windowed = _windowed(graph, node, blocks)
            terms = math.prod(s for _, s in blocks.values())
            changed[node.name] = _unrolled(graph, windowed) if terms <= SMALL_WINDOW else windowed
    if not changed:
        return graph
    return dataclasses.replace(graph, nodes=tuple(changed.get(n.name, n) for n in graph.nodes))


def _constant_blocks(graph: Graph, node: Node, params: dict) -> dict[int, tuple[str, int]] | None:
    """{output position: (its variable v, block size s)} where a sum-scatter's index there is c[v], c a
    constant arange(n) // s of n = s x (the output's size there) entries, v used nowhere else in the index
    and nothing but such v summed; None where the node is not such a scatter."""
    if node.reduce != "sum" or not node.is_scatter:
        return None
    shape = graph.type_of[node.name].shape
    plain = {i.name for i in node.index if isinstance(i, Var)}
    blocks: dict[int, tuple[str, int]] = {}
    for k, idx in enumerate(node.index):
        if isinstance(idx, Var):
            continue
        if isinstance(idx, Mod) and idx.modulus == shape[k]:
            idx = idx.arg  # index_put's wrap of negative indices: none below, c's entries are in [0, shape[k])
        if not (isinstance(idx, Gather) and len(idx.indices) == 1 and isinstance(idx.indices[0], Var)):
            return None
        v, c = idx.indices[0].name, _constant(graph, idx.tensor, params)
        n = node.extents[v]
        if c is None or v in plain or v in {u for u, _ in blocks.values()} or c.dim() != 1 or c.numel() != n or \
                n % shape[k]:
            return None
        s = n // shape[k]
        if c.is_floating_point() or not torch.equal(c.cpu(), torch.arange(n, dtype=c.dtype) // s):
            return None
        blocks[k] = (v, s)
    if set(node.reduce_vars) != {v for v, _ in blocks.values()}:
        return None
    return blocks


def _constant(graph: Graph, name: str, params: dict, depth: int = 0) -> torch.Tensor | None:
    """The value of `name` where it is a constant: a parameter, or a small node computed from
    coordinates and constants alone (an arange // 2), evaluated here; None otherwise."""
    if name in params:
        return params[name]
    node = graph.node_of.get(name)
    if node is None or node.reduce or node.is_scatter or depth > 8 or math.prod(graph.type_of[name].shape) > 1 << 16:
        return None
    env = {}
    for t in node.inputs:
        env[t] = _constant(graph, t, params, depth + 1)
        if env[t] is None:
            return None
    return eval_node(node, env, graph.type_of[name])


def _windowed(graph: Graph, node: Node, blocks: dict[int, tuple[str, int]]) -> Node:
    """The scatter as a reduction: v = s·p + r, p the output's variable there, r summed over the block."""
    shape = graph.type_of[node.name].shape
    taken = {v for v, _ in node.dims}
    index, dims, mapping = list(node.index), [(v, n) for v, n in node.dims if v not in
                                              {u for u, _ in blocks.values()}], {}
    for k, (v, s) in blocks.items():
        p, r = fresh_name(f"{v}_at", taken), fresh_name(f"{v}_in", taken)
        index[k] = Var(p)
        dims += [(p, shape[k]), (r, s)]
        mapping[v] = add(scale(Var(p), s), Var(r))
    extents = dict(dims)
    return dataclasses.replace(node, index=tuple(index), dims=tuple(dims),
                               body=substitute_expr(node.body, mapping, extents))


def sink_widening_casts(graph: Graph) -> Graph:
    """The graph with each widening float cast of a computed value, `c = float32(m)` (m a bfloat16
    node), moved into its readers: they read `float32(m[...])`, so that where c would cross between
    kernels, m is stored instead, in half the bytes. A widening cast is exact, so no value changes.
    ResNet-18's stem backward: the max pool's gradient met the batch norm backward's cast to float32
    in another kernel, and 103 MB went through memory where 51 MB now do.

    Only where every reader takes it: not a graph output, not read by a GEMM-like product (the
    library matmuls and convolutions read tensors, not expressions), and m not a GEMM's product
    (attention and chain matchers walk the nodes after those). m may be an input: its readers then
    read it as stored (a U-Net's group norm gradient read float32(x) of its activations in two
    kernels, which stored the float32 copy between them)."""
    sunk = {node.name: node.body.arg.access.tensor for node in graph.nodes if _sinkable(graph, node)}
    if not sunk:
        return graph

    def read(access):
        if access.tensor not in sunk:
            return Read(access)
        return Cast(graph.type_of[access.tensor].dtype, Read(dataclasses.replace(access, tensor=sunk[access.tensor])))

    return dataclasses.replace(graph, nodes=tuple(
        n if not set(n.inputs) & sunk.keys() else dataclasses.replace(n, body=map_reads(n.body, read))
        for n in graph.nodes))


def _sinkable(graph: Graph, node: Node) -> bool:
    body = node.body
    if node.reduce or node.is_scatter or node.name in graph.outputs or not isinstance(body, Cast) or \
            not isinstance(body.arg, Read):
        return False
    source = body.arg.access
    producer = graph.node_of.get(source.tensor)
    wide, narrow = graph.type_of[node.name].dtype, graph.type_of[source.tensor].dtype
    if (producer is None and source.tensor not in graph.inputs) or (producer is not None and is_contraction(producer)) \
            or not (wide.is_floating_point and narrow.is_floating_point) or \
            wide.itemsize <= narrow.itemsize or source.indices != tuple(Var(v) for v in node.out_vars) or \
            graph.type_of[source.tensor].shape != graph.type_of[node.name].shape:
        return False
    readers = graph.consumers.get(node.name, ())
    return bool(readers) and not any(is_contraction(graph.node_of[r]) for r in readers)


def _unrollable(graph: Graph, node: Node, readers) -> bool:
    dtype = graph.type_of[node.name].dtype
    if node.reduce not in ("sum", "max") or node.is_scatter or not node.reduce_vars or not dtype.is_floating_point:
        return False
    if is_contraction(node):
        return False
    terms = math.prod(node.extents[v] for v in node.reduce_vars)
    if terms <= SMALL_WINDOW and _slides(node):
        return True
    summed = {a.tensor for a in node.accesses if a.vars & set(node.reduce_vars)}
    if any(readers[t] > 1 or not _in_memory(graph, t) for t in summed):
        return False
    return terms <= SMALL_SUM or (terms <= SMALL_WINDOW and _slides(node))


def _slides(node: Node) -> bool:
    """Whether some read's index slides over overlapping windows: x[s·o + k] with the output's
    stride s under the window's span (pools, whose windows overlap), not x[K·o + k] over a
    reshaped axis (a sum over the heads of a group: the row-reduction rule's case)."""
    reduced = set(node.reduce_vars)
    for access in node.accesses:
        for index in access.indices:
            terms, _ = affine_terms(index)
            strides = [abs(c) for atom, c in terms.items() if free_vars(atom) and not free_vars(atom) & reduced]
            for atom, c in terms.items():
                if isinstance(atom, Var) and atom.name in reduced and any(
                        s < abs(c) * node.extents[atom.name] for s in strides):
                    return True
    return False


def _unrolled(graph: Graph, node: Node) -> Node:
    extents = [node.extents[v] for v in node.reduce_vars]
    terms = [substitute_expr(node.body, dict(zip(node.reduce_vars, map(Lit, point))), node.extents)
             for point in itertools.product(*map(range, extents))]
    if node.reduce == "sum":
        acc = torch.promote_types(graph.type_of[node.name].dtype, torch.float32)
        body = functools.reduce(lambda a, b: Call("add", (a, b)), [Cast(acc, t) for t in terms])
    else:
        body = functools.reduce(lambda a, b: Call("max", (a, b)), terms)
    dims = tuple((v, n) for v, n in node.dims if v not in node.reduce_vars)
    return dataclasses.replace(node, body=body, dims=dims, reduce=None)


def _in_memory(graph: Graph, tensor: str) -> bool:
    """Whether `tensor` is read from memory wherever it is: an input, or a GEMM's product."""
    producer = graph.node_of.get(tensor)
    return producer is None or is_contraction(producer)


def drop_dead(graph: Graph) -> Graph:
    """Without the nodes no output depends on."""
    live, todo = set(), [o for o in graph.outputs if o in graph.node_of]
    while todo:
        name = todo.pop()
        if name not in live:
            live.add(name)
            todo += [t for t in graph.node_of[name].inputs if t in graph.node_of]
    return dataclasses.replace(graph, nodes=tuple(n for n in graph.nodes if n.name in live))


def one_hot_gather(graph: Graph, node: Node) -> Node | None:
    """`node` as a gather when it is a one-hot select-sum over one variable, else None."""
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1:
        return None
    (k,) = node.reduce_vars
    ranges = node.extents
    casts, body = _peel_casts(_look_through(graph, node.body, ranges))
    wcast, select = _peel_casts(_look_through(graph, body, ranges))
    if not (isinstance(select, Call) and select.op == "where" and _is_zero(select.args[2])):
        return None
    conjuncts = _conjuncts(_look_through(graph, select.args[0], ranges), graph, ranges)
    hits = [(c, _one_hot_target(graph, c, k)) for c in conjuncts]
    found = [(c, t) for c, t in hits if t is not None]
    if len(found) != 1:
        return None
    eq, (target, gathered) = found[0]
    at = {k: gathered}
    extent = ranges[k]
    in_range = Call("and", (Call("ge", (target, Const(0))), Call("lt", (target, Const(extent)))))
    rest = [substitute_expr(_inline_reads_of(graph, c, k, ranges), at, ranges) for c in conjuncts if c is not eq]
    cond = in_range
    for c in rest:
        cond = Call("and", (cond, c))
    value = substitute_expr(_inline_reads_of(graph, select.args[1], k, ranges), at, ranges)
    new_body = _wrap(casts, _wrap(wcast, Call("where", (cond, value, select.args[2]))))
    dims = tuple((v, n) for v, n in node.dims if v != k)
    if k in _vars(new_body):
        return None
    return dataclasses.replace(node, body=new_body, dims=dims, reduce=None)


def _look_through(graph: Graph, e, ranges):
    """A read of an elementwise node becomes that node's body at the read's indices (cast to
    its dtype, as the node rounds its result); anything else stays."""
    if isinstance(e, Read) and _elementwise(graph, e.access.tensor):
        producer = graph.node_of[e.access.tensor]
        return Cast(graph.type_of[producer.name].dtype, inline_body(producer, e.access.indices, ranges))
    return e


def _elementwise(graph: Graph, tensor: str) -> bool:
    node = graph.node_of.get(tensor)
    return node is not None and node.reduce is None and not node.is_scatter and not node.reduce_vars


def _peel_casts(e) -> tuple[list, object]:
    casts = []
    while isinstance(e, Cast):
        casts.append(e.dtype)
        e = e.arg
    return casts, e


def _wrap(casts: list, e):
    for dtype in reversed(casts):
        e = Cast(dtype, e)
    return e


def _is_zero(e) -> bool:
    _, e = _peel_casts(e)
    return isinstance(e, Const) and not isinstance(e.value, bool) and e.value == 0


def _conjuncts(cond, graph: Graph, ranges) -> list:
    _, c = _peel_casts(cond)
    if isinstance(c, Call) and c.op == "and":
        return [x for a in c.args for x in _conjuncts(_look_through(graph, a, ranges), graph, ranges)]
    return [c]


def _one_hot_target(graph: Graph, cond, k: str):
    """For `iota(k) == t` (either side), t an integer read that does not depend on k:
    (t as a value, t as a gathered index); else None."""
    if not (isinstance(cond, Call) and cond.op == "eq"):
        return None
    for iota, other in (cond.args, cond.args[::-1]):
        if _is_iota(iota, k):
            gathered = _as_gather(graph, other, k)
            if gathered is not None:
                return other, gathered
    return None


def _is_iota(e, k: str) -> bool:
    casts, e = _peel_casts(e)
    return all(d in INDEX_DTYPES for d in casts) and isinstance(e, IndexValue) and e.index == Var(k)


def _as_gather(graph: Graph, e, k: str):
    """An integer read t[idx] with k nowhere in idx, seen through widening casts (a narrowing
    cast could wrap, and then the value compared is not the value gathered)."""
    casts, inner = _peel_casts(e)
    if not isinstance(inner, Read):
        return None
    dtype = graph.type_of[inner.access.tensor].dtype
    if dtype not in INDEX_DTYPES or any(d != torch.int64 and d != dtype for d in casts):
        return None
    if any(k in free_vars(i) for i in inner.access.indices):
        return None
    return Gather(inner.access.tensor, inner.access.indices)


def _inline_reads_of(graph: Graph, e, k: str, ranges):
    """Inline the elementwise producers of every read that depends on k (recursively), so
    that substituting k reads graph inputs and reductions only."""
    if isinstance(e, Read):
        if k in e.access.vars and _elementwise(graph, e.access.tensor):
            return _inline_reads_of(graph, _look_through(graph, e, ranges), k, ranges)
        return e
    if isinstance(e, Call):
        return Call(e.op, tuple(_inline_reads_of(graph, a, k, ranges) for a in e.args))
    if isinstance(e, Cast):
        return Cast(e.dtype, _inline_reads_of(graph, e.arg, k, ranges))
    return e


def _vars(e) -> frozenset:
    if isinstance(e, Read):
        return e.access.vars
    if isinstance(e, IndexValue):
        return free_vars(e.index)
    if isinstance(e, Call):
        return frozenset().union(*(_vars(a) for a in e.args))
    if isinstance(e, Cast):
        return _vars(e.arg)
    return frozenset()
