"""Convolutions found in the IR, run as torch's (cuDNN's) convolution.

The frontend lowers a convolution to a contraction whose input read is affine in an output and a
window coordinate, out[n, o, h] = sum_{c, i} x[n, c, s·h + d·i] · w[o, c, i], zero padding a pad
node before it (and groups an output axis of their own: x[n, g·C + c, ...], w[g·O + o, c, ...]).
As an einsum of strided views the input would be unfolded in memory (im2col) first; this module
recognises the form and calls F.conv1d/2d/3d on the padded tensor instead. The pad stitches with
its producer (batch norm, relu) in a generated kernel, so the padded copy costs one pass that
eager spends on that producer anyway."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...ir.expr import Call, Read
from ...ir.graph import Graph, Node
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

    def __str__(self) -> str:
        return (f"conv{len(self.stride)}d({self.input}, {self.weight}, stride={self.stride}, "
                f"dilation={self.dilation}, groups={self.groups})")

    def __call__(self, env, out_dtype: torch.dtype) -> torch.Tensor:
        x, w = env[self.input], env[self.weight]
        x = x.to_dense() if x.layout != torch.strided else x
        compute = out_dtype if x.dtype == w.dtype == out_dtype and out_dtype.is_floating_point else \
            torch.promote_types(out_dtype, torch.float32)
        y = CONVOLUTIONS[len(self.stride)](x.to(compute), w.to(compute), None, self.stride, 0, self.dilation,
                                           self.groups)
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

