"""The lowering table: FX call targets -> functions that build IR from their arguments.

Keys are torch-level callables (torch.relu, F.linear, operator.add), method names
("method:view") and ATen op packets ("aten.addmm") so that graphs from symbolic tracing,
from Dynamo and from torch.export all lower through the same functions.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import operator
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from ..ir.expr import Cast, Const, Expr
from ..ir.types import LOW_PRECISION
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


# In-place by name and schema, but they change only autograd's view of the tensor, never its values:
# torch.export writes a torch.tensor(...) made in the forward as lift_fresh_copy, then detach_.
VALUES_UNCHANGED = frozenset({"aten.detach_", "method:detach_", "method:requires_grad_"})
# questions about the machine, not the data (transformers' MoE asks `get_device_capability(weight.device)` in its
# forward, which Dynamo keeps in the graph): capture takes the traced answer as a constant, as Dynamo's guards on
# the inputs' devices keep it true
HOST_QUERIES = frozenset({torch.cuda.get_device_capability, torch.cuda.get_device_properties,
                          torch.cuda.get_device_name, torch.cuda.is_available, torch.cuda.current_device,
                          torch.cuda.device_count, torch.cuda.is_bf16_supported})


def is_inplace(node: fx.Node) -> bool:
    """Does the node write its first argument (x.add_(y), x += y, torch.relu_(x), aten.add_)? The
    operator module's and_, or_ and not_ are pure despite their names, and x.detach_() writes no value."""
    if node.op in ("call_method", "call_function") and key_of(node) in VALUES_UNCHANGED:
        return False
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


# Tensor methods Dynamo may record by their operator names (torch 2.11 writes x == y as x.__eq__(y)), as the
# methods they stand for; the reflected ones (__radd__) swap their operands and are not among them.
DUNDER_METHODS = {
    "__eq__": "eq", "__ne__": "ne", "__lt__": "lt", "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__abs__": "abs",
    "__neg__": "neg", "__add__": "add", "__sub__": "sub", "__mul__": "mul", "__truediv__": "div",
    "__floordiv__": "floor_divide", "__mod__": "remainder", "__pow__": "pow", "__matmul__": "matmul",
    "__and__": "bitwise_and", "__or__": "bitwise_or", "__xor__": "bitwise_xor", "__invert__": "bitwise_not",
    "__lshift__": "bitwise_left_shift", "__rshift__": "bitwise_right_shift"}


def key_of(node: fx.Node):
    if node.op == "call_method":
        name = node.target
        if f"method:{name}" not in LOWERINGS and name in DUNDER_METHODS:
            name = DUNDER_METHODS[name]
        return f"method:{name}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target.overloadpacket.__name__}"
    if isinstance(target, torch._ops.OpOverloadPacket):
        return f"aten.{target.__name__}"
    return target


@functools.lru_cache(maxsize=None)
def _signature(fn: Lowering) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _binds(fn: Lowering, args, kwargs) -> bool:
    sig = _signature(fn)
    if sig is None:
        return True
    try:
        sig.bind(None, *args, **kwargs)  # None: the LowerCtx
    except TypeError:
        return False
    return True


def _leading(params) -> tuple[str, ...]:
    """The names of a signature's parameters that may be passed by position, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def _schema_names(schema) -> tuple[str, ...]:
    return tuple(a.name for a in schema.arguments if not a.kwarg_only)


@functools.lru_cache(maxsize=None)
def _torch_positional_names(op: str, target) -> tuple[tuple[str, ...], ...]:
    """For each of torch's overloads of the call, the names of its parameters that may be passed by
    position, in order (torch.sub: input, other). A method call's first name stands for the tensor
    it is called on, whatever torch's function calls it (x.where(condition, y) is where(condition, x, y))."""
    if op == "call_method":
        name = target[:-1] if target.endswith("_") and not target.endswith("__") else target
        fn = getattr(torch, name, None) or getattr(torch.ops.aten, name, None)  # Tensor.view has no torch.view
        if fn is None:
            return ()
        return tuple(("self", *(n for n in names if n not in ("input", "self")))
                     for names in _torch_positional_names("call_function", fn))
    if isinstance(target, torch._ops.OpOverload):
        return (_schema_names(target._schema),)
    if isinstance(target, torch._ops.OpOverloadPacket):
        return tuple(_schema_names(getattr(target, o)._schema) for o in target.overloads())
    from torch.fx.operator_schemas import get_signature_for_torch_op

    try:
        sigs = get_signature_for_torch_op(target)
    except Exception:  # noqa: BLE001 (torch's lookup raises what it meets)
        sigs = None
    if not sigs:
        sig = _signature(target)
        sigs = [sig] if sig is not None else []
    return tuple(dict.fromkeys(_leading(s.parameters.values()) for s in sigs))


def bind_arguments(node: fx.Node, fn: Lowering, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments as `fn` takes them: torch lets every parameter before its `*` be passed by
    name (torch.mul(x, other=2), torch.sub(input=x, other=y), F.relu(input=x)), where lowerings name
    theirs after what they mean (a, b, x). Keywords `fn` cannot take are moved to their positions in
    torch's signature, for the first overload that then binds; a call that already binds is unchanged."""
    if not kwargs or node.op not in ("call_function", "call_method") or _binds(fn, args, kwargs):
        return args, kwargs
    try:
        candidates = _torch_positional_names(node.op, node.target)
    except TypeError:  # an unhashable target
        candidates = ()
    for names in candidates:
        moved, rest = list(args), dict(kwargs)
        while len(moved) < len(names) and names[len(moved)] in rest:
            moved.append(rest.pop(names[len(moved)]))
        if len(moved) > len(args) and _binds(fn, moved, rest):
            return tuple(moved), rest
    return args, kwargs


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
    real_args: tuple = ()  # the example run's arguments (as_strided's legality looks at their storage)
    real: dict | None = None  # the example run's value of each FX node so far (graph inputs among them)

    def owns_storage(self, k: int) -> bool:
        """Is argument k, in the example run, a tensor that is its whole storage, row-major from offset 0, and
        not sharing memory with the graph's inputs? Its storage is then its logical value, which an op that
        addresses storage (as_strided) may be lowered on; an input's storage and offset may change between
        calls of one signature, an intermediate's do not."""
        t = self.real_args[k] if k < len(self.real_args) else None
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided or not t.is_contiguous() or t.storage_offset():
            return False
        storage = t.untyped_storage()
        graph_tensors = [v for n, v in (self.real or {}).items() if n.op in ("placeholder", "get_attr")]
        return storage.nbytes() == t.numel() * t.element_size() and not any(
            isinstance(g, torch.Tensor) and g.layout == torch.strided and g.untyped_storage().data_ptr() == storage.data_ptr()
            for g in graph_tensors)

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
