"""The lowering table: FX call targets -> functions that build IR from their arguments.

Keys are torch-level callables (torch.relu, F.linear, operator.add), method names
("method:view") and ATen op packets ("aten.addmm") so that graphs from symbolic tracing,
from Dynamo and from torch.export all lower through the same functions.
"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir.expr import Cast, Const, Expr
from .builder import GraphBuilder
from .values import TensorValue

Lowering = Callable[..., Any]
LOWERINGS: dict[Any, Lowering] = {}


def lowering(*keys):
    def register(fn: Lowering) -> Lowering:
        for key in keys:
            LOWERINGS[key] = fn
        return fn

    return register


FACTORIES: set = set()  # keys whose lowering computes a tensor made from nothing, where capture would store it


def factory(*keys):
    """Register a lowering for a creation op (zeros, arange, eye): capture folds a call that no graph
    tensor flows into to a stored constant, except these, which write their values as formulas."""
    FACTORIES.update(keys)
    return lowering(*keys)


Refusal = Callable[[tuple, dict], "str | None"]
REFUSALS: dict[Any, Refusal] = {}  # checked on a node's arguments before eager runs it (side effects)


def refusal(*keys):
    """Register a check that refuses a node from its arguments alone, before capture runs it eagerly:
    for ops with side effects (batch norm updating its running statistics), where running them once
    to learn the output's shape and then falling back to eager would apply the effect twice."""
    def register(fn: Refusal) -> Refusal:
        for key in keys:
            REFUSALS[key] = fn
        return fn

    return register


def early_refusal(node: fx.Node) -> str | None:
    """Why `node` must run eagerly although its op has a lowering (None: it may be lowered)."""
    check = REFUSALS.get(key_of(node))
    return check(node.args, node.kwargs) if check is not None else None


IN_PLACE_OPERATORS = frozenset({
    operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
    operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul})


def is_inplace(node: fx.Node) -> bool:
    """Does the node write its first argument (x.add_(y), x += y, torch.relu_(x), aten.add_)? The
    operator module's and_, or_ and not_ are pure despite their names."""
    if node.op == "call_method":
        name = node.target if isinstance(node.target, str) else ""
        return name == "__setitem__" or (name.endswith("_") and not name.endswith("__"))
    if node.op != "call_function":
        return False
    if node.target in IN_PLACE_OPERATORS:
        return True
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._schema.is_mutable
    if getattr(node.target, "__module__", None) in ("_operator", "operator"):
        return False
    name = getattr(node.target, "__name__", "")
    return name.endswith("_") and not name.endswith("__")


def key_name(key) -> str:
    """How a user writes a lowering's key: Tensor.view, aten.addmm, torch.relu, F.linear's name."""
    if isinstance(key, str):
        return f"Tensor.{key[7:]}" if key.startswith("method:") else key
    module = getattr(key, "__module__", None) or ""
    if module == "torch._C._nn" and hasattr(torch.nn.functional, getattr(key, "__name__", "")):
        module = "torch.nn.functional"  # the builtin F.gelu is; private ones (_upsample_*_aa) stay where they are
    module = module.replace("torch._C._linalg", "torch.linalg").replace("torch._C._special", "torch.special")
    name = getattr(key, "__name__", repr(key))
    for prefix in ("linalg", "special"):  # torch.linalg.vector_norm is the builtin linalg_vector_norm
        if module == f"torch.{prefix}":
            name = name.removeprefix(f"{prefix}_")
    return f"{module}.{name}".lstrip(".") if module else f"torch.{name}"


def catalog() -> list[dict]:
    """Every op with a lowering: its name, the family of lowerings it belongs to (the frontend
    module), and whether some of its arguments are refused before capture runs it."""
    import importlib

    importlib.import_module(f"{__package__}.capture")  # imports every lowering module

    rows = {}
    for key, fn in LOWERINGS.items():
        # capture registers an in-place twin of every method (x.add_ as x.add); list those torch has
        if key is None or (isinstance(key, str) and key.startswith("method:") and not hasattr(torch.Tensor, key[7:])):
            continue
        name = key_name(key)
        family = fn.__module__.rsplit(".", 1)[-1].removeprefix("ops_")
        rows[name] = {"op": name, "family": family, "refused_before_capture": key in REFUSALS}
    return sorted(rows.values(), key=lambda r: (r["family"], r["op"]))


def key_of(node: fx.Node):
    if node.op == "call_method":
        return f"method:{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.overloadpacket.__name__}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"aten.{target.__name__}"
    return target


def describe_target(node: fx.Node) -> str:
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    module = getattr(target, "__module__", "") or ""
    return f"{module}.{getattr(target, '__name__', repr(target))}".lstrip(".")


@dataclass
class LowerCtx:
    """What a lowering sees: the builder, the FX node, and the eager result (shape, dtype)."""

    builder: GraphBuilder
    node: fx.Node
    out: Any
    step: str = ""  # a step of a composite op (sub_ctx): named in its nodes' hints

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.out.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.out.dtype

    @property
    def hint(self) -> str:
        return f"{self.node.name}_{self.step}" if self.step else self.node.name


@contextlib.contextmanager
def own_op(ctx: LowerCtx, suffix: str):
    """Nodes emitted inside count as a torch op of their own (the planner's unit, `Node.origin`), not as
    parts of ctx's op, which always share a region: SDPA's zeroing of fully masked queries reduces the
    mask by rows, which fused into the attention's region would be recomputed for every head."""
    saved = ctx.builder.origin
    ctx.builder.origin = f"{saved}.{suffix}"
    try:
        yield
    finally:
        ctx.builder.origin = saved


def sub_ctx(ctx: LowerCtx, shape, dtype: torch.dtype, step: str) -> LowerCtx:
    """The context of one step of a composite op (attention's scores, a loss's elementwise part): its
    own shape and dtype, described by a meta tensor; the op's FX node."""
    return LowerCtx(ctx.builder, ctx.node, torch.empty(tuple(shape), dtype=dtype, device="meta"), step)


LOW_PRECISION = (torch.float16, torch.bfloat16)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Composite ops compute in float32 when their storage is half precision, as eager kernels do."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def upcast(e: Expr, value) -> Expr:
    if isinstance(value, TensorValue) and value.dtype in LOW_PRECISION:
        return Cast(torch.float32, e)
    return e


def operand(x, out_vars, shape, ranges) -> Expr:
    """A broadcast read of a tensor value, or a constant for a Python scalar."""
    if isinstance(x, TensorValue):
        return x.read_broadcast(out_vars, shape, ranges)
    if isinstance(x, torch.Tensor):
        return Const(x.item())
    return Const(x)
