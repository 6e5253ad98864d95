"""Capture: FX graphs (symbolic tracing, Dynamo, torch.export) -> stitchflow IR.

The driver walks the FX graph once, runs every node eagerly on the example inputs (which gives
shapes and dtypes, and works for sparse tensors where Dynamo and export do not), and hands
each call to its lowering. Calls whose arguments do not depend on the graph's tensors are
folded to constants. Anything without a lowering raises UnsupportedOpError naming the op.
"""

from __future__ import annotations

import contextlib
import dataclasses

import operator
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..ir.errors import ShapeError, StitchflowError, UnsupportedOpError
from ..ir.expr import Const
from ..ir.graph import Graph
from ..ir.types import Format, TensorType, format_of_tensor, parse_format
from . import (ops_activations, ops_attention, ops_complex, ops_complex_math, ops_conv, ops_elementwise,  # noqa: F401
               ops_factory, ops_fft, ops_grouped, ops_index, ops_linalg, ops_losses, ops_mha, ops_pool, ops_reduce,
               ops_random, ops_resize, ops_scan, ops_scatter, ops_shape, ops_sort, ops_stats, ops_trig,
               ops_views)  # (lowerings)
from .builder import GraphBuilder
from .registry import (FACTORIES, HOST_QUERIES, IN_PLACE_OPERATORS, LOWERINGS, VALUES_UNCHANGED, LowerCtx,
                       bind_arguments, describe_target, early_refusal, is_inplace, key_of)

# In-place methods and aten ops lower like their functional forms; capture rebinds the mutated value.
# (torch.export keeps aten's in-place overloads, such as T5's aten.add_, in the graphs it hands over.)
for _key, _fn in list(LOWERINGS.items()):
    if isinstance(_key, str) and _key.startswith("method:") and not _key.endswith("_"):
        LOWERINGS.setdefault(_key + "_", _fn)
    elif (isinstance(_key, str) and _key.startswith("aten.") and not _key.endswith("_")
          and hasattr(torch.ops.aten, _key[5:] + "_")):
        LOWERINGS.setdefault(_key + "_", _fn)
from .values import TensorValue


@dataclass
class Captured:
    """A lowered graph, the constant tensors it holds, and how to rebuild the output pytree."""

    graph: Graph
    param_values: dict[str, torch.Tensor]
    out_spec: Any
    input_names: tuple[str, ...]
    example_outputs: Any = None
    notes: list[str] = field(default_factory=list)
    # input and output names whose axes the graph stores permuted (a target's layout choice): the
    # program reads such an input as x.permute(p) and hands such an output back as a view with the
    # model's axes, so only strides differ from the model's
    layouts: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # (input position, graph output): inputs the model writes in place (x += 1), and the value each ends with,
    # which the program copies into the caller's tensor after a call (capture(..., input_writes=True))
    input_writes: tuple[tuple[int, str], ...] = ()
    # (input position, number): one-element inputs whose item() the graph holds as a constant (Dynamo's tensors
    # for a module's float attributes, traced for dynamic shapes); the program is valid for those numbers only
    valued_inputs: tuple[tuple[int, Any], ...] = ()
    # the graph's last input when it draws random numbers: a seed the program draws from torch's generator at
    # each call and appends to the caller's inputs (ir/random.py)
    random_seed: str | None = None


class _InPlaceProxy(fx.Proxy):
    """torch.fx's Proxy has no in-place operators, so Python runs `row += 1` as `row = row + 1`: when row is
    a view (row = z[0]) the write to z is lost without a word; nor has it item assignment. These record
    operator.iadd and its kin, and operator.setitem, as Dynamo does; capture then treats them as the
    in-place ops they are (or refuses, naming why)."""


def _in_place_operator(op):
    def method(self, other):
        return self.tracer.create_proxy("call_function", op, (self, other), {})
    return method


def _set_item(self, key, value):
    self.tracer.create_proxy("call_function", operator.setitem, (self, key, value), {})


_InPlaceProxy.__setitem__ = _set_item
for _name in ("iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor", "ilshift",
              "irshift", "imatmul"):
    setattr(_InPlaceProxy, f"__{_name}__", _in_place_operator(getattr(operator, _name)))


