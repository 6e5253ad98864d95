"""Convolutions found in the IR, run as torch's (cuDNN's) convolution.

The frontend lowers a convolution to a contraction whose input read is affine in an output and a
window coordinate, out[n, o, h] = sum_{c, i} x[n, c, s·h + d·i] · w[o, c, i], zero padding a pad
node before it (and groups an output axis of their own: x[n, g·C + c, ...], w[g·O + o, c, ...]).
As an einsum of strided views the input would be unfolded in memory (im2col) first; this module
recognises the form and calls F.conv1d/2d/3d instead. Where the pad node exists only for the
convolution (zeros, the same amount on both sides), the convolution pads by itself and the pad
node is not computed (`fold_padding`): its producer (batch norm, relu) stores the unpadded tensor.
Otherwise the pad stitches with its producer in a generated kernel and the convolution reads the
padded tensor. A transposed convolution, which the frontend writes as a convolution of its input
spread apart with the flipped kernel, runs as cuDNN's transposed convolution (`fold_spread`)."""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...ir.expr import Call, Const, IndexValue, Read
from ...ir.graph import Graph, Node, Region
from ...ir.index import Div, Sum, Var, free_vars

CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
TRANSPOSED = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


@dataclass(frozen=True)
class ConvCall:
    node: str
    input: str
    weight: str
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    out_shape: tuple[int, ...]  # torch's output viewed as [N, G, Og, ...] when groups > 1
    x_order: tuple[int, ...]  # the stored input's axes in torch's order [N, C, spatial...]
    y_order: tuple[int, ...]  # torch's output axes (out_shape) in the node's order
    padding: tuple[int, ...] = ()  # zeros on both sides of each spatial axis (a folded pad node)
    folded: tuple[str, ...] = ()  # the nodes not computed: a pad; or a transposed convolution's spread and flip
    output_padding: tuple[int, ...] | None = None  # a transposed convolution's (None: a plain one)

    def __str__(self) -> str:
        pad = f", padding={self.padding}" if self.folded else ""
        pad += f", output_padding={self.output_padding}" if self.output_padding is not None else ""
        pad += f" (folds {', '.join(self.folded)})" if self.folded else ""
        last = ", channels last" if self.x_order[1] != 1 else ""
        kind = "conv_transpose" if self.output_padding is not None else "conv"
        return (f"{kind}{len(self.stride)}d({self.input}, {self.weight}, stride={self.stride}{pad}, "
                f"dilation={self.dilation}, groups={self.groups}{last})")

    def __call__(self, env, out_dtype: torch.dtype, cache: dict | None = None) -> torch.Tensor:
        x, w = env[self.input], env[self.weight]
        x = (x.to_dense() if x.layout != torch.strided else x).permute(self.x_order)
        compute = out_dtype if x.dtype == w.dtype == out_dtype and out_dtype.is_floating_point else \
            torch.promote_types(out_dtype, torch.float32)
        x, w = x.to(compute), _weight(w.to(compute), x, cache)
        if self.output_padding is not None:
            y = TRANSPOSED[len(self.stride)](x, w, None, self.stride, self.padding, self.output_padding, self.groups,
                                             self.dilation)
        else:
            y = CONVOLUTIONS[len(self.stride)](x, w, None, self.stride, self.padding or 0, self.dilation, self.groups)
        return y.reshape(self.out_shape).permute(self.y_order).contiguous().to(out_dtype)


