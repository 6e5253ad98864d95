"""Attention patterns in the IR: softmax(t(Q·Kᵀ))·V recognised as one match (what attention.AttentionStep runs).

    matches, refusals = match_attention(graph, params)  # AttentionMatch(scores .. output); why not, per miss

attention.py describes what a match is and how its mask folds; this module finds them, and says for each softmax·V
contraction that is not one why not.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ...ir.expr import Access, Call, Const, Read
from ...ir.graph import Graph, Node
from ...ir.index import Div, Var, affine_terms, rename
from .attention_fold import NotAttention
from .attention_kernel import MAX_BATCH_AXES

SOFTMAX_KINDS = {"softmax"}


@dataclass(frozen=True)
class AttentionMatch:
    nodes: tuple[str, ...]      # scores, the transform's nodes, softmax's four, output: graph order
    scores: str
    transform: tuple[str, ...]
    probs: str                  # the softmax's output
    output: str
    q: Access
    k: Access
    v: Access
    key_bias: Access | None = None  # a tensor of the call added to the scores per key (a padding mask),
                                    # its indices over the scores' variables
    groups: tuple[int, ...] = ()  # per batch axis of the scores, G where K or V read it as h // G (grouped heads)
    # a boolean mask over (batch..., query, key) read when the call runs (transformers' masks with padding, a
    # mask input): where(mask, scores, -inf); its indices over the scores' variables. Torch's attention takes it.
    call_mask: Access | None = None
    # with a call mask: (kept, rows), the frontend's zeroing of queries whose every key is masked
    # (ops_attention._zero_fully_masked_rows). Torch's attention, which runs a call mask, has its own answer there
    # (zeros on the CPU; cuDNN's answer on a Hopper GPU is not zeros), so the step's result is the rows node's,
    # as eager's is the library's on each device.
    zeroed: tuple[str, str] = ()

    @property
    def result(self) -> str:
        """The node whose value the step produces: the attention's output, or the rows zeroed after it."""
        return self.zeroed[1] if self.zeroed else self.output

    def within(self, nodes: set) -> AttentionMatch | None:
        """The match as a region holding `nodes` can run it: whole, or without the zeroed rows where the planner put
        them in another region (the rows then run there as stitched kernels); None where the attention is not inside."""
        if set(self.nodes) <= nodes:
            return self
        if self.zeroed and set(self.nodes) - set(self.zeroed) <= nodes:
            return dataclasses.replace(self, nodes=tuple(n for n in self.nodes if n not in self.zeroed), zeroed=())
        return None

    def __str__(self) -> str:
        bias = f", key bias {self.key_bias}" if self.key_bias else f", mask {self.call_mask}" if self.call_mask else ""
        zeroed = f", then {self.zeroed[1]}: torch's answer for queries with no key" if self.zeroed else ""
        return f"attention {self.scores} .. {self.output} ({len(self.transform)} score nodes{bias}{zeroed})"


# ---------------------------------------------------------------- matching

def _affine_vars(access: Access) -> frozenset[str] | None:
    """The variables of an access whose every index is an integer combination of variables."""
    names = set()
    for index in access.indices:
        terms, _ = affine_terms(index)
        if not all(isinstance(atom, Var) for atom in terms):
            return None
        names |= {atom.name for atom in terms}
    return frozenset(names)


def _read_vars(access: Access) -> frozenset[str] | None:
    """The variables of an access whose every index is an integer combination of variables and of variables
    divided by a constant (K and V of grouped heads, read at h // G)."""
    names = set()
    for index in access.indices:
        for atom in affine_terms(index)[0]:
            atom = atom.arg if isinstance(atom, Div) else atom
            if not isinstance(atom, Var):
                return None
            names.add(atom.name)
    return frozenset(names)


def _divisors(access: Access) -> dict[str, int]:
    return {atom.arg.name: atom.divisor for index in access.indices for atom in affine_terms(index)[0]
            if isinstance(atom, Div)}


