"""Lowerings of random ops: dropout, rand, randn, bernoulli, randint, randperm, multinomial.

Each op draws counter-based numbers (ir/random.py): element o of its result takes Philox's number for key
seed + stream and counter = o's row-major offset, where the seed is the graph's input that the program draws at
every call and the stream is the op's own. The numbers are pure functions of their arguments, so a kernel that
recomputes a node draws the same ones, and a dropout's mask and output (AOTAutograd's native_dropout, whose mask
the backward reads) agree. They are not eager's numbers: torch's generators are another algorithm.

A random op where autograd records through the graph is refused: the partition's backward would rerun the graph
eagerly and draw other numbers. AOTAutograd's graphs do not record (their backward is a graph of its own that
reads the saved mask), so dropout in training compiles under torch.compile.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..ir.errors import UnsupportedOpError
from ..ir.expr import Cast, Const, IndexValue, call
from ..ir.index import add, scale
from . import values as V
from .ops_elementwise import elementwise
from .ops_reduce import extreme_and_index
from .ops_sort import sorted_along
from .registry import LowerCtx, factory, lowering, sub_ctx
from .values import TensorValue


def _refuse_where_recorded(ctx: LowerCtx, what: str) -> None:
    graph_inputs = [v for n, v in (ctx.real or {}).items() if n.op in ("placeholder", "get_attr")]
    if torch.is_grad_enabled() and any(isinstance(a, torch.Tensor) and a.requires_grad
                                       for a in (*ctx.real_args, *graph_inputs)):
        raise UnsupportedOpError(what, "random numbers where autograd records: the backward would rerun the graph "
                                 "eagerly and draw others (torch.compile's training graphs take dropout)", ctx.hint)


def draw(ctx: LowerCtx, shape, kind: str = "rand", hint: str | None = None) -> TensorValue:
    """One float32 node of `shape` holding the op's numbers: U[0, 1) (rand) or N(0, 1) (randn)."""
    seed, stream = ctx.builder.random_stream()
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]

    def body(o, r, rg):
        offset = IndexValue(add(*(scale(v, s) for v, s in zip(o, strides)))) if o else Const(0)
        return call(kind, call("add", seed.read([], rg), Const(stream)), offset)

    return ctx.builder.emit(list(shape), torch.float32, body, hint=hint or f"{ctx.hint}_{kind}")


def _kept(ctx: LowerCtx, shape, p: float) -> TensorValue:
    """A boolean node: each element kept with probability 1 - p (eager's bernoulli(1 - p) mask); p >= 1 keeps none."""
    numbers = draw(ctx, shape, hint=f"{ctx.hint}_draw")
    return elementwise(sub_ctx(ctx, shape, torch.bool, "mask"), lambda u: call("lt", u, Const(1.0 - p)), numbers)


def _dropped(ctx: LowerCtx, x: TensorValue, kept: TensorValue, p: float) -> TensorValue:
    zero = Const(0.0 if x.dtype.is_floating_point else 0)
    factor = Const(1.0 / (1.0 - p)) if p < 1 else zero
    scaled = lambda m, a: call("where", m, call("mul", a, factor), zero)  # noqa: E731
    return elementwise(sub_ctx(ctx, x.shape, x.dtype, ""), scaled, kept, x)


@lowering("aten.native_dropout")
def lower_native_dropout(ctx, x, p, train):
    """(output, mask): AOTAutograd's dropout, whose mask its backward reads."""
    if not train or p == 0:
        return x, elementwise(sub_ctx(ctx, x.shape, torch.bool, "mask"), lambda a: Const(True), x)
    _refuse_where_recorded(ctx, "native_dropout")
    kept = _kept(ctx, x.shape, p)
    return _dropped(ctx, x, kept, p), kept


def dropout(ctx: LowerCtx, x: TensorValue, p: float, caller: LowerCtx | None = None) -> TensorValue:
    """x with each element kept with probability 1 - p and scaled by 1 / (1 - p): a step of a composite op (attention's
    probabilities), `caller` the op's own context (whose arguments say whether autograd records)."""
    _refuse_where_recorded(caller or ctx, str((caller or ctx).node.target))
    return _dropped(ctx, x, _kept(ctx, x.shape, p), p)


@lowering(F.dropout, torch.dropout, "aten.dropout", "method:dropout")
def lower_dropout(ctx, x, p=0.5, training=True, inplace=False, **_):
    if not training or p == 0:
        return x
    _refuse_where_recorded(ctx, "dropout")
    return _dropped(ctx, x, _kept(ctx, x.shape, p), p)


CHANNEL_DROPOUTS = {F.dropout1d: 1, F.dropout2d: 2, F.dropout3d: 3}


@lowering(*CHANNEL_DROPOUTS)
def lower_channel_dropout(ctx, x, p=0.5, training=True, inplace=False):
    """Whole channels dropped: one number per (sample, channel), the same over the channel's 1, 2 or 3 spatial dims."""
    if not training or p == 0:
        return x
    _refuse_where_recorded(ctx, ctx.node.target.__name__)
    spatial = CHANNEL_DROPOUTS[ctx.node.target]
    if x.rank not in (spatial + 1, spatial + 2):
        raise UnsupportedOpError(ctx.node.target.__name__, f"an input of rank {x.rank}", ctx.hint)
    channels = list(x.shape[:x.rank - spatial])
    kept = V.reshape(_kept(ctx, channels, p), channels + [1] * spatial)
    return _dropped(ctx, x, kept, p)