class FullTracer(fx.Tracer):
    """Symbolic tracer that inlines every submodule, so only functional ops reach the IR while
    each node still records the module stack (used for per-layer fusion)."""

    def is_leaf_module(self, m: torch.nn.Module, qualname: str) -> bool:
        return False

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _InPlaceProxy(node, self)


def symbolic_trace(model: torch.nn.Module | Any) -> fx.GraphModule:
    """Trace a module or a plain function (its parameters become the graph's inputs)."""
    tracer = FullTracer()
    graph = tracer.trace(model)
    name = type(model).__name__ if isinstance(model, torch.nn.Module) else getattr(model, "__name__", "fn")
    return fx.GraphModule(tracer.root, graph, name)


def _module_path(path) -> str:
    path = str(path)
    for prefix in ("L['self'].", "L['self']", "L['fn'].", "self."):
        path = path.removeprefix(prefix)
    return path.replace("_modules['", "").replace("']", "").replace("['", ".")


# partial_depth of a model whose layers are the elements of a container (transformers' `h.0`, `layers.3`) found at
# different depths: the layer is the outermost module on the stack whose name ends in its index.
LAYER_ELEMENTS = "elements"


def layer_group(node: fx.Node, depth: int | str = 1) -> str:
    """The submodule call at `depth` on the node's module stack ("" for top-level code): the
    unit of per-layer ("partial") fusion. Containers (ModuleList) are never called, so
    `decoders.0` is a layer; a model may set `partial_depth = 2` to split its layers further, or
    LAYER_ELEMENTS where its layers sit under wrappers (outside any, a node is top-level code)."""
    stack = [_module_path(path) for path, *_ in (node.meta.get("nn_module_stack") or {}).values()]
    stack = [p for p in stack if p]
    if depth == LAYER_ELEMENTS:
        return next((p for p in stack if p.rsplit(".", 1)[-1].isdigit()), "")
    if not stack:
        return ""
    return stack[min(depth, len(stack)) - 1]


def _format_for(spec, tensor: torch.Tensor) -> Format:
    if spec is None:
        return format_of_tensor(tensor)
    block = None
    if tensor.layout in (torch.sparse_bsr, torch.sparse_bsc):
        block = tuple(tensor.values().shape[-2:])
    return parse_format(spec, tensor.dim(), block)


def capture(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    input_formats: Mapping[Any, str | Format] | None = None,
    param_formats: Mapping[str, str | Format] | None = None,
    partial_depth: int | str = 1,
    input_writes: bool = False,
) -> Captured:
    """Lower `gm` to IR. `input_formats` maps input positions or names to format names
    (e.g. {0: "dcsr"}); `param_formats` maps parameter paths (e.g. "layer1.weight") likewise.

    Capture runs each node eagerly on the example inputs; the random number generators are put back
    afterwards, so that a random op (dropout in training, refused later) draws nothing of the caller's
    stream: a seeded run through the eager fallback gives eager's masks from the first call.

    input_writes: an in-place write to an input (x += 1, cache[pos] = k) becomes the input's new value, which
    the graph outputs and the caller copies back (Captured.input_writes); without, it is refused."""
    devices = sorted({x.device.index or 0 for x in example_inputs if isinstance(x, torch.Tensor) and x.is_cuda})
    with torch.random.fork_rng(devices=devices):
        return _capture(gm, example_inputs, input_formats, param_formats, partial_depth, input_writes)