def _groups(batch: list, out_batch: tuple, q: Access, k: Access, v: Access, extents: dict) -> tuple[int, ...]:
    """G per batch axis: 1, or the divisor where K or V read the axis as h // G (torch's enable_gqa; the kernel
    then walks the axis as (h // G, h % G), K and V with stride 0 along the second)."""
    by_var = [_divisors(q), _divisors(k), {b: g for o, g in _divisors(v).items() for b, ob in zip(batch, out_batch)
                                           if o == ob}]
    stray = {name for d in by_var[:2] for name in d} - set(batch) | set(_divisors(v)) - set(out_batch)
    if stray:
        raise NotAttention(f"Q, K or V read {sorted(stray)} divided: only batch axes may be grouped")
    groups = []
    for b in batch:
        found = {d[b] for d in by_var if b in d}
        if len(found) > 1 or (found and extents[b] % next(iter(found))):
            raise NotAttention(f"axis {b} of {extents[b]} is read in groups of {sorted(found)}")
        groups.append(found.pop() if found else 1)
    if len(batch) + sum(g > 1 for g in groups) > MAX_BATCH_AXES:
        raise NotAttention(f"{len(batch)} batch axes, grouped {groups} (at most {MAX_BATCH_AXES} in all)")
    return tuple(groups)


def _contraction_reads(node: Node) -> tuple[Access, Access] | None:
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1:
        return None
    accesses = node.accesses
    if len(accesses) != 2 or any(_read_vars(a) is None for a in accesses):
        return None
    return accesses


def _softmax_nodes(graph: Graph, probs: Node) -> dict[str, Node]:
    tagged = [n for n in graph.nodes if n.tag == probs.tag]
    by_role = {}
    for n in tagged:
        role = "max" if n.reduce == "max" else "sum" if n.reduce == "sum" else "probs" if n is probs else "exp"
        if role in by_role:
            raise NotAttention(f"softmax {probs.name} has more than one {role} node")
        by_role[role] = n
    if set(by_role) != {"max", "sum", "exp", "probs"}:
        raise NotAttention(f"softmax {probs.name} is not max, exp, sum, div")
    return by_role