@factory(torch.rand, torch.randn, "aten.rand", "aten.randn")
def lower_rand(ctx, *args, **kwargs):
    """U[0, 1) or N(0, 1) numbers in the op's shape and dtype (float32 unless asked); the _like forms too."""
    what = str(ctx.node.target)
    _refuse_where_recorded(ctx, what)
    _no_generator(ctx, what)
    if not ctx.dtype.is_floating_point:
        raise UnsupportedOpError(what, f"random numbers of {ctx.dtype}", ctx.hint)
    return _in_dtype(ctx, draw(ctx, ctx.shape, "randn" if "randn" in what else "rand"))


lowering(torch.rand_like, torch.randn_like, "aten.rand_like", "aten.randn_like")(lower_rand)


@lowering(torch.bernoulli, "method:bernoulli", "aten.bernoulli")
def lower_bernoulli(ctx, x, p=None, **kwargs):
    """1 where a number drawn for the element falls below its probability (x, or the number p), else 0."""
    _refuse_where_recorded(ctx, "bernoulli")
    numbers = draw(ctx, ctx.shape, hint=f"{ctx.hint}_draw")
    zero, one = Const(0.0), Const(1.0)
    if isinstance(p, (int, float)):
        return elementwise(ctx, lambda u: Cast(ctx.dtype, call("where", call("lt", u, Const(float(p))), one, zero)),
                           numbers, hint=ctx.hint)
    return elementwise(ctx, lambda u, q: Cast(ctx.dtype, call("where", call("lt", u, q), one, zero)), numbers, x,
                       hint=ctx.hint)


def _no_generator(ctx: LowerCtx, what: str) -> None:
    if ctx.node.kwargs.get("generator") is not None:
        raise UnsupportedOpError(what, "a generator of the caller's (its numbers are its own)", ctx.hint)


def _in_dtype(ctx: LowerCtx, values: TensorValue) -> TensorValue:
    return values if values.dtype == ctx.dtype else elementwise(ctx, lambda v: Cast(ctx.dtype, v), values)


EXACT_RANGE = 1 << 24  # the integers a float32 number in [0, 1) scales onto evenly


@factory(torch.randint, "aten.randint")
def lower_randint(ctx, *args, **kwargs):
    """floor(u * (high - low)) + low for u in [0, 1), clamped below high (a product that rounds up)."""
    _refuse_where_recorded(ctx, "randint")
    _no_generator(ctx, "randint")
    bounds = [int(a) for a in args if isinstance(a, int)]
    low, high = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    if not 0 < high - low <= EXACT_RANGE:
        raise UnsupportedOpError("randint", f"a range of {high - low} integers (lowered: 1 to 2^24)", ctx.hint)
    numbers = draw(ctx, ctx.shape, hint=f"{ctx.hint}_draw")
    return elementwise(ctx, lambda u: Cast(ctx.dtype, call("add", call("min", call("floor", call(
        "mul", u, Const(float(high - low)))), Const(float(high - low - 1))), Const(float(low)))), numbers)


@factory(torch.randperm, "aten.randperm")
def lower_randperm(ctx, n, *args, **kwargs):
    """The order that sorts n numbers drawn uniformly: every permutation equally likely (ties aside)."""
    _refuse_where_recorded(ctx, "randperm")
    _no_generator(ctx, "randperm")
    n = int(n)
    numbers = draw(ctx, [n], hint=f"{ctx.hint}_draw")
    _, order = sorted_along(sub_ctx(ctx, [n], torch.float32, "order"), numbers, 0, n, False, "randperm")
    return _in_dtype(ctx, order)


@lowering(torch.multinomial, "method:multinomial", "aten.multinomial")
def lower_multinomial(ctx, weights, num_samples, replacement=False, **kwargs):
    """Gumbel-max: the largest log w + g, g = -log(-log u) drawn per element, falls on index i with probability
    w_i / sum w. Without replacement the k largest (Gumbel-top-k), with replacement one such draw per sample."""
    _refuse_where_recorded(ctx, "multinomial")
    _no_generator(ctx, "multinomial")
    k, n = int(num_samples), weights.shape[-1]
    lead = list(weights.shape[:-1])
    per_sample = replacement and k > 1
    shape = lead + ([k, n] if per_sample else [n])
    source = V.expand(V.unsqueeze(weights, weights.rank - 1), shape) if per_sample else weights
    numbers = draw(ctx, shape, hint=f"{ctx.hint}_draw")
    scores = elementwise(sub_ctx(ctx, shape, torch.float32, "scores"), lambda w, u: call("sub", call(
        "log", Cast(torch.float32, w)), call("log", call("neg", call("log", u)))), source, numbers)
    if per_sample:
        return extreme_and_index(sub_ctx(ctx, lead + [k], torch.int64, "pick"), scores, -1, False, "max")[1]
    return sorted_along(sub_ctx(ctx, lead + [k], torch.float32, "top"), scores, -1, k, True, "multinomial")[1]