def _capture(gm, example_inputs, input_formats, param_formats, partial_depth: int | str,
             input_writes: bool = False) -> Captured:
    input_formats = dict(input_formats or {})
    param_formats = dict(param_formats or {})
    b = GraphBuilder()
    env: dict[fx.Node, Any] = {}
    real: dict[fx.Node, Any] = {}
    aliases: dict[fx.Node, list[fx.Node]] = {}  # the nodes naming one tensor through in-place ops' results
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ShapeError(f"the model takes {len(placeholders)} inputs, {len(example_inputs)} were given")
    names = []
    unknown = set(input_formats) - set(range(len(placeholders))) - {p.target for p in placeholders}
    if unknown:
        raise StitchflowError(f"input_formats names unknown inputs {sorted(map(str, unknown))}")
    for pos, (ph, value) in enumerate(zip(placeholders, example_inputs)):
        real[ph] = value
        names.append(ph.target)
        if isinstance(value, torch.Tensor):
            if value.numel() == 0:
                raise ShapeError(f"input {ph.target} is empty {tuple(value.shape)}; zero-size tensors are not supported")
            if value.is_complex():  # the program takes it as view_as_real's (..., 2) real tensor (Program._bind)
                env[ph] = ops_complex.from_pairs(b.add_input(ph.target, ops_complex.pairs_type(value)))
                continue
            spec = input_formats.get(pos, input_formats.get(ph.target))
            ttype = TensorType(tuple(value.shape), value.dtype, _format_for(spec, value))
            env[ph] = b.add_input(ph.target, ttype)
        else:
            env[ph] = value
    used_params = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        b.origin, b.group = node.name, layer_group(node, partial_depth)
        if node.op == "get_attr":
            value = _fetch_attr(gm, node.target)
            real[node] = value
            if isinstance(value, torch.Tensor) and value.numel() == 0:  # a constant with no elements: a value
                env[node] = value
            elif _traced_scalar(node, value):  # x * torch.tensor(2.0) under symbolic tracing: a number, as eager
                env[node] = b.emit((), value.dtype, lambda o, r, rg, v=value.item(): Const(v), hint=node.name)
            elif isinstance(value, torch.Tensor) and value.is_complex():
                env[node] = ops_complex.from_pairs(b.add_param(node.target, ops_complex.as_pairs(value)))
                used_params.add(node.target)
            elif isinstance(value, torch.Tensor):
                spec = param_formats.get(node.target)
                env[node] = b.add_param(node.target, value, _format_for(spec, value) if spec else None)
                used_params.add(node.target)
            else:
                env[node] = value
            continue
        try:
            env[node], real[node] = _lower_call(gm, node, b, env, real, aliases, input_writes)
        except Exception as err:  # the node that refused (or hit a bug): the backend splits the graph around it
            if not getattr(err, "node", ""):
                with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
                    err.node = node.name
            raise
    unused = set(param_formats) - used_params
    if unused:
        raise StitchflowError(f"param_formats names parameters the model does not use: {sorted(unused)}")
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    written = [(pos, env[ph]) for pos, ph in enumerate(placeholders) if ph in aliases]
    captured = _finish(b, out_node, env, real, tuple(names), written)
    valued = tuple((pos, real[ph].item()) for pos, ph in enumerate(placeholders) if reads_number(ph))
    return dataclasses.replace(captured, valued_inputs=valued) if valued else captured


ITEM_KEYS = frozenset({"method:item", "aten.item", "aten._local_scalar_dense"})


def reads_number(placeholder: fx.Node) -> bool:
    """Does the graph take the input's value as a Python number (item())?"""
    return any(key_of(u) in ITEM_KEYS for u in placeholder.users if u.op in ("call_function", "call_method"))


def _traced_scalar(node: fx.Node, value) -> bool:
    """A 0-d constant that symbolic tracing made of a `torch.tensor(...)` in the forward (`_tensor_constant0`):
    not a parameter or buffer that could change, and, on the CPU, a number to eager wherever it meets CUDA
    tensors, which a kernel argument would not be."""
    return (isinstance(value, torch.Tensor) and value.dim() == 0 and not isinstance(value, torch.nn.Parameter)
            and node.target.rsplit(".", 1)[-1].startswith("_tensor_constant") and not value.is_complex())


def _fetch_attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj.detach() if isinstance(obj, torch.Tensor) else obj


