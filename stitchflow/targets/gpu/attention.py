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

import logging
import math
from dataclasses import astuple, dataclass

import torch

from ...ir.expr import Access, Read, map_reads
from ...ir.graph import Graph, Node
from ...ir.index import Var, _linear, add, rename, substitute
from ...ir.interpret import eval_node
from ...ir.types import dense_type
from .attention_kernel import MAX_BATCH_AXES, Operand, launch, scratch
from .attention_plan import (BLOCK, MAX_TILE, AttentionTiles, BlockMap, TilePlan, block_map, chunk_options,
                             tile_plan)
from .layout import Store
from .runtime import interpreting, load_choice, save_choice

log = logging.getLogger("stitchflow.gpu.attention")
SOFTMAX_KINDS = {"softmax"}
MAX_CONSTANT_ELEMENTS = 1 << 28
# the transform is evaluated in float64 over bands of query rows of about FOLD_POSITIONS positions (six
# times at most: 32 MB a time); grids up to MAX_FOLDED_POSITIONS (S = 32768) fold in tens of seconds, and
# at most MAX_FOLDED_MIXED offsets that vary within a block are kept (a BigBird mask keeps none)
FOLD_POSITIONS = 1 << 22
MAX_FOLDED_POSITIONS = 1 << 30
MAX_FOLDED_MIXED = 1 << 26


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

    def __str__(self) -> str:
        bias = f", key bias {self.key_bias}" if self.key_bias else ""
        return f"attention {self.scores} .. {self.output} ({len(self.transform)} score nodes{bias})"


class NotAttention(Exception):
    """Why a softmax between two contractions is not taken as attention."""


# ---------------------------------------------------------------- matching

def _affine_vars(access: Access) -> frozenset[str] | None:
    """The variables of an access whose every index is an integer combination of variables."""
    names = set()
    for index in access.indices:
        terms, _ = _linear(index)
        if not all(isinstance(atom, Var) for atom in terms):
            return None
        names |= {atom.name for atom in terms}
    return frozenset(names)


def _contraction_reads(node: Node) -> tuple[Access, Access] | None:
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1:
        return None
    accesses = node.accesses
    if len(accesses) != 2 or any(_affine_vars(a) is None for a in accesses):
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
    transform, name, key_bias = [], x_access.tensor, []
    while name in node_of and node_of[name].reduce is None:
        transform.append(_transform_node(graph, node_of[name], params))
        name = transform[-1][1]
        key_bias += transform[-1][2]
    if len(key_bias) > 1:
        raise NotAttention(f"the scores read {len(key_bias)} tensors of the call ({', '.join(map(str, key_bias))}); "
                           f"one key bias at most")
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
    if not _affine_vars(v) <= set(out_batch) | {r, out.out_vars[-1]} or out.out_vars[-1] not in _affine_vars(v):
        raise NotAttention(f"{out.name} reads {v} over axes beyond batch, key and feature")
    inner = [scores.name, *(t[0].name for t in transform), *(n.name for n in soft.values())]
    for n in inner:
        users = set(consumers.get(n, ())) - set(inner) - {out.name}
        if users or n in graph.outputs:
            raise NotAttention(f"{n} is also read outside the attention ({sorted(users) or 'a program output'})")
    nodes = tuple(n.name for n in graph.nodes if n.name in set(inner) | {out.name})
    return AttentionMatch(nodes, scores.name, tuple(t[0].name for t in reversed(transform)), probs.name,
                          out.name, q, k, v, _on_scores_vars(key_bias, transform, scores))


def _on_scores_vars(key_bias: list, transform, scores: Node) -> Access | None:
    """The key bias's access with the reading node's variables renamed to the scores' (position by position)."""
    if not key_bias:
        return None
    (node,) = [n for n, _, bias in transform if bias]
    names = dict(zip(node.out_vars, scores.out_vars))
    return Access(key_bias[0].tensor, tuple(rename(i, names) for i in key_bias[0].indices))