def _match_at(graph: Graph, out: Node, params: set) -> AttentionMatch:
    """The attention pattern ending in contraction `out`, or NotAttention with the reason."""
    node_of, consumers = graph.node_of, graph.consumers
    pv = _contraction_reads(out)
    if pv is None:
        raise NotAttention(f"{out.name} is not a contraction of two affine reads")
    r = out.reduce_vars[0]
    out_batch = out.out_vars[:-2]
    p_read = next((a for a in pv if a.tensor in node_of and a.indices == tuple(map(Var, out.out_vars[:-1] + (r,)))),
                  None)
    if p_read is None:
        raise NotAttention(f"{out.name} does not read a node as P[..., l, r] with r summed")
    probs = node_of[p_read.tensor]
    if probs.tag is None or probs.tag.kind not in SOFTMAX_KINDS:
        raise NotAttention(f"{out.name} reads {probs.name}, not a softmax")
    v = pv[1] if pv[0] is p_read else pv[0]
    if v.tensor == p_read.tensor:
        raise NotAttention(f"{out.name} multiplies the softmax by itself")
    soft = _softmax_nodes(graph, probs)
    (x_access,) = {a for a in soft["max"].accesses}
    if soft["max"].reduce_vars != (soft["max"].dims[-1][0],) or x_access.indices[-1] != Var(soft["max"].reduce_vars[0]):
        raise NotAttention(f"softmax {probs.name} does not run over the last axis")
    transform, name, key_bias, masks = [], x_access.tensor, [], []
    while name in node_of and node_of[name].reduce is None:
        transform.append(_transform_node(graph, node_of[name], params))
        name = transform[-1][1]
        key_bias += transform[-1][2]
        masks += [(transform[-1][0], a) for a in transform[-1][3]]
    if len(key_bias) + len(masks) > 1:
        raise NotAttention(f"the scores read {len(key_bias) + len(masks)} tensors of the call "
                           f"({', '.join(map(str, key_bias + [a for _, a in masks]))}); one key bias or mask at most")
    if name not in node_of:
        raise NotAttention(f"the scores before softmax {probs.name} come from {name}, not a contraction")
    scores = node_of[name]
    qk = _contraction_reads(scores)
    if qk is None:
        raise NotAttention(f"{scores.name} is not a contraction of two affine reads")
    *batch, l_var, m_var = scores.out_vars
    d = scores.reduce_vars[0]
    q, k = _order_qk(qk, set(batch), l_var, m_var, d)
    if len(batch) != len(out_batch) or len(batch) > MAX_BATCH_AXES:
        raise NotAttention(f"{len(batch)} batch axes (at most {MAX_BATCH_AXES})")
    if not _read_vars(v) <= set(out_batch) | {r, out.out_vars[-1]} or out.out_vars[-1] not in _read_vars(v):
        raise NotAttention(f"{out.name} reads {v} over axes beyond batch, key and feature")
    groups = _groups(batch, out_batch, q, k, v, scores.extents)
    inner = [scores.name, *(t[0].name for t in transform), *(n.name for n in soft.values())]
    for n in inner:
        users = set(consumers.get(n, ())) - set(inner) - {out.name}
        if users or n in graph.outputs:
            raise NotAttention(f"{n} is also read outside the attention ({sorted(users) or 'a program output'})")
    mask, zeroed = None, ()
    if masks:
        (node, read), = masks
        mask = Access(read.tensor, tuple(rename(i, dict(zip(node.out_vars, scores.out_vars))) for i in read.indices))
        zeroed = _zeroed_rows(graph, out, mask.tensor)
    nodes = tuple(n.name for n in graph.nodes if n.name in set(inner) | {out.name, *zeroed})
    return AttentionMatch(nodes, scores.name, tuple(t[0].name for t in reversed(transform)), probs.name,
                          out.name, q, k, v, _on_scores_vars(key_bias, transform, scores),
                          groups if any(g > 1 for g in groups) else (), mask, zeroed)


def _zeroed_rows(graph: Graph, out: Node, mask: str) -> tuple[str, str] | tuple[()]:
    """(kept, rows) where the attention's only reader is the zeroing that lowering F.scaled_dot_product_attention
    put after it (kept = max over the keys of the mask, rows = where(kept > 0, out, 0): ops of their own, named
    after the attention's op) and nothing else reads either; () otherwise."""
    readers = graph.consumers.get(out.name, ())
    if len(readers) != 1 or out.name in graph.outputs:
        return ()
    rows = graph.node_of[next(iter(readers))]
    body = rows.body
    if not (rows.origin == f"{out.origin}.rows" and isinstance(body, Call) and body.op == "where"
            and isinstance(body.args[0], Call) and body.args[0].op == "gt" and isinstance(body.args[0].args[0], Read)
            and isinstance(body.args[1], Read) and body.args[1].access.tensor == out.name
            and body.args[1].access.indices == tuple(map(Var, rows.out_vars))
            and isinstance(body.args[2], Const) and body.args[2].value == 0):
        return ()
    kept = graph.node_of.get(body.args[0].args[0].access.tensor)
    if kept is None or kept.origin != f"{out.origin}.kept" or kept.reduce != "max" or set(kept.inputs) != {mask} \
            or set(graph.consumers.get(kept.name, ())) != {rows.name} or kept.name in graph.outputs:
        return ()
    return kept.name, rows.name


def _on_scores_vars(key_bias: list, transform, scores: Node) -> Access | None:
    """The key bias's access with the reading node's variables renamed to the scores' (position by position)."""
    if not key_bias:
        return None
    (node,) = [n for n, _, bias, _ in transform if bias]
    names = dict(zip(node.out_vars, scores.out_vars))
    return Access(key_bias[0].tensor, tuple(rename(i, names) for i in key_bias[0].indices))