def _lower_call(gm, node: fx.Node, b: GraphBuilder, env, real, aliases, input_writes: bool = False):
    # map_arg also reaches nodes inside slices (x[..., n // 2:]), which pytree does not
    args = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
    real_args, real_kwargs = fx.node.map_arg((node.args, node.kwargs), real.__getitem__)
    if node.op == "call_module" and node.target == "_guards_fn":
        return None, None  # torch.export's input guards: Program checks shapes itself
    why = early_refusal(node)
    if why:
        raise UnsupportedOpError(describe_target(node), why, node.name)
    # n += 1 on a traced size, or shape += (1,), is Python's, not a write
    inplace = is_inplace(node) and not (node.target in IN_PLACE_OPERATORS
                                        and not isinstance(real_args[0], torch.Tensor))
    if inplace and isinstance(node.args[0], fx.Node):
        root = _same_tensor_as(node.args[0], real, aliases)
        if root.op in ("placeholder", "get_attr") and isinstance(args[0][0], TensorValue) and not (
                input_writes and root.op == "placeholder"):
            raise UnsupportedOpError(describe_target(node), "it mutates an input of the graph in place", node.name)
        if _shares_memory(real, node.args[0], aliases.get(node.args[0], ()), node) and not _written_back(node):
            raise UnsupportedOpError(describe_target(node), "it writes a tensor that shares memory with another (a view, "
                                     "or a tensor viewed elsewhere): the IR's values are not aliased, so the write "
                                     "would not reach the other", node.name)
        real_args = (real_args[0].clone(), *real_args[1:])  # keep the value other nodes saw intact
    elif key_of(node) in VALUES_UNCHANGED and isinstance(real_args[0], torch.Tensor):
        real_args = (real_args[0].detach(), *real_args[1:])  # the same memory, but the caller's tensor keeps its grad
    out = _run_eager(gm, node, real_args, real_kwargs)
    if node.target in (operator.setitem, "__setitem__") and inplace:
        out = real_args[0]  # x[key] = v returns nothing: the written tensor is the result
    depends = _any_value(args)
    if isinstance(out, torch.Tensor) and out.numel() == 0:
        # no elements, no data: a constant, whatever it is made of (a cache's torch.tensor([]), the empty tail of a
        # split at its length under dynamic shapes); torch.cat skips it, and what else reads it only it folds too
        if not inplace:
            return out, out
        raise ShapeError(f"{describe_target(node)} ({node.name}) produces an empty tensor {tuple(out.shape)}; "
                         "zero-size tensors are not supported")
    # An in-place op returns the tensor it wrote (y.mul_(2).add_(1) writes y twice), so its result, the
    # tensor and every earlier such result name one value: later uses of any of them see the write.
    written = aliases.setdefault(node.args[0], [node.args[0]]) if inplace and isinstance(node.args[0], fx.Node) else []
    for name in written:
        real[name] = out
    key = key_of(node) if node.op != "call_module" else None
    if (not depends and key not in FACTORIES) or (key in HOST_QUERIES and not isinstance(out, torch.Tensor)):
        # no graph tensor flows in, or only its device: fold to a constant
        if isinstance(out, torch.Tensor):
            return ops_complex.constant(b, out), out
        return out, out
    if node.op == "call_module":
        raise UnsupportedOpError(f"module {node.target}", "leaf modules are not traced into", node.name)
    fn = LOWERINGS.get(key)
    if fn is None:
        raise UnsupportedOpError(describe_target(node), "no lowering to the IR", node.name)
    complex_out = isinstance(out, torch.Tensor) and out.is_complex()  # 1j * x: complex from real operands
    if not getattr(fn, "takes_complex", False) and (complex_out or ops_complex.any_complex(args)):
        fn = ops_complex.COMPLEX_LOWERINGS.get(key) or ops_complex.partwise(key, fn) or ops_complex.bilinear(key, fn)
        if fn is None:
            raise UnsupportedOpError(describe_target(node), "it takes or makes a complex value (lowered: Fourier "
                                     "transforms, conj, arithmetic, powers, exp, log, sqrt, the trigonometric and "
                                     "hyperbolic functions and their inverses, sigmoid, abs, angle, views, where, "
                                     "sums, products, matmul and einsum, .real, .imag, view_as_real)", node.name)
    ctx = LowerCtx(b, node, out, real_args=tuple(real_args), real=real)
    call_args, call_kwargs = bind_arguments(node, getattr(fn, "binds_as", fn), *args)  # torch.mul(x, other=2): `other` by position
    try:
        value = fn(ctx, *call_args, **call_kwargs)
    except StitchflowError:
        raise
    except (TypeError, ValueError, IndexError) as err:
        raise UnsupportedOpError(describe_target(node), f"these arguments are not supported ({err})", node.name) from err
    _check_shape(node, value, out)
    for name in written:
        env[name] = value
    if written:
        written.append(node)
        aliases[node] = written
    return value, out