def channels_last_format(t) -> torch.memory_format | None:
    """The channels-last memory format of a tensor of its rank (4 or 5 dims), else None."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim()) if isinstance(t, torch.Tensor) else None


def _weight(w: torch.Tensor, x: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """The weight in the input's memory format, converted once per version of it: cuDNN would
    convert a weight of the other format at every call (and an NCHW input too, behind a weight the
    forward of a training step stored channels last). Not cached while a CUDA graph records: every
    replay must convert again, since an optimizer updates the weight in place between them (a
    cached copy would be read stale)."""
    last = channels_last_format(x)
    if last is None or x.is_contiguous() == x.is_contiguous(memory_format=last):
        return w
    form = torch.contiguous_format if x.is_contiguous() else last
    if w.is_contiguous(memory_format=form):
        return w
    if cache is None or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
        return w.contiguous(memory_format=form)
    key = (w.data_ptr(), w._version, w.dtype, form)
    if key not in cache:
        cache.clear()
        cache[key] = w.contiguous(memory_format=form)
    return cache[key]


def _terms(e) -> dict[str, int] | None:
    """{variable: coefficient} of an affine index with no constant, else None."""
    if isinstance(e, Var):
        return {e.name: 1}
    if isinstance(e, Sum) and e.const == 0 and all(isinstance(a, Var) for _, a in e.terms):
        return {a.name: c for c, a in e.terms}
    return None


def match_conv(graph: Graph, node: Node) -> ConvCall | None:
    """The node as a convolution of a dense input and weight, in whatever order the node and its
    input keep their axes (channels first or last), or None."""
    if node.reduce != "sum" or node.is_scatter or not (isinstance(node.body, Call) and node.body.op == "mul"):
        return None
    if not all(isinstance(a, Read) for a in node.body.args):
        return None
    for xr, wr in (node.body.args, node.body.args[::-1]):
        found = _match(graph, node, xr.access, wr.access)
        if found is not None:
            return found
    return None


def _roles(node: Node, wa) -> tuple | None:
    """(group or None, channel, cin, window vars) from the weight's read w[g·og + o, c, i...]."""
    ext, red = node.extents, node.reduce_vars
    n = len(red) - 1
    if n not in CONVOLUTIONS or len(wa.indices) != n + 2:
        return None
    first = _terms(wa.indices[0])
    if first is None or not set(first) <= set(node.out_vars):
        return None
    if len(first) == 1 and set(first.values()) == {1}:
        group, (channel,) = None, first
    else:  # g·og + o: the channel has coefficient 1, the group the channel's extent
        pairs = [(g, o) for g, o in itertools.permutations(first, 2) if first[o] == 1 and first[g] == ext[o]]
        if len(first) != 2 or not pairs:
            return None
        group, channel = pairs[0]
    cin, window = red[0], red[1:]
    if [_terms(i) for i in wa.indices[1:]] != [{v: 1} for v in (cin, *window)]:
        return None
    return group, channel, cin, window


def _match(graph: Graph, node: Node, xa, wa) -> ConvCall | None:
    roles = _roles(node, wa)
    if roles is None or not (graph.type_of[wa.tensor].format.is_dense and graph.type_of[xa.tensor].format.is_dense):
        return None
    group, channel, cin, window = roles
    ext, n = node.extents, len(window)
    groups, og, cg = (ext[group] if group else 1), ext[channel], ext[cin]
    spatial_vars = [v for v in node.out_vars if v not in (group, channel)]
    if len(node.out_vars) != n + 2 + (group is not None) or len(xa.indices) != n + 2:
        return None
    if tuple(graph.type_of[wa.tensor].shape) != (groups * og, cg, *(ext[v] for v in window)):
        return None
    # the input: x[n, g·cg + c, s·h + d·i ...] with its axes in any order, each window inside the tensor
    terms = [_terms(i) for i in xa.indices]
    if None in terms:
        return None
    want_channel = {group: cg, cin: 1} if group else {cin: 1}
    x_channel = [k for k, t in enumerate(terms) if t == want_channel]
    x_batch = [k for k, t in enumerate(terms) if len(t) == 1 and next(iter(t)) in spatial_vars and t[next(iter(t))] == 1]
    if len(x_channel) != 1 or len(x_batch) != 1:
        return None
    batch = next(iter(terms[x_batch[0]]))
    spatial_vars.remove(batch)
    x_shape = graph.type_of[xa.tensor].shape
    stride, dilation, x_spatial, out_spatial = [], [], [], []
    for i in window:
        found = [(k, t) for k, t in enumerate(terms) if i in t and len(t) == 2]
        if len(found) != 1:
            return None
        k, t = found[0]
        h = next(v for v in t if v != i)
        if h not in spatial_vars:
            return None
        s, d = t[h], t[i]
        if (x_shape[k] - d * (ext[i] - 1) - 1) // s + 1 != ext[h]:
            return None
        stride.append(s)
        dilation.append(d)
        x_spatial.append(k)
        out_spatial.append(h)
    if x_shape[x_batch[0]] != ext[batch] or x_shape[x_channel[0]] != groups * cg:
        return None
    logical = [batch, *([group, channel] if group else [channel]), *out_spatial]
    return ConvCall(node.name, xa.tensor, wa.tensor, tuple(stride), tuple(dilation), groups,
                    tuple(ext[v] for v in logical), (x_batch[0], x_channel[0], *x_spatial),
                    tuple(logical.index(v) for v in node.out_vars))