def _call_mask(graph: Graph, node: Node, chain: Access, params: set) -> Access | None:
    """The mask of `node` = where(mask[batch..., l, m], t(scores), -inf) with a boolean mask that varies over a
    batch axis (a padding mask combined with a causal one, as transformers builds them) or is computed by the call,
    read when the call runs; a constant mask over (query, key) alone folds into tiles instead."""
    body = node.body
    if not (isinstance(body, Call) and body.op == "where" and isinstance(body.args[0], Read)
            and isinstance(body.args[2], Const) and body.args[2].value == -math.inf):
        return None
    read = body.args[0].access
    *batch, l_var, m_var = node.out_vars
    vars_ = _affine_vars(read)
    if read.tensor == chain.tensor or vars_ is None or not {l_var, m_var} <= vars_ <= set(batch) | {l_var, m_var} \
            or (read.tensor in params and vars_ <= {l_var, m_var}) or graph.type_of[read.tensor].dtype != torch.bool:
        return None
    return read


def _transform_node(graph: Graph, node: Node, params: set) -> tuple[Node, str, list[Access], list[Access]]:
    """An elementwise node over the scores: (node, the node it transforms, reads of a per-key bias
    that the call passes, reads of a mask over the batch, query and key that the call computes), or
    NotAttention."""
    if node.is_scatter:
        raise NotAttention(f"{node.name} scatters")
    *batch, l_var, m_var = node.out_vars
    chain = [a for a in node.accesses if a.tensor not in params and a.indices == node.index]
    if len(chain) != 1:
        raise NotAttention(f"{node.name} reads {[str(a) for a in chain]}: a score transform reads the "
                           f"scores as they are and otherwise only constants or a per-key bias")
    mask = _call_mask(graph, node, chain[0], params)
    if mask is not None:
        return node, chain[0].tensor, [], [mask]
    others = [a for a in node.accesses if a.tensor not in params and a.indices != node.index]
    for a in others:
        vars_ = _affine_vars(a)
        if vars_ is None or m_var not in vars_ or not vars_ <= set(batch) | {m_var} or a.tensor in graph.node_of:
            raise NotAttention(f"{node.name} reads {a}: besides constants, a score transform reads only a "
                               f"tensor of the call indexed by batch axes and the key (a padding mask)")
    for a in node.accesses:
        if a.tensor in params and not a.vars <= {l_var, m_var}:
            raise NotAttention(f"{node.name} reads {a}, which varies over the batch axes (a mask per head "
                               f"or per sequence is not folded yet)")
    return node, chain[0].tensor, others, []


def _order_qk(accesses, batch: set, l_var: str, m_var: str, d: str) -> tuple[Access, Access]:
    for q, k in (accesses, accesses[::-1]):
        qv, kv = _read_vars(q), _read_vars(k)
        if {l_var, d} <= qv <= batch | {l_var, d} and {m_var, d} <= kv <= batch | {m_var, d}:
            return q, k
    raise NotAttention(f"the scores do not read Q over (query, d) and K over (key, d): {accesses[0]}, {accesses[1]}")


def constants(graph: Graph, params) -> set[str]:
    """Parameters, and the nodes computed from parameters alone (a mask compared with 0 in the
    graph, as torch.compile hands it over) or from positions alone (a causal mask built from aranges,
    as transformers builds it): values known when the program is compiled."""
    known = set(params)
    for node in graph.nodes:
        if set(node.inputs) <= known:
            known.add(node.name)
    return known


def match_attention(graph: Graph, params) -> tuple[list[AttentionMatch], list[str]]:
    """Every attention pattern of the graph, and for each softmax·V contraction that is not one, why."""
    params = constants(graph, params)
    found, refusals = [], []
    for node in graph.nodes:
        if node.reduce != "sum" or node.is_scatter or (node.tag is not None and node.tag.kind in SOFTMAX_KINDS):
            continue
        readers = [graph.node_of.get(a.tensor) for a in node.accesses]
        if not any(r is not None and r.tag is not None and r.tag.kind in SOFTMAX_KINDS for r in readers):
            continue
        try:
            found.append(_match_at(graph, node, params))
        except NotAttention as why:
            refusals.append(f"{node.name}: {why}")
    return found, refusals