def _written_back(node: fx.Node) -> bool:
    """x[key] += v (BEiT's relative-position table): Python reads the item, a view of x, adds to it in place and
    assigns it back, x[key] = item, right after. That assignment carries the write to x in the IR too, so the add
    may be a new value, provided nothing else reads the view."""
    view, after = node.args[0], node.next
    if not (isinstance(view, fx.Node) and view.target in (operator.getitem, "__getitem__") and len(view.users) == 1):
        return False
    if after.target not in (operator.setitem, "__setitem__") or after.args[0] is not view.args[0] \
            or after.args[2] is not node:
        return False
    try:  # keys of slices, ints and nodes compare by value; a constant tensor in a key gives no plain answer
        return bool(after.args[1] == view.args[1])
    except RuntimeError:
        return False


SAME_TENSOR_OPS = frozenset({"method:to", "aten.to", "method:contiguous", "aten.contiguous", "method:cpu",
                             "method:cuda", "method:type_as", "method:float", "method:double", "method:half",
                             "method:bfloat16", "method:type"})  # return their operand itself where nothing changes


def _same_tensor_as(node: fx.Node, real: dict, aliases: dict) -> fx.Node:
    """The node whose tensor `node` is, the very object: `t.to(device)` returns t where t is there already
    (transformers' static cache: `self.cumulative_length.to(self.device)`, then `.add_(n)` writes the caller's
    tensor). The two join one alias group, so that a write through either is a write of the first."""
    root = node
    while (root.op in ("call_method", "call_function") and key_of(root) in SAME_TENSOR_OPS and root.args
           and isinstance(root.args[0], fx.Node) and real.get(root) is real.get(root.args[0])):
        root = root.args[0]
    if root is not node:
        group = aliases.setdefault(root, [root])
        if node not in group:
            group.append(node)
        aliases[node] = group
    return root


def _shares_memory(real: dict, written: fx.Node, same=(), writer: fx.Node | None = None) -> bool:
    """Does the tensor an in-place op writes share storage with another value of the graph that can see the write
    (z[0].add_(1) changes z in eager; so does x.contiguous().add_(1), whose operand is x itself)? Judged on the
    example run's real tensors; `same` are the nodes naming the written tensor through earlier in-place results.
    A sharer that no node after the `writer` reads, and that is neither the caller's (an input, a parameter) nor
    returned, cannot: `t = torch.tensor(n).to("cpu"); t.add_(32)` writes the constant `to` returned as it is."""
    t = real.get(written)
    sharers = [key for key, o in real.items() if key is not written and key not in same and _aliases(t, [o])]
    if writer is None or not sharers:
        return bool(sharers)
    later = set()
    node = writer.next
    while node.op != "root":
        later.add(node)
        node = node.next
    return any(s.op in ("placeholder", "get_attr") or any(u in later for u in s.users) for s in sharers)


def _any_value(args) -> bool:
    found = []
    fx.node.map_aggregate(args, lambda a: found.append(a) if isinstance(a, (TensorValue, ops_complex.ComplexValue))
                          else a)
    return bool(found)