def _transform_node(graph: Graph, node: Node, params: set) -> tuple[Node, str, list[Access]]:
    """An elementwise node over the scores: (node, the node it transforms, reads of a per-key bias
    that the call passes), or NotAttention."""
    if node.is_scatter:
        raise NotAttention(f"{node.name} scatters")
    *batch, l_var, m_var = node.out_vars
    chain = [a for a in node.accesses if a.tensor not in params and a.indices == node.index]
    others = [a for a in node.accesses if a.tensor not in params and a.indices != node.index]
    if len(chain) != 1:
        raise NotAttention(f"{node.name} reads {[str(a) for a in chain]}: a score transform reads the "
                           f"scores as they are and otherwise only constants or a per-key bias")
    for a in others:
        vars_ = _affine_vars(a)
        if vars_ is None or m_var not in vars_ or not vars_ <= set(batch) | {m_var} or a.tensor in graph.node_of:
            raise NotAttention(f"{node.name} reads {a}: besides constants, a score transform reads only a "
                               f"tensor of the call indexed by batch axes and the key (a padding mask)")
    for a in node.accesses:
        if a.tensor in params and not a.vars <= {l_var, m_var}:
            raise NotAttention(f"{node.name} reads {a}, which varies over the batch axes (a mask per head "
                               f"or per sequence is not folded yet)")
    return node, chain[0].tensor, others


def _order_qk(accesses, batch: set, l_var: str, m_var: str, d: str) -> tuple[Access, Access]:
    for q, k in (accesses, accesses[::-1]):
        qv, kv = _affine_vars(q), _affine_vars(k)
        if {l_var, d} <= qv <= batch | {l_var, d} and {m_var, d} <= kv <= batch | {m_var, d}:
            return q, k
    raise NotAttention(f"the scores do not read Q over (query, d) and K over (key, d): {accesses[0]}, {accesses[1]}")


def constants(graph: Graph, params) -> set[str]:
    """Parameters, and the nodes computed from parameters alone (a mask compared with 0 in the
    graph, as torch.compile hands it over): values known when the program is compiled."""
    known = set(params)
    for node in graph.nodes:
        if node.inputs and set(node.inputs) <= known:
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


# ---------------------------------------------------------------- the score transform as constants

