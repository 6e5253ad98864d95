"""Folding an attention's score transform into constants: t(s, r) = a·s + b[l, m] + c·r, evaluated at compile
time over the (l, m) grid for a few values of the score s and the key bias r (band by band of query rows),
checked to be affine, and cut into a BlockMap whose empty blocks the kernel skips (attention.py matches the
pattern, attention_plan.py tiles the map)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from ...ir.expr import Access, Call, Cast, Const, Read, map_reads
from ...ir.graph import Graph, Node
from ...ir.index import Var, add, substitute
from ...ir.interpret import eval_node
from ...ir.types import dense_type
from .attention_plan import BLOCK, MAX_TILE, BlockMap, block_map

if TYPE_CHECKING:
    from .attention_match import AttentionMatch

MAX_CONSTANT_ELEMENTS = 1 << 28

# the transform is evaluated in float64 over bands of query rows of about FOLD_POSITIONS positions (six
# times at most: 32 MB a time); grids up to MAX_FOLDED_POSITIONS (S = 32768) fold in tens of seconds, and
# at most MAX_FOLDED_MIXED offsets that vary within a block are kept (a BigBird mask keeps none)
FOLD_POSITIONS = 1 << 22
MAX_FOLDED_POSITIONS = 1 << 30
MAX_FOLDED_MIXED = 1 << 26


class NotAttention(Exception):
    """Why a softmax between two contractions is not taken as attention."""


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
    # equal up to the float64 rounding of (a·s + b) - b, which an additive mask's offsets leave in the difference
    if not bool((((factors - value).abs() <= 1e-9 * (1.0 + abs(value))) | dropped).all()):
        raise NotAttention(_varying(scores, what))
    return value


def _varying(scores: str, what: str) -> str:
    return (f"the transform of {scores} scales the {what} by different factors at different positions (a mask "
            f"with values other than 0 and 1)")


def transform_sources(graph: Graph, match: AttentionMatch, params) -> dict[str, torch.Tensor]:
    """The parameters the score transform depends on (directly or through constant nodes)."""
    return {name: params[name] for name in _ancestors(graph, match) if name in params}


def _ancestors(graph: Graph, match: AttentionMatch) -> set[str]:
    """The tensors the score transform reads, and theirs, back to parameters and nodes without inputs."""
    seen, names = set(), [a.tensor for n in match.transform for a in graph.node_of[n].accesses]
    while names:
        name = names.pop()
        if name in seen or name in match.nodes:
            continue
        seen.add(name)
        if name in graph.node_of:
            names += graph.node_of[name].inputs
    return seen


def _constant_env(graph: Graph, match: AttentionMatch, params) -> dict[str, torch.Tensor]:
    """Parameters (dense, in their own dtype: the transform's float64 arithmetic promotes the band it reads)
    and the constant nodes the transform reads, evaluated (those built from positions alone too: aranges)."""
    env = {}
    for name, t in transform_sources(graph, match, params).items():
        env[name] = (t.to_dense() if t.layout != torch.strided else t).cpu()
    wanted = _ancestors(graph, match)
    for node in graph.nodes:
        if node.name in wanted and node.name not in env and set(node.inputs) <= set(env):
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
            if match.call_mask is not None and access.tensor == match.call_mask.tensor:
                return Const(True)  # the call's mask keeps the position: the constant part is what folds
            return Read(Access(access.tensor, tuple(substitute(i, shifted, extents) for i in access.indices)))

        small = Node(name, grid, _exact(map_reads(node.body, on_grid)), tuple(extents.items()))
        env[name] = eval_node(small, env, dense_type((rows, s_k), torch.float64)).double()
        previous = name
    out = env[previous]
    # the caller works on the result in place: never on a parameter's (or a constant node's) storage
    shared = {c.untyped_storage().data_ptr() for c in constants.values() if isinstance(c, torch.Tensor)}
    return out.clone() if out.untyped_storage().data_ptr() in shared else out


def _exact(e):
    """The body without its casts between float types: the transform is folded in float64 (the kernel applies
    a·s + b in float32), so a float32 step that rounds (0.2·s + b) - b away from 0.2 is not a non-affine one."""
    if isinstance(e, Cast):
        inner = _exact(e.arg)
        return inner if e.dtype.is_floating_point else Cast(e.dtype, inner)
    if isinstance(e, Call):
        return Call(e.op, tuple(_exact(a) for a in e.args))
    return e
