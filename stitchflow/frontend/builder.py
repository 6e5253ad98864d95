"""GraphBuilder: accumulates inputs, parameters and equations while an FX graph is lowered."""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

import torch

from ..ir.errors import ShapeError, UnsupportedOpError
from ..ir.expr import Expr, Read
from ..ir.graph import Graph, Node, Tag
from ..ir.index import Var
from ..ir.types import Format, TensorType, dense_type
from .values import TensorValue, identity, reshape

OUT_NAMES = "ijlmnopq"
RED_NAMES = "kruvwxyz"

SEED_HINT = "random_seed"
BodyFn = Callable[[list[Var], list[Var], dict], Expr]


def loop_vars(rank: int, names: str, taken: Sequence[str] = ()) -> list[Var]:
    pool = [n for n in names if n not in taken] + [f"{names[0]}{k}" for k in range(rank)]
    return [Var(pool[d]) for d in range(rank)]


class GraphBuilder:
    def __init__(self):
        self.inputs: list[str] = []
        self.params: list[str] = []
        self.param_values: dict[str, torch.Tensor] = {}
        self.nodes: list[Node] = []
        self.node_names: set[str] = set()
        self.types: dict[str, TensorType] = {}
        self._counter = itertools.count()
        self._tags = itertools.count(1)
        self.origin = ""
        self.group = ""
        self.seed: TensorValue | None = None  # the random seed input, once a random op asked for it
        self._streams = itertools.count()

    # names ------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        hint = "".join(ch if ch.isalnum() else "_" for ch in hint).strip("_") or "t"
        name = hint
        while name in self.types:
            name = f"{hint}_{next(self._counter)}"
        return name

    def new_tag(self, kind: str) -> Tag:
        return Tag(kind, next(self._tags))

    # declarations -----------------------------------------------------------
    def add_input(self, hint: str, ttype: TensorType) -> TensorValue:
        _real(ttype.dtype, hint)
        name = self.fresh(hint)
        self.inputs.append(name)
        self.types[name] = ttype
        return identity(name, ttype.shape, ttype.dtype)

    def add_param(self, hint: str, value: torch.Tensor, fmt: Format | None = None) -> TensorValue:
        _real(value.dtype, hint)
        name = self.fresh(hint)
        self.params.append(name)
        self.param_values[name] = value
        ttype = dense_type(value.shape, value.dtype)
        if fmt is not None:
            ttype = TensorType(ttype.shape, ttype.dtype, fmt)
        self.types[name] = ttype
        return identity(name, ttype.shape, ttype.dtype)

    def random_stream(self) -> tuple[TensorValue, int]:
        """The graph's seed (a 0-d int64 input that the program draws afresh at each call, added on first use)
        and a stream number of its own for the asking op: its numbers are Philox's under key seed + stream."""
        if self.seed is None:
            self.seed = self.add_input(SEED_HINT, dense_type((), torch.int64))
        return self.seed, next(self._streams)

    # equations --------------------------------------------------------------
    def emit(
        self,
        shape: Sequence[int],
        dtype: torch.dtype,
        body: BodyFn,
        *,
        reduce: str | None = None,
        red_shape: Sequence[int] = (),
        tag: Tag | None = None,
        hint: str = "t",
        fmt: Format | None = None,
    ) -> TensorValue:
        """Add `out[out_vars] (reduce)= body(out_vars, red_vars, ranges)` and return its value."""
        _real(dtype, hint)
        shape = tuple(int(s) for s in shape)
        out_vars = loop_vars(len(shape), OUT_NAMES)
        red_vars = loop_vars(len(red_shape), RED_NAMES, [v.name for v in out_vars])
        dims = tuple((v.name, n) for v, n in zip(out_vars, shape)) + tuple(
            (v.name, int(n)) for v, n in zip(red_vars, red_shape)
        )
        ranges = dict(dims)
        expr = body(out_vars, red_vars, ranges)
        name = self.fresh(hint)
        node = Node(name, tuple(out_vars), expr, dims, reduce, tag, self.origin, self.group)
        self.nodes.append(node)
        self.node_names.add(name)
        self.types[name] = TensorType(shape, dtype, fmt) if fmt else dense_type(shape, dtype)
        return identity(name, shape, dtype)

    def scatter(self, out_shape, dtype, loop_shape, body: BodyFn, index_fn, *, reduce="sum",
                hint="scatter") -> TensorValue:
        """out[index_fn(vars)] += body(vars) over a loop of `loop_shape` (vars are all loop vars); with
        reduce "max", "min" or "prod" the positions keep the largest, the smallest or the product."""
        loop = loop_vars(len(loop_shape), OUT_NAMES)
        dims = tuple((v.name, int(n)) for v, n in zip(loop, loop_shape))
        ranges = dict(dims)
        name = self.fresh(hint)
        node = Node(name, tuple(index_fn(loop, ranges)), body(loop, [], ranges), dims, reduce, None, self.origin, self.group)
        if not node.is_scatter:
            raise ShapeError("scatter without an indirect output index")
        self.nodes.append(node)
        self.node_names.add(name)
        self.types[name] = dense_type(out_shape, dtype)
        return identity(name, tuple(out_shape), dtype)

    def materialize(self, v: TensorValue, hint: str = "copy") -> TensorValue:
        """A node that copies a view into a tensor of its own (for outputs and opaque uses)."""
        if self.is_whole(v):
            return v
        return self.emit(v.shape, v.dtype, lambda o, r, rg: v.read(o, rg), hint=hint)

    def is_whole(self, v: TensorValue) -> bool:
        """v is its base tensor itself, not a view of part of it."""
        return v.is_identity and v.shape == self.types[v.base].shape

    def reshaped_node(self, v: TensorValue) -> str | None:
        """The node `v` is a row-major reshape of, whole (group norm's output seen in x's shape),
        or None: such a view can be handed out, and computed through, in the node's coordinates."""
        if v.is_identity or v.base not in self.node_names or not self.types[v.base].format.is_dense:
            return None
        shape = self.types[v.base].shape
        if shape == v.shape or math.prod(shape) != math.prod(v.shape):
            return None
        try:
            same = reshape(identity(v.base, shape, v.dtype), v.shape).index == v.index
        except ShapeError:
            return None
        return v.base if same else None

    def read(self, v: TensorValue, exprs, ranges) -> Read:
        return v.read(exprs, ranges)

    def finish(self, outputs: Sequence[str]) -> Graph:
        """The graph of the nodes the outputs need: a lowering may emit more than is read (topk's indices
        where only its values are used, argmax's peak), and every node left in would be computed."""
        needed, nodes = set(outputs), []
        for node in reversed(self.nodes):
            if node.name in needed:
                nodes.append(node)
                needed.update(node.inputs)
        kept = {n.name for n in nodes}
        types = tuple((name, t) for name, t in self.types.items() if name in kept or name not in self.node_names)
        # the seed last: the caller's inputs come first, in their order, and the program appends the seed
        inputs = [n for n in self.inputs if self.seed is None or n != self.seed.base] + (
            [self.seed.base] if self.seed is not None else [])
        return Graph(tuple(inputs), tuple(self.params), tuple(reversed(nodes)), tuple(outputs), types).validate()


def _real(dtype: torch.dtype, hint: str) -> None:
    """The IR is real: complex values are pairs of real tensors in the frontend (ops_complex.py), never IR tensors."""
    if dtype.is_complex:
        raise UnsupportedOpError(hint, f"a {dtype} tensor in the IR (complex values are lowered as pairs of real "
                                       "tensors where an op knows how)")
