"""Convolutions found in the IR, run as torch's (cuDNN's) convolution.

The frontend lowers a convolution to a contraction whose input read is affine in an output and a
window coordinate, out[n, o, h] = sum_{c, i} x[n, c, s·h + d·i] · w[o, c, i], zero padding a pad
node before it (and groups an output axis of their own: x[n, g·C + c, ...], w[g·O + o, c, ...]).
As an einsum of strided views the input would be unfolded in memory (im2col) first; this module
recognises the form and calls F.conv1d/2d/3d instead. Where the pad node exists only for the
convolution (zeros, the same amount on both sides), the convolution pads by itself and the pad
node is not computed (`fold_padding`): its producer (batch norm, relu) stores the unpadded tensor.
Otherwise the pad stitches with its producer in a generated kernel and the convolution reads the
padded tensor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...ir.expr import Call, Const, IndexValue, Read
from ...ir.graph import Graph, Node, Region
from ...ir.index import Sum, Var

CONVOLUTIONS = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


@dataclass(frozen=True)
class ConvCall:
    node: str
    input: str
    weight: str
    stride: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    out_shape: tuple[int, ...]  # the node's shape (a group axis before the channels when groups > 1)
    padding: tuple[int, ...] = ()  # zeros on both sides of each spatial axis (a folded pad node)
    folded: str = ""  # the pad node not computed

    def __str__(self) -> str:
        pad = f", padding={self.padding} (folds {self.folded})" if self.folded else ""
        return (f"conv{len(self.stride)}d({self.input}, {self.weight}, stride={self.stride}{pad}, "
                f"dilation={self.dilation}, groups={self.groups})")

    def __call__(self, env, out_dtype: torch.dtype) -> torch.Tensor:
        x, w = env[self.input], env[self.weight]
        x = x.to_dense() if x.layout != torch.strided else x
        compute = out_dtype if x.dtype == w.dtype == out_dtype and out_dtype.is_floating_point else \
            torch.promote_types(out_dtype, torch.float32)
        y = CONVOLUTIONS[len(self.stride)](x.to(compute), w.to(compute), None, self.stride, self.padding or 0,
                                           self.dilation, self.groups)
        return y.reshape(self.out_shape).to(out_dtype)


def _terms(e) -> dict[str, int] | None:
    """{variable: coefficient} of an affine index with no constant, else None."""
    if isinstance(e, Var):
        return {e.name: 1}
    if isinstance(e, Sum) and e.const == 0 and all(isinstance(a, Var) for _, a in e.terms):
        return {a.name: c for c, a in e.terms}
    return None


def match_conv(graph: Graph, node: Node) -> ConvCall | None:
    """The node as a convolution of a dense input and weight, or None."""
    if node.reduce != "sum" or node.is_scatter or not (isinstance(node.body, Call) and node.body.op == "mul"):
        return None
    if not all(isinstance(a, Read) for a in node.body.args):
        return None
    for xr, wr in (node.body.args, node.body.args[::-1]):
        found = _match(graph, node, xr.access, wr.access)
        if found is not None:
            return found
    return None


def _match(graph: Graph, node: Node, xa, wa) -> ConvCall | None:
    ext = node.extents
    out, red = node.out_vars, node.reduce_vars
    n = len(red) - 1
    if n not in CONVOLUTIONS or len(wa.indices) != n + 2 or len(xa.indices) != n + 2:
        return None
    grouped = len(out) == n + 3
    if len(out) != n + 2 + grouped:
        return None
    batch, spatial = out[0], out[-n:]
    group, channel = (out[1], out[2]) if grouped else (None, out[1])
    cin, window = red[0], red[1:]
    x_shape, w_shape = graph.type_of[xa.tensor].shape, graph.type_of[wa.tensor].shape
    if not (graph.type_of[wa.tensor].format.is_dense and graph.type_of[xa.tensor].format.is_dense):
        return None
    groups, og, cg = (ext[group] if grouped else 1), ext[channel], ext[cin]
    # the weight, read whole: w[g·og + o, c, i...]
    if _terms(wa.indices[0]) != ({group: og, channel: 1} if grouped else {channel: 1}):
        return None
    if [_terms(i) for i in wa.indices[1:]] != [{v: 1} for v in (cin, *window)]:
        return None
    if tuple(w_shape) != (groups * og, cg, *(ext[v] for v in window)):
        return None
    # the input: x[n, g·cg + c, s·h + d·i ...], each window inside the tensor
    if _terms(xa.indices[0]) != {batch: 1} or x_shape[0] != ext[batch]:
        return None
    if _terms(xa.indices[1]) != ({group: cg, cin: 1} if grouped else {cin: 1}) or x_shape[1] != groups * cg:
        return None
    stride, dilation = [], []
    for idx, h, i, size in zip(xa.indices[2:], spatial, window, x_shape[2:]):
        t = _terms(idx)
        if t is None or set(t) != {h, i}:
            return None
        s, d = t[h], t[i]
        if (size - d * (ext[i] - 1) - 1) // s + 1 != ext[h]:
            return None
        stride.append(s)
        dilation.append(d)
    shape = tuple(ext[v] for v in out)
    return ConvCall(node.name, xa.tensor, wa.tensor, tuple(stride), tuple(dilation), groups, shape)



# ---------------------------------------------------------------- padding done by the convolution

class ConvStep:
    """A convolution with its pad node folded in: one step in place of the pad and the contraction."""

    def __init__(self, graph: Graph, call: ConvCall):
        self.call, self.dtype = call, graph.type_of[call.node].dtype
        self.nodes = (call.folded, call.node)

    def __call__(self, env) -> None:
        env[self.call.node] = self.call(env, self.dtype)

    def __str__(self) -> str:
        return f"torch({self.call.node}: {self.call})"


def region_convolutions(graph: Graph, region: Region, taken) -> list[ConvStep]:
    """The convolutions of the region whose zero padding can be left to the convolution."""
    inside, steps = set(region.nodes) - set(taken), []
    for name in region.nodes:
        node = graph.node_of.get(name)
        call = match_conv(graph, node) if node is not None and name in inside else None
        folded = fold_padding(graph, call) if call is not None else None
        if folded is not None and folded.folded in inside:
            steps.append(ConvStep(graph, folded))
    return steps


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
    if any(lo for _, lo, _ in amounts[:2]) or not any(lo for _, lo, _ in amounts):
        return None
    wanted = {(op, v, bound) for v, lo, size in amounts if lo for op, bound in (("ge", lo), ("lt", lo + size))}
    if _conditions(body.args[0]) != wanted:
        return None
    return dataclasses.replace(call, input=src.tensor, padding=tuple(lo for _, lo, _ in amounts[2:]),
                               folded=pad.name)


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