def _run_eager(gm, node: fx.Node, args, kwargs):
    try:
        return _call(gm, node, args, kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as err:
        raise ShapeError(f"{describe_target(node)} ({node.name}) fails in eager PyTorch on the example inputs: "
                         f"{str(err).splitlines()[0]}") from err


def _call(gm, node: fx.Node, args, kwargs):
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    raise StitchflowError(f"unexpected FX node kind {node.op}")


def _check_shape(node, value, out):
    if isinstance(value, (TensorValue, ops_complex.ComplexValue)) and isinstance(out, torch.Tensor) \
            and tuple(out.shape) != value.shape:
        raise ShapeError(f"lowering of {node.name} gave shape {value.shape}, torch gives {tuple(out.shape)}")


def _finish(b: GraphBuilder, out_node: fx.Node, env, real, names, written=()) -> Captured:
    result = fx.node.map_arg(out_node.args[0], env.__getitem__)
    example = fx.node.map_arg(out_node.args[0], real.__getitem__)
    pytree_info = getattr(out_node.graph._codegen, "pytree_info", None)  # torch.export flattens outputs
    if pytree_info is not None and pytree_info.out_spec is not None:
        # already flat: keep export's own spec rather than rebuild the caller's objects around capture values
        # and flatten them again (a key/value cache's flattening keeps what it holds in its spec)
        leaves, spec, example_leaves = list(result), pytree_info.out_spec, list(example)
        example = tree_unflatten(example_leaves, spec)
    else:
        leaves, spec = tree_flatten(result)
        example_leaves = tree_flatten(example)[0]
    held = [t for k, t in real.items() if k.op in ("placeholder", "get_attr")]  # the graph's inputs and parameters
    outputs = []
    b.origin, b.group = "output", ""
    for leaf, seen in zip(leaves, example_leaves):
        if isinstance(leaf, TensorValue):
            node = b.reshaped_node(leaf)
            out = (node, leaf.shape) if node else b.materialize(leaf, hint="out").base
            if (out in b.inputs or out in b.params) and not _aliases(seen, held):
                # an input or a parameter itself, where eager made a tensor of its own (x.clone() lowers
                # as the identity): handing the caller's tensor back would let a write to the output
                # reach the input
                out = b.emit(leaf.shape, leaf.dtype, lambda o, r, rg, leaf=leaf: leaf.read(o, rg), hint="out").base
            outputs.append(out)
        elif isinstance(leaf, ops_complex.ComplexValue):  # stored as view_as_real's pairs, handed out as complex
            outputs.append((ops_complex.to_pairs(b, leaf).base, leaf.shape, "complex"))
        elif leaf is None or isinstance(leaf, (int, float, bool)):
            outputs.append(leaf)
        elif isinstance(leaf, torch.Tensor) and leaf.numel() == 0:
            raise ShapeError(f"an output is empty {tuple(leaf.shape)}; zero-size tensors are not supported")
        else:
            raise UnsupportedOpError("output", f"an output of type {type(leaf).__name__}")
    writes = tuple((pos, b.materialize(value, hint="written").base) for pos, value in written)
    writes = tuple((pos, name) for pos, name in writes if name not in b.inputs)  # x.add_(0) and kin write nothing
    names_out = [o if isinstance(o, str) else o[0] for o in outputs if isinstance(o, (str, tuple))]
    graph = b.finish(list(dict.fromkeys([*names_out, *(name for _, name in writes)])))
    return Captured(graph, dict(b.param_values), (spec, outputs), names, example, input_writes=writes,
                    random_seed=b.seed.base if b.seed is not None else None)


def _aliases(t, tensors) -> bool:
    """Does `t` share storage with one of `tensors` (strided ones; anything else shares nothing)? An empty
    storage holds no memory to share: every one has address 0 (torch.export's lifted `torch.tensor([])` of a
    KV cache, detached in place, would otherwise alias every other empty tensor)."""
    if not isinstance(t, torch.Tensor) or t.layout != torch.strided or t.untyped_storage().nbytes() == 0:
        return False
    storage = t.untyped_storage().data_ptr()
    return any(isinstance(o, torch.Tensor) and o.layout == torch.strided and o.untyped_storage().data_ptr() == storage
               for o in tensors)


def rebuild_outputs(captured: Captured, env: Mapping[str, torch.Tensor]):
    """The program's outputs in the model's structure; reshaped nodes come back as views."""
    spec, outputs = captured.out_spec
    layouts = captured.layouts

    def leaf(o):
        if isinstance(o, str):
            return env[o] if o not in layouts else env[o].permute(inverse_permutation(layouts[o]))
        if isinstance(o, tuple) and o[2:] == ("complex",):  # (..., 2) real and imaginary parts
            return torch.view_as_complex(env[o[0]])
        if isinstance(o, tuple):  # stored in an order that keeps the reshape a view (channels_last._view_last)
            t = env[o[0]]  # (reshape: a copy, never an error, should no order make it a view)
            return t.view(o[1]) if o[0] not in layouts else t.permute(inverse_permutation(layouts[o[0]])).reshape(o[1])
        return o

    return tree_unflatten([leaf(o) for o in outputs], spec)


def inverse_permutation(perm: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(perm)
    for k, p in enumerate(perm):
        inverse[p] = k
    return tuple(inverse)