def score_coefficients(graph: Graph, match: AttentionMatch, params: dict) -> tuple[float, BlockMap, float]:
    """(a, b, c): t(s, r) = a·s + b[l, m] + c·r over (S_q, S_k), with r the key bias of the call (c = 0
    without one); b, -inf where the position is dropped, folded band by band of query rows into a
    BlockMap (a long context's offsets are never all held at once)."""
    s_q, s_k = graph.type_of[match.scores].shape[-2:]
    if s_q * s_k > MAX_FOLDED_POSITIONS:
        raise NotAttention(f"the score grid {s_q}x{s_k} is too large to fold at compile time "
                           f"(at most {MAX_FOLDED_POSITIONS} positions)")
    constants = _constant_env(graph, match, params)  # once: the parameters converted, constant nodes evaluated
    rows = max(MAX_TILE, FOLD_POSITIONS // s_k // MAX_TILE * MAX_TILE)
    factors: dict[str, float] = {}

    def bands():
        for r0 in range(0, s_q, rows):
            b, band_factors = _fold_band(graph, match, constants, r0, min(rows, s_q - r0), s_k)
            for what, value in band_factors.items():
                if factors.setdefault(what, value) != value:
                    raise NotAttention(_varying(match.scores, what))
            yield r0, b

    folded = block_map(bands(), s_q, s_k)
    if folded.mixed.shape[0] * BLOCK * BLOCK > MAX_FOLDED_MIXED:
        raise NotAttention(f"the offsets of {match.scores} vary within {folded.mixed.shape[0]} blocks of "
                           f"{BLOCK}x{BLOCK}: more than {MAX_FOLDED_MIXED} positions to keep")
    return factors.get("scores", 0.0), folded, factors.get("key bias", 0.0)


def _fold_band(graph, match, constants: dict, r0: int, rows: int, s_k: int) -> tuple[torch.Tensor, dict]:
    """(b, factors) of query rows [r0, r0 + rows): b float64 with -inf where dropped, and the scale of the
    scores ("scores") and of the key bias ("key bias", 0 without one) where the band keeps a position;
    NotAttention when the transform is not affine there. Every value is worked in place, in as few passes
    over the band as the checks allow (folding a long context is this loop)."""
    scores, bias = match.scores, match.key_bias is not None
    # (s, r) probe points: b, a + b, 2a + b; with a key bias also c + b, 2c + b, a + c + b
    points = ((0.0, 0.0), (1.0, 0.0), (2.0, 0.0), (0.0, 1.0), (0.0, 2.0), (1.0, 1.0))[:6 if bias else 3]
    values = [_evaluate_transform(graph, match, constants, s, r, r0, rows, s_k) for s, r in points]
    dropped = torch.isneginf(values[0])
    if not all(torch.equal(torch.isneginf(t), dropped) for t in values[1:]):
        raise NotAttention(f"the transform of {scores} drops positions depending on the score or the bias")
    for t in values:
        t.masked_fill_(dropped, 0.0)
        if not torch.isfinite(t).all():
            raise NotAttention(f"the transform of {scores} makes +inf or NaN from finite scores")
    b = values[0]
    a = values[1] - b
    c = values[3] - b if bias else None
    tolerance = a.abs().add_(b.abs()).add_(1.0)
    if bias:
        tolerance.add_(c.abs())
    tolerance.mul_(1e-9)
    for t, k_a, k_c in ((values[2], 2, 0), *(((values[4], 0, 2), (values[5], 1, 1)) if bias else ())):
        residual = (t - b).sub_(a, alpha=k_a)
        if k_c:
            residual.sub_(c, alpha=k_c)
        if (residual.abs_() > tolerance).any():
            raise NotAttention(f"the transform of {scores} is not affine in the score"
                               + (" and the key bias" if bias else ""))
    factors = {"scores": _one_factor(a, dropped, scores, "scores"),
               "key bias": _one_factor(c, dropped, scores, "key bias") if bias else 0.0}
    return b.masked_fill_(dropped, float("-inf")), {k: v for k, v in factors.items() if v is not None}


def _one_factor(factors: torch.Tensor, dropped: torch.Tensor, scores: str, what: str) -> float | None:
    """The one value `factors` takes where nothing is dropped (None where everything is)."""
    kept = ~dropped.view(-1)
    if not kept.any():
        return None
    value = factors.view(-1)[int(kept.to(torch.uint8).argmax())].item()
    if not bool(((factors == value) | dropped).all()):
        raise NotAttention(_varying(scores, what))
    return value


def _varying(scores: str, what: str) -> str:
    return (f"the transform of {scores} scales the {what} by different factors at different positions (a mask "
            f"with values other than 0 and 1)")


def transform_sources(graph: Graph, match: AttentionMatch, params) -> dict[str, torch.Tensor]:
    """The parameters the score transform depends on (directly or through constant nodes)."""
    wanted, names = [], [a.tensor for n in match.transform for a in graph.node_of[n].accesses]
    while names:
        name = names.pop()
        if name in params:
            wanted.append(name)
        elif name in graph.node_of and name not in match.nodes:
            names += graph.node_of[name].inputs
    return {name: params[name] for name in wanted}


def _constant_env(graph: Graph, match: AttentionMatch, params) -> dict[str, torch.Tensor]:
    """Parameters (dense, in their own dtype: the transform's float64 arithmetic promotes the band it reads)
    and the constant nodes the transform reads, evaluated."""
    env = {}
    for name, t in transform_sources(graph, match, params).items():
        env[name] = (t.to_dense() if t.layout != torch.strided else t).cpu()
    for node in graph.nodes:
        if node.name not in match.nodes and node.inputs and set(node.inputs) <= set(env):
            if math.prod(graph.type_of[node.name].shape) > MAX_CONSTANT_ELEMENTS:
                raise NotAttention(f"{node.name}, a constant the transform reads, is too large to fold")
            env[node.name] = eval_node(node, env, graph.type_of[node.name])
    return env


KEY_BIAS = "__key_bias"


def _evaluate_transform(graph, match, constants: dict, s: float, r: float, r0: int, rows: int,
                        s_k: int) -> torch.Tensor:
    """The transform's nodes on query rows [r0, r0 + rows) × all keys in float64, the scores all equal to s,
    the key bias to r."""
    env = dict(constants)
    env[match.scores] = torch.full((rows, s_k), s, dtype=torch.float64)
    env[KEY_BIAS] = torch.full((rows, s_k), r, dtype=torch.float64)
    bias = match.key_bias.tensor if match.key_bias is not None else None
    previous = match.scores
    for name in match.transform:
        node = graph.node_of[name]
        *_, l_var, m_var = node.out_vars
        grid = (Var(l_var), Var(m_var))
        extents = {l_var: rows, m_var: s_k}
        shifted = {l_var: add(Var(l_var), r0)}  # a constant's row is the band's row plus r0

        def on_grid(access: Access, previous=previous, grid=grid, extents=extents, shifted=shifted):
            if access.tensor == previous:
                return Read(Access(previous, grid))
            if access.tensor == bias:
                return Read(Access(KEY_BIAS, grid))
            return Read(Access(access.tensor, tuple(substitute(i, shifted, extents) for i in access.indices)))

        small = Node(name, grid, map_reads(node.body, on_grid), tuple(extents.items()))
        env[name] = eval_node(small, env, dense_type((rows, s_k), torch.float64)).double()
        previous = name
    out = env[previous]
    # the caller works on the result in place: never on a parameter's (or a constant node's) storage
    shared = {c.untyped_storage().data_ptr() for c in constants.values() if isinstance(c, torch.Tensor)}
    return out.clone() if out.untyped_storage().data_ptr() in shared else out


# ---------------------------------------------------------------- running

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MAX_FEATURES = 256
DEFAULT_TILES = AttentionTiles(64, 64, 4, 2)
INTERPRETER_TILES = AttentionTiles(32, 32, 4, 1)
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


class AttentionStep:
    """One attention match as one kernel launch; tiles autotuned on the device at the first call."""

    def __init__(self, graph: Graph, match: AttentionMatch, params: dict, options: dict,
                 store: Store | None = None):
        """`store` (layout.output_store): the output written through strides as a view of a contiguous
        buffer, the result of the copy node that only reorders it (the heads merged; that node then never
        runs) or a buffer laid out as the output's reader walks it."""
        self.graph, self.match, self.options = graph, match, dict(options or {})
        self.store = store
        self.nodes = match.nodes + ((store.into,) if store and store.into else ())
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
        self.batch = tuple(ext[v] for v in self.batch_vars)
        self.s_q, self.s_k, self.d = ext[self.l_var], ext[self.m_var], ext[self.d_var]
        self.dv = out.extents[self.e_var]
        if max(self.d, self.dv) > MAX_FEATURES:
            raise NotAttention(f"head dims {self.d}, {self.dv} exceed {MAX_FEATURES}")
        self.out_type = type_of[match.output]
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
        coef, offset = {}, 0
        for index, stride in zip(access.indices, t.stride()):
            terms, const = _linear(index)
            offset += const * stride
            for atom, c in terms.items():
                coef[atom.name] = coef.get(atom.name, 0) + c * stride
        return Operand(t, offset, tuple(coef.get(v, 0) for v in batch_vars), coef.get(seq_var, 0),
                       coef.get(feature_var, 0))

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

    def _runner(self, env, tiles: AttentionTiles):
        m = self.match
        q = self._operand(m.q, env, self.batch_vars, self.l_var, self.d_var)
        k = self._operand(m.k, env, self.batch_vars, self.m_var, self.d_var)
        v = self._operand(m.v, env, self.out_batch_vars, self.r_var, self.e_var)
        bias = None if m.key_bias is None else self._operand(m.key_bias, env, self.batch_vars, self.m_var, "")
        device = q.tensor.device
        plan = self._plan(tiles, device)
        results = self._outputs(device)
        out = results[m.output]
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
            return {self.match.output: torch.empty(shape, dtype=dtype, device=device)}
        buffer = torch.empty(self.store.shape, dtype=dtype, device=device)
        return {self.match.output: buffer.as_strided(shape, self.store.strides),
                self.store.buffer_name(self.match.output): buffer}

    # -- tiles

    def _tiles(self, env) -> AttentionTiles:
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
        plan = next((p for (tiles, _), p in self.plans.items() if tiles == self.chosen), None)
        tiles = str(plan) if plan is not None else str(self.chosen or "tiles chosen at the first call")
        into = f", {self.store}" if self.store else ""
        return f"{self.match}: batch {self.batch}, {self.s_q}x{self.s_k}, d {self.d}/{self.dv}{into}; {tiles}"

    def __str__(self) -> str:
        return f"attention({self.match.scores}..{self.match.output})"