# ---------------------------------------------------------------- padding done by the convolution

class ConvStep:
    """A convolution with its pad node folded in: one step in place of the pad and the contraction."""

    def __init__(self, graph: Graph, call: ConvCall):
        self.call, self.dtype = call, graph.type_of[call.node].dtype
        self.nodes = (*call.folded, call.node)
        self.weights: dict = {}

    def __call__(self, env) -> None:
        env[self.call.node] = self.call(env, self.dtype, self.weights)

    def on_meta(self, env) -> None:
        """The call on meta tensors (prefetch.py), with a weight cache of its own."""
        env[self.call.node] = self.call(env, self.dtype, {})

    def __str__(self) -> str:
        return f"torch({self.call.node}: {self.call})"


def region_convolutions(graph: Graph, region: Region, taken) -> list[ConvStep]:
    """The convolutions of the region whose zero padding can be left to the convolution, and the
    transposed convolutions (run as cuDNN's, not as a convolution of the input spread apart)."""
    inside, steps = set(region.nodes) - set(taken), []
    for name in region.nodes:
        node = graph.node_of.get(name)
        call = match_conv(graph, node) if node is not None and name in inside else None
        folded = (fold_spread(graph, call) or fold_padding(graph, call)) if call is not None else None
        if folded is not None and set(folded.folded) <= inside:
            steps.append(ConvStep(graph, folded))
    return steps


def fold_spread(graph: Graph, call: ConvCall) -> ConvCall | None:
    """The transposed convolution that the frontend wrote as a convolution of its input spread apart
    (zeros between the points, `s·j + before`) with the flipped kernel: its three nodes share a tag."""
    node, spread, flip = (graph.node_of.get(n) for n in (call.node, call.input, call.weight))
    if spread is None or flip is None or node.tag is None or node.tag.kind != "conv_transpose":
        return None
    if spread.tag != node.tag or flip.tag != node.tag or not isinstance(flip.body, Read):
        return None
    if any(graph.consumers.get(n.name) != (call.node,) or n.name in graph.outputs for n in (spread, flip)):
        return None
    body = spread.body
    if not (isinstance(body, Call) and body.op == "where" and isinstance(body.args[1], Read)):
        return None
    xa, bounds = body.args[1].access, _lower_bounds(body.args[0])
    x_order = []
    for pos in call.x_order:  # the input's own axis order (it is channels first where it is a graph input)
        hits = [m for m, idx in enumerate(xa.indices) if spread.out_vars[pos] in free_vars(idx)]
        if len(hits) != 1:
            return None
        x_order.append(hits[0])
    if sorted(x_order) != list(range(len(xa.indices))):  # the input read through a view (x[0]): not folded
        return None
    x_shape, w_shape = graph.type_of[xa.tensor].shape, graph.type_of[flip.body.access.tensor].shape
    stride, padding, extra = [], [], []
    for t, pos in enumerate(call.x_order[2:]):
        v, idx = spread.out_vars[pos], xa.indices[x_order[2 + t]]
        divs = [a for _, a in idx.terms if isinstance(a, Div)] if isinstance(idx, Sum) else []
        s = divs[0].divisor if divs else 1
        before, d, k = bounds.get(v), call.dilation[t], w_shape[2 + t]
        if before is None:
            return None
        after = spread.extents[v] - (x_shape[x_order[2 + t]] - 1) * s - 1 - before
        stride.append(s)
        padding.append(d * (k - 1) - before)
        extra.append(after - before)
    if any(p < 0 for p in padding) or any(not 0 <= e < max(s, d) for e, s, d in zip(extra, stride, call.dilation)):
        return None  # torch's transposed convolution takes neither: keep the convolution of the spread input
    return dataclasses.replace(call, input=xa.tensor, weight=flip.body.access.tensor, stride=tuple(stride),
                               padding=tuple(padding), output_padding=tuple(extra), x_order=tuple(x_order),
                               folded=(spread.name, flip.name))


