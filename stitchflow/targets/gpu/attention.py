"""Attention regions in the IR: recognise softmax(t(Q·Kᵀ))·V, fold its mask into tiles, run one kernel.

    matches, refusals = match_attention(graph, params)  # AttentionMatch(scores .. output); why not, per miss
    step = AttentionStep(graph, match, params, options)   # folds the mask; step(env) writes the output node

A match is a contraction S[b..., l, m] = sum_d Q·K, a run of elementwise nodes over S whose other
inputs are constants of the program indexed by (l, m) at most (a 0/1 or BSR mask, a scale, an
additive bias, a masked_fill; nodes computed from parameters alone count as constants) and at most
one tensor of the call indexed by batch axes and the key (a padding mask), the four nodes of a
softmax over m, and a contraction O[b..., l, e] = sum_m P·V. The elementwise run is evaluated at
compile time over the (l, m) grid for a few values of the score s and the key bias r: if it is
a·s + b[l, m] + c·r with one a and one c, and -inf where the mask drops the position, the whole
score transform is one map b and two scalars, and `attention_kernel.tile_plan` cuts b into the
tiles the kernel visits. The mask's sparsity becomes skipped work, whatever format it was stored
in. Anything else (a mask per head, a soft cap, a non-0/1 multiplicative mask) is refused with its
reason and runs as before: the contractions through torch, the rest as stitched kernels.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import astuple, dataclass

import torch

from ...ir.expr import Access, Call, Const, Read
from ...ir.graph import Graph, Node
from ...ir.index import Div, Var, affine_terms, rename
from ...ir.interpret import eval_node
from .attention_kernel import MAX_BATCH_AXES, Operand, launch, scratch
from .attention_fold import NotAttention, score_coefficients, transform_sources
from .attention_plan import AttentionTiles, TilePlan, chunk_options, tile_plan
from .layout import Store
from .runtime import interpreting, load_choice, save_choice

log = logging.getLogger("stitchflow.gpu.attention")
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
        return f"attention {self.scores} .. {self.output} ({len(self.transform)} score nodes{bias})"


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


# ---------------------------------------------------------------- running

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_FEATURES = 256
DEFAULT_TILES = AttentionTiles(64, 64, 4, 2)
INTERPRETER_TILES = AttentionTiles(32, 32, 4, 1)
# torch's scaled_dot_product_attention (its flash, cuDNN or memory-efficient kernel), timed beside our tiles
# where it computes the same thing: dense attention runs faster there than our block-sparse kernel
LIBRARY = AttentionTiles(0, 0, 0, 0, 0)
MAX_LIBRARY_MASK = 1 << 24  # positions of a mask the library is given densely (64 MB of float32)
# Tile configs the autotuner times, by operand width and head dim: each compiles for sm_90 without
# spilling (tests/targets/gpu/test_attention.py checks them all; at head dim 128 the 4-warp tiles and
# bm128 x bn128 spill, and fp32's exact dot takes register-hungry FMA code)
CANDIDATES = {
    (16, 64): ((128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (64, 64, 4, 3), (64, 64, 4, 2),
               (64, 128, 4, 2), (128, 32, 4, 3), (128, 32, 8, 3), (64, 32, 4, 2)),
    (16, 128): ((128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 8, 3), (64, 64, 8, 2), (64, 32, 8, 2)),
    (32, 64): ((32, 32, 4, 2), (64, 32, 8, 2), (32, 64, 8, 2)),
    (32, 128): ((32, 32, 8, 2),),
}


SPILL_WITH_KEY_BIAS = {(128, 128, 8, 2), (64, 128, 4, 2)}  # 8-16 bytes each at head dim 64
SPILL_SPLIT_WITH_KEY_BIAS = {(128, 64, 8, 3), (128, 64, 8, 2)}  # split runs, head dim 128: 32 bytes each
FP32_OFFSETS_ONLY = {(128, 128, 8, 2)}  # bf16 offsets spill 1.8 KB there (the other shapes 0-930 bytes)


def narrow_offsets(dtype: torch.dtype, head_dim: int, tiles: AttentionTiles) -> bool:
    """Whether partial tiles take bf16 offsets (attention_plan.tile_plan's `narrow`): 16-bit operands at head
    dim 64 or less, except the shapes where they spill too much."""
    return dtype != torch.float32 and head_dim <= 64 and astuple(tiles)[:4] not in FP32_OFFSETS_ONLY


def candidates(dtype: torch.dtype, head_dim: int, key_bias: bool = False) -> tuple[AttentionTiles, ...]:
    width = 32 if dtype == torch.float32 else 16
    shapes = CANDIDATES[width, 64 if head_dim <= 64 else 128]
    return tuple(AttentionTiles(*t) for t in shapes if not (key_bias and t in SPILL_WITH_KEY_BIAS))


def _strided(op: Operand, batch: tuple, length: int, width: int) -> torch.Tensor:
    """The operand as a tensor [batch..., length, width] (a view: no copy)."""
    return op.tensor.as_strided((*batch, length, width), (*op.batch_strides, op.seq_stride, op.feature_stride),
                                op.tensor.storage_offset() + op.offset)


def _broadcast(mask: torch.Tensor) -> torch.Tensor:
    """The mask with its stride-0 axes (a mask shared by every head) at size 1: torch's attention broadcasts it, and
    a mask of full size is converted to an additive bias of full size on every call."""
    for axis, stride in enumerate(mask.stride()[:-2]):
        if stride == 0:
            mask = mask.narrow(axis, 0, 1)
    return mask


class AttentionStep:
    """One attention match as one kernel launch; tiles autotuned on the device at the first call."""

    def __init__(self, graph: Graph, match: AttentionMatch, params: dict, options: dict,
                 store: Store | None = None):
        """`store` (layout.output_store): the output written through strides as a view of a contiguous
        buffer, the result of the copy node that only reorders it (the heads merged; that node then never
        runs) or a buffer laid out as the output's reader walks it."""
        self.graph, self.match, self.options = graph, match, dict(options or {})
        self.store = store
        self.nodes = match.nodes + ((store.into,) if store and store.into else ())  # in graph order
        node_of, type_of = graph.node_of, graph.type_of
        scores, out = node_of[match.scores], node_of[match.output]
        dtypes = [type_of[a.tensor].dtype for a in (match.q, match.k, match.v)]
        if dtypes[0] != dtypes[1] or any(dt not in FLOAT_DTYPES for dt in dtypes):
            raise NotAttention(f"Q, K, V are {[str(dt) for dt in dtypes]}: Q and K must share a float dtype")
        *self.batch_vars, self.l_var, self.m_var = scores.out_vars
        self.d_var = scores.reduce_vars[0]
        *self.out_batch_vars, _, self.e_var = out.out_vars
        self.r_var = out.reduce_vars[0]
        ext = scores.extents
        self.groups = match.groups or (1,) * len(self.batch_vars)
        # a grouped axis h walks as (h // G, h % G): the heads of one group read one K and V
        self.batch = tuple(e for v, g in zip(self.batch_vars, self.groups) for e in ((ext[v] // g, g) if g > 1
                                                                                      else (ext[v],)))
        self.s_q, self.s_k, self.d = ext[self.l_var], ext[self.m_var], ext[self.d_var]
        self.dv = out.extents[self.e_var]
        if max(self.d, self.dv) > MAX_FEATURES:
            raise NotAttention(f"head dims {self.d}, {self.dv} exceed {MAX_FEATURES}")
        self.out_type = type_of[match.result]
        self.q_dtype = dtypes[0]
        self.params = params
        self.sources = transform_sources(graph, match, params)
        self.versions = self._versions()
        self.coefficients = score_coefficients(graph, match, params)
        self.key = (f"attention-split:{self.coefficients[1].digest()}:{self.coefficients[0]!r}:"
                    f"{self.batch}x{self.s_q}x{self.s_k}:"
                    f"{self.d}x{self.dv}:{dtypes[0]}->{self.out_type.dtype}")
        kept = self.coefficients[1].kept / (self.s_q * self.s_k)
        log.info("%s: mask folded, %.1f%% of the score positions kept", match, 100 * kept)
        self.plans: dict = {}
        self._library: tuple | None = None  # (the coefficients it was worked out from, library_form())
        if match.call_mask is not None and self.library_form() is None:
            raise NotAttention(f"{match.output}'s mask of the call goes to torch's attention, which cannot take "
                               "this match (an output dtype other than Q's, or offsets too large to hand over)")
        self.chosen: AttentionTiles | None = None
        self.tuned_us: float | None = None

    def _versions(self) -> dict[str, int]:
        return {name: t._version for name, t in self.sources.items()}

    def _refold_if_changed(self) -> None:
        """The mask was folded into tiles when compiled; if a parameter it comes from has been
        written in place since (a torch.compile partition binds buffers by reference), fold again."""
        versions = self._versions()
        if versions != self.versions:
            log.info("%s: %s changed in place, folding the mask again", self.match,
                     [n for n in versions if versions[n] != self.versions.get(n)])
            self.coefficients = score_coefficients(self.graph, self.match, self.params)
            self.plans.clear()
            self.versions = versions

    # -- operands

    def _operand(self, access: Access, env, batch_vars, seq_var: str, feature_var: str) -> Operand:
        t = env[access.tensor]
        coef, grouped, offset = {}, {}, 0
        for index, stride in zip(access.indices, t.stride()):
            terms, const = affine_terms(index)
            offset += const * stride
            for atom, c in terms.items():
                into = grouped if isinstance(atom, Div) else coef
                name = atom.arg.name if isinstance(atom, Div) else atom.name
                into[name] = into.get(name, 0) + c * stride
        batch = []  # h = G·o + i: c·h + c'·(h // G) = (G·c + c')·o + c·i
        for v, g in zip(batch_vars, self.groups):
            plain = coef.get(v, 0)
            batch += [g * plain + grouped.get(v, 0), plain] if g > 1 else [plain]
        return Operand(t, offset, tuple(batch), coef.get(seq_var, 0), coef.get(feature_var, 0))

    def _library_view(self, op: Operand, length: int, width: int, shared: bool = False) -> torch.Tensor:
        """The operand as torch's attention takes it: [batch..., length, width], a grouped last batch axis whole
        for Q (its stride the inner one) and in groups for K and V (enable_gqa: H // G heads, the outer stride)."""
        if self.groups[-1] == 1:
            return _strided(op, self.batch, length, width)
        *lead, outer, inner = op.batch_strides
        heads = self.batch[-2] * (1 if shared else self.batch[-1])
        return op.tensor.as_strided((*self.batch[:-2], heads, length, width),
                                    (*lead, outer if shared else inner, op.seq_stride, op.feature_stride),
                                    op.tensor.storage_offset() + op.offset)

    def _grouped_view(self, t: torch.Tensor) -> torch.Tensor:
        """An output [batch..., l, e] as the kernel walks it, each grouped axis split in two."""
        for axis in reversed([k for k, g in enumerate(self.groups) if g > 1]):
            t = t.unflatten(axis, (t.shape[axis] // self.groups[axis], self.groups[axis]))
        return t

    def _plan(self, tiles: AttentionTiles, device) -> TilePlan:
        key = (tiles, str(device))
        if key not in self.plans:
            narrow = narrow_offsets(self.q_dtype, max(self.d, self.dv), tiles)
            self.plans[key] = tile_plan(*self.coefficients[:2], tiles, narrow).to(device)
        return self.plans[key]

    def _precision(self, dtype) -> str:
        if dtype != torch.float32 or interpreting():
            return "ieee"
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"

    def library_form(self) -> tuple[bool, torch.Tensor | None] | None:
        """(is_causal, mask or None) with which torch's scaled_dot_product_attention computes this match
        (the scale is the scores' factor); None where it cannot: a key bias, an output dtype other than Q's,
        a mask too large to hand over densely. The mask is boolean where the offsets are all 0 or -inf.
        Worked out once per fold (it walks the whole map: milliseconds at S 2048, too much for every call)."""
        if self._library is None or self._library[0] is not self.coefficients:
            self._library = (self.coefficients, self._library_form())
        return self._library[1]

    def _library_form(self) -> tuple[bool, torch.Tensor | None] | None:
        if self.match.key_bias is not None or self.out_type.dtype != self.q_dtype:
            return None
        if any(g > 1 for g in self.groups[:-1]):  # torch groups the heads next to the query axis only
            return None
        folded = self.coefficients[1]
        if self.s_q * self.s_k > MAX_LIBRARY_MASK:
            plain = folded.kept == self.s_q * self.s_k and not folded.mixed.shape[0] and not folded.value.any()
            return (False, None) if plain else None
        b = folded.dense()
        kept = torch.isfinite(b)
        if kept.all() and not b.any():
            return False, None
        causal = torch.ones(self.s_q, self.s_k, dtype=torch.bool).tril()
        if torch.equal(kept, causal) and not b[kept].any():
            return True, None
        return False, (kept if not b[kept].any() else b.to(self.q_dtype))

    def _library_runner(self, env):
        causal, mask = self.library_form()
        m = self.match
        views = [self._library_view(self._operand(a, env, batch, seq, feature), length, width, grouped)
                 for a, batch, seq, feature, length, width, grouped in (
                     (m.q, self.batch_vars, self.l_var, self.d_var, self.s_q, self.d, False),
                     (m.k, self.batch_vars, self.m_var, self.d_var, self.s_k, self.d, True),
                     (m.v, self.out_batch_vars, self.r_var, self.e_var, self.s_k, self.dv, True))]
        gqa = {"enable_gqa": True} if self.groups[-1] > 1 else {}
        device = views[0].device
        results = self._outputs(device) if self.store is not None else None
        mask = mask.to(device) if mask is not None else None
        scale = self.coefficients[0]
        if m.call_mask is not None:  # the call's mask, with the folded constant part (a causal mask) on it
            keep = _broadcast(self._library_view(self._operand(m.call_mask, env, self.batch_vars, self.l_var,
                                                               self.m_var), self.s_q, self.s_k, shared=False))
            if causal:
                mask, causal = torch.ones(self.s_q, self.s_k, dtype=torch.bool, device=device).tril(), False
            extra = mask
            mask = None

        def run():
            attn_mask = mask
            if m.call_mask is not None:
                attn_mask = keep if extra is None else keep & extra if extra.dtype == torch.bool else \
                    torch.where(keep, extra, float("-inf")).to(extra.dtype)
            out = torch.nn.functional.scaled_dot_product_attention(*views, attn_mask=attn_mask, is_causal=causal,
                                                                   scale=scale, **gqa)
            if results is None:  # the library's own output is the node's value: no copy
                return {m.result: out}
            results[m.result].copy_(out)  # laid out through strides as the output's reader wants it
            return results
        return run

    def _runner(self, env, tiles: AttentionTiles):
        if tiles == LIBRARY:
            return self._library_runner(env)
        m = self.match
        q = self._operand(m.q, env, self.batch_vars, self.l_var, self.d_var)
        k = self._operand(m.k, env, self.batch_vars, self.m_var, self.d_var)
        v = self._operand(m.v, env, self.out_batch_vars, self.r_var, self.e_var)
        bias = None if m.key_bias is None else self._operand(m.key_bias, env, self.batch_vars, self.m_var, "")
        device = q.tensor.device
        plan = self._plan(tiles, device)
        results = self._outputs(device)
        out = self._grouped_view(results[m.result])
        parts = scratch(plan, math.prod(self.batch), self.dv, self.out_type.dtype, device)
        precision = self._precision(q.tensor.dtype)

        def run():
            launch(q, k, v, out, self.batch, plan, self.s_q, self.s_k, self.d, self.dv, precision,
                   bias, self.coefficients[2], parts)
            return results
        return run

    def _outputs(self, device) -> dict[str, torch.Tensor]:
        """The output node's tensor, and the buffer it is a view of when stored through strides (the copy's
        result, or `{output}_walked`, which the graph's reader reads instead, layout.read_walked)."""
        shape, dtype = self.out_type.shape, self.out_type.dtype
        if self.store is None:
            return {self.match.result: torch.empty(shape, dtype=dtype, device=device)}
        buffer = torch.empty(self.store.shape, dtype=dtype, device=device)
        return {self.match.result: buffer.as_strided(shape, self.store.strides),
                self.store.buffer_name(self.match.result): buffer}

    # -- tiles

    def _tiles(self, env) -> AttentionTiles:
        if self.match.call_mask is not None:  # our kernel folds constant masks only
            return LIBRARY
        pinned = self.options.get("attention_tiles")
        if pinned is not None:
            return pinned if isinstance(pinned, AttentionTiles) else AttentionTiles(*pinned)
        if interpreting():
            return INTERPRETER_TILES
        if not self.options.get("autotune", True):
            return DEFAULT_TILES
        key = f"{self.key}:{torch.cuda.get_device_name()}"
        cached = load_choice(key)
        if cached:
            return AttentionTiles(*cached)
        return self._tune(env, key)

    def _tune(self, env, key: str) -> AttentionTiles:
        """Time every candidate as a CUDA-graph replay, as a gpu program runs: timed as plain calls, a kernel
        of 20 µs is bound by its launches' host time, and a split plan (two launches) looked slower than it is
        (at S = 1024 the autotuner then kept 27.7 µs plans where split ones take 20)."""
        from .timing import graph_bench

        timings, best, best_s = {}, None, float("inf")
        for tiles in self._candidates(env):
            try:
                run = self._runner(env, tiles)
                run()
                torch.cuda.synchronize()
                seconds = graph_bench(run)[0]
            except Exception as err:  # a config the device cannot run (shared memory, registers)
                log.info("attention tiles %s failed: %s", tiles, err)
                continue
            timings[str(tiles)] = round(seconds * 1e6, 2)
            if seconds < best_s:
                best, best_s = tiles, seconds
        if best is None:
            raise RuntimeError(f"no tile config of {self.match} could run")
        log.info("%s: %s", self.match, ", ".join(f"{t} {us} us" for t, us in timings.items()))
        self.tuned_us = round(best_s * 1e6, 2)
        save_choice(key, [best.bm, best.bn, best.num_warps, best.num_stages, best.chunk], timings)
        return best

    def _candidates(self, env):
        """Tile shapes, each with the runs its plan may be split into (chunk_options)."""
        head_dim, key_bias = max(self.d, self.dv), self.match.key_bias is not None
        device = env[self.match.q.tensor].device
        for tiles in candidates(env[self.match.q.tensor].dtype, head_dim, key_bias):
            spills = head_dim > 64 and key_bias and astuple(tiles)[:4] in SPILL_SPLIT_WITH_KEY_BIAS
            for chunk in (0,) if spills else chunk_options(self._plan(tiles, device)):
                yield tiles.chunked(chunk)
        if self.library_form() is not None:
            yield LIBRARY

    def __call__(self, env) -> None:
        first = env[self.match.q.tensor]
        if first.device.type == "cpu" and not interpreting():
            for name in self.nodes:  # no GPU and no interpreter: the reference path
                env[name] = eval_node(self.graph.node_of[name], env, self.graph.type_of[name])
            return
        self._refold_if_changed()
        if self.chosen is None:
            self.chosen = self._tiles(env)
        env.update(self._runner(env, self.chosen)())

    def describe(self) -> str:
        if self.chosen == LIBRARY:
            causal, mask = self.library_form()
            how = "causal" if causal else "no mask" if mask is None else f"a {str(mask.dtype)[6:]} mask"
            return (f"{self.match}: batch {self.batch}, {self.s_q}x{self.s_k}, d {self.d}/{self.dv}; torch's "
                    f"scaled_dot_product_attention ({how}), timed faster than our tiles")
        plan = next((p for (tiles, _), p in self.plans.items() if tiles == self.chosen), None)
        tiles = str(plan) if plan is not None else str(self.chosen or "tiles chosen at the first call")
        into = f", {self.store}" if self.store else ""
        return f"{self.match}: batch {self.batch}, {self.s_q}x{self.s_k}, d {self.d}/{self.dv}{into}; {tiles}"

    def __str__(self) -> str:
        return f"attention({self.match.scores}..{self.match.output})"