def _lower_bounds(e) -> dict[str, int]:
    """{var: c} of the idx(var) >= c comparisons in an and-tree (other conditions ignored)."""
    if isinstance(e, Call) and e.op == "and":
        return _lower_bounds(e.args[0]) | _lower_bounds(e.args[1])
    if (isinstance(e, Call) and e.op == "ge" and isinstance(e.args[0], IndexValue)
            and isinstance(e.args[0].index, Var) and isinstance(e.args[1], Const)):
        return {e.args[0].index.name: int(e.args[1].value)}
    return {}


def fold_padding(graph: Graph, call: ConvCall) -> ConvCall | None:
    """The convolution of the pad node's input, padding by itself, when its input is a pad node
    with zeros, equal amounts on both sides of the spatial axes only, read by nothing else."""
    pad = graph.node_of.get(call.input)
    if pad is None or pad.reduce is not None or graph.consumers.get(pad.name) != (call.node,):
        return None
    if pad.name in graph.outputs:
        return None
    body = pad.body
    if not (isinstance(body, Call) and body.op == "where" and isinstance(body.args[1], Read)
            and isinstance(body.args[2], Const) and body.args[2].value == 0):
        return None
    src, ext = body.args[1].access, pad.extents
    if not graph.type_of[src.tensor].format.is_dense or len(src.indices) != len(pad.out_vars):
        return None
    amounts = []
    for v, idx, size in zip(pad.out_vars, src.indices, graph.type_of[src.tensor].shape):
        lo = 0 if isinstance(idx, Var) and idx.name == v else _shift(idx, v)
        if lo is None or lo < 0 or ext[v] != size + 2 * lo:
            return None
        amounts.append((v, lo, size))
    spatial = call.x_order[2:]
    if any(lo for k, (_, lo, _) in enumerate(amounts) if k not in spatial) or not any(lo for _, lo, _ in amounts):
        return None
    wanted = {(op, v, bound) for v, lo, size in amounts if lo for op, bound in (("ge", lo), ("lt", lo + size))}
    if _conditions(body.args[0]) != wanted:
        return None
    return dataclasses.replace(call, input=src.tensor, padding=tuple(amounts[k][1] for k in spatial),
                               folded=(pad.name,))


def _shift(idx, v: str) -> int | None:
    """lo for the index v - lo, else None."""
    if isinstance(idx, Sum) and len(idx.terms) == 1 and idx.terms[0] == (1, Var(v)):
        return -idx.const
    return None


def _conditions(e) -> set | None:
    """{(op, var, bound)} of an and-tree of idx(var) >= / < constant comparisons, else None."""
    if isinstance(e, Call) and e.op == "and":
        parts = [_conditions(a) for a in e.args]
        return None if None in parts else parts[0] | parts[1]
    if (isinstance(e, Call) and e.op in ("ge", "lt") and isinstance(e.args[0], IndexValue)
            and isinstance(e.args[0].index, Var) and isinstance(e.args[1], Const)):
        return {(e.op, e.args[0].index.name, e.args[1].value)}
    return None
