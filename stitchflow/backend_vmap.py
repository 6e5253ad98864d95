"""torch.vmap bodies that Dynamo inlined, rewritten as ops on whole tensors.

Dynamo traces `torch.vmap(f)(x)` as `_vmap_increment_nesting`, `_add_batch_dim(x, in_dim, level)` per input, f's
ops on functorch's batched tensors, `_remove_batch_dim(y, level, batch_size, out_dim)` per output and
`_vmap_decrement_nesting`. Batched tensors have no storage, so a program cannot be captured on them. Where every op
of a body is elementwise, reduces, scans, sorts or normalises along given dims (or over trailing ones), views its
value (basic indexing, reshapes, transposes), or multiplies matrices, the body has the same meaning on the physical
tensors with the batch dim in front: each batched value becomes that tensor (logical shape S, physical (B, *S)),
unbatched operands broadcast against it as they did against S once the batched operands share one rank, and a dim
argument d of a batched operand becomes d + 1 (a view's shape gains the batch sizes in front). Nested vmaps
likewise, with one leading dim per level a value is batched at (`Physical`). Bodies with other ops or random numbers
stay as they are (refused, they run eagerly).
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx as fx
from torch._functorch import predispatch
from torch._subclasses.fake_tensor import FakeTensor

from .frontend.registry import describe_target

log = logging.getLogger("stitchflow.backend")

ELEMENTWISE_NAMES = frozenset("""add sub mul div truediv neg pow exp exp2 expm1 log log2 log1p sigmoid tanh relu sin
cos sqrt rsqrt abs where maximum minimum clamp clamp_min clamp_max reciprocal square sign floor ceil round erf
silu gelu softplus logical_not logical_and logical_or eq ne lt le gt ge float half bfloat16 double long int bool
to""".split())
ALONG_DIMS = frozenset({"sum", "mean", "amax", "amin", "softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp",
                        "logsumexp", "var", "std", "any", "all", "prod", "argmax", "argmin", "argsort"})
FULL_REDUCTIONS = frozenset({"sum", "mean", "amax", "amin", "var", "std", "any", "all"})  # (no dim: every dim)
# normalisations over trailing dims (normalized_shape): leading batch dims change nothing, where the weight and bias
# are not batched
TRAILING = frozenset({"layer_norm", "rms_norm"})
# ops along a dim with several results (taken apart by getitem), and where their dim argument stands; a missing one
# is -1, the last dim, which the batch dims in front do not move
SEVERAL_RESULTS = {"sort": 1, "topk": 2, "kthvalue": 2, "cummax": 1, "cummin": 1, "median": 1, "mode": 1,
                   "max": 1, "min": 1, "var_mean": 1, "std_mean": 1, "aminmax": None}
DIM_NEEDED = frozenset({"var_mean", "std_mean", "aminmax"})  # (without one they reduce every dim)
# matrix products broadcast their leading dims as elementwise ops do, where no operand is a vector
MATRIX_PRODUCTS = frozenset({"matmul", "linear"})
OPERATORS = {operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "truediv",
             operator.neg: "neg", operator.pow: "pow", operator.matmul: "matmul", operator.eq: "eq",
             operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt", operator.ge: "ge"}
MARKERS = (predispatch.lazy_load_decompositions, predispatch._vmap_increment_nesting,
           predispatch._vmap_decrement_nesting)
# where Dynamo enters torch.func.grad / vjp / jacrev (reverse mode) and jvp / jacfwd (forward mode)
GRAD_TRANSFORMS = frozenset(getattr(module, name) for module in (torch._C._functorch, predispatch)
                            for name in ("_grad_increment_nesting", "_jvp_increment_nesting") if hasattr(module, name))


def functorch_transforms(gm: fx.GraphModule) -> str | None:
    """Why the graph needs functorch's own tracing, or None: a transform that Dynamo inlined and the rewrite on whole
    tensors cannot take, a gradient (torch.func.grad, vjp, jacrev: per-sample gradients), a forward-mode derivative, or
    a vmap body with ops it does not rewrite. AOTAutograd traces such a graph into plain ATen ops (batched,
    differentiated), which compile like any other; left to Dynamo's graph, they would run eagerly."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in GRAD_TRANSFORMS:
            return f"a torch.func transform ({describe_target(node)})"
    for body in _bodies(gm.graph):
        why = _rewritable(body)
        if why is not None:
            return f"a torch.vmap body the rewrite on whole tensors does not take ({why})"
    return None


def unbatch_vmap_bodies(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """Rewrite every body that `_rewritable` accepts; returns, for each node of the others, why not."""
    kept, done = {}, False
    for body in _bodies(gm.graph):
        why = _rewritable(body)
        if why is None:
            _rewrite(gm.graph, body)
            done = True
            log.info("a torch.vmap body of %d nodes runs on whole tensors", len(body))
        else:
            kept.update(dict.fromkeys(body, why))
    if done:
        gm.graph.lint()
        gm.recompile()
    return kept


def _bodies(graph: fx.Graph) -> list[list[fx.Node]]:
    """The nodes from each outermost `_vmap_increment_nesting` to its `_vmap_decrement_nesting`."""
    bodies, current, depth = [], None, 0
    for node in graph.nodes:
        if node.target is predispatch._vmap_increment_nesting:
            depth += 1
            current = [node] if depth == 1 else current + [node]
            continue
        if current is None:
            continue
        current.append(node)
        if node.target is predispatch._vmap_decrement_nesting:
            depth -= 1
            if depth == 0:
                bodies.append(current)
                current = None
    return bodies


def _rewritable(body: list[fx.Node]) -> str | None:
    """None if the body can be rewritten, else why not. Nested vmaps are taken: each batched value carries the
    levels it is batched at (an inner vmap's level is the higher), innermost last."""
    for start in (n for n in body if n.target is predispatch._vmap_increment_nesting):
        if start.args[1:] not in (("error",), ("same",)):
            return "random numbers under vmap's 'different' randomness"
    levels: dict[fx.Node, tuple] = {}
    for node in body:
        if node.target in MARKERS:
            continue
        if node.target is predispatch._add_batch_dim:
            outer = levels.get(node.args[0], ())
            if outer and outer[-1] >= node.args[2]:
                return "a batch dim added inside out"
            levels[node] = outer + (node.args[2],)
        elif node.target is predispatch._remove_batch_dim:
            inner = levels.get(node.args[0], ())
            if not inner or inner[-1] != node.args[1]:
                return "an output that does not depend on its vmap's batched inputs"
            if inner[:-1]:
                levels[node] = inner[:-1]
        elif any(a in levels for a in node.all_input_nodes):
            why = _op_refusal(node, levels)
            if why:
                return why
            levels[node] = tuple(sorted(set().union(*(levels.get(a, ()) for a in node.all_input_nodes))))
    return None


def _op_refusal(node: fx.Node, levels: dict) -> str | None:
    name = _op_name(node)
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node) and \
            _op_name(node.args[0]) in SEVERAL_RESULTS:  # a result of an op with several (refused or taken there)
        return None if isinstance(node.args[1], int) else f"{node.name} indexes {node.args[0].name}'s results"
    if node.target is operator.getitem or name in VIEWS:
        return _view_refusal(node, "getitem" if node.target is operator.getitem else name, levels)
    if name in SEVERAL_RESULTS:
        return _several_results_refusal(node, name)
    if name not in ELEMENTWISE_NAMES | ALONG_DIMS | MATRIX_PRODUCTS | TRAILING:
        return f"{describe_target(node)} in the body"
    if name in ALONG_DIMS and isinstance(_dim_argument(node), bool):  # var(x, unbiased): the old signature
        return f"{describe_target(node)} with no dim in the body"
    if name in ALONG_DIMS - FULL_REDUCTIONS and _dim_argument(node) is None:
        return f"{describe_target(node)} with no dim in the body"
    if name in TRAILING and set(node.all_input_nodes[1:]) & set(levels):
        return f"{describe_target(node)} with a batched weight or bias in the body"
    if name == "matmul" and min(_rank_of(a) for a in node.all_input_nodes) < 2:
        return f"{describe_target(node)} of a vector in the body"
    if name == "linear" and _rank_of(node.args[0]) < 2 and set(node.all_input_nodes[1:]) & set(levels):
        return f"{describe_target(node)} of a vector by a batched weight in the body"
    if _batched_value(node) is None:
        return f"{node.name} makes something other than one tensor"
    return None


def _several_results_refusal(node: fx.Node, name: str) -> str | None:
    value = node.meta.get("example_value")
    if not isinstance(value, (tuple, list)) or not all(isinstance(v, torch.Tensor) for v in value):
        return f"{node.name} makes something other than tensors"  # max(x) alone: one tensor, every dim
    given = (SEVERAL_RESULTS[name] is not None and len(node.args) > SEVERAL_RESULTS[name]) or "dim" in node.kwargs
    if not isinstance(_several_results_dim(node, name), int) or (name in DIM_NEEDED and not given):
        return f"{describe_target(node)} with no dim in the body"
    return None


def _several_results_dim(node: fx.Node, name: str):
    """The dim argument of an op with several results; -1 (its default) where it is not given."""
    at = SEVERAL_RESULTS[name]
    if at is not None and len(node.args) > at:
        return node.args[at]
    return node.kwargs.get("dim", -1)


def _op_name(node: fx.Node) -> str | None:
    if node.op == "call_method":
        return node.target
    if node.op != "call_function":
        return None
    if node.target in OPERATORS:
        return OPERATORS[node.target]
    name = getattr(node.target, "__name__", None)
    module = getattr(node.target, "__module__", "") or ""
    return name if module.startswith("torch") and "random" not in module else None


def _batched_value(node: fx.Node):
    value = node.meta.get("example_value")
    return value if isinstance(value, torch.Tensor) else None


@dataclasses.dataclass(frozen=True)
class Physical:
    """How a physical tensor stands for a batched value: one leading dim per vmap level it is batched at
    (ascending), then the value's logical dims."""

    levels: tuple
    rank: int

    def __str__(self) -> str:
        return f"levels {self.levels}, logical rank {self.rank}"


def _loader_of(start: fx.Node) -> fx.Node | None:
    """The `lazy_load_decompositions` that Dynamo records just before a vmap's first `_vmap_increment_nesting`,
    past the arithmetic on sizes between them (the batch size of a graph traced for dynamic shapes)."""
    node = start.prev
    while node.op == "call_function" and not isinstance(node.meta.get("example_value"), torch.Tensor) and \
            node.target is not predispatch.lazy_load_decompositions and node.target not in MARKERS:
        node = node.prev
    return node if node.target is predispatch.lazy_load_decompositions else None


def _rewrite(graph: fx.Graph, body: list[fx.Node]) -> None:
    # (each node's uses are replaced as it is rewritten, so later nodes' arguments are the physical tensors)
    info: dict[fx.Node, Physical] = {}
    replaced: dict[fx.Node, fx.Node] = {}
    markers = [n for n in body if n.target in MARKERS]
    loader = _loader_of(body[0])
    if loader is not None:
        markers.append(loader)
    for node in body:
        if node.target in MARKERS:
            continue
        with graph.inserting_before(node):
            if node.target is predispatch._add_batch_dim:
                new, made = _added_batch_dim(graph, node, info)
            elif node.target is predispatch._remove_batch_dim:
                new, made = _removed_batch_dim(graph, node, info)
            elif any(a in info for a in node.all_input_nodes):
                new, made = _physical_op(graph, node, info)
            else:
                continue
        if made is not None:
            info[new] = made
        _propagate(new, node)
        node.replace_all_uses_with(new)
        replaced[node] = new
    for node in reversed(list(replaced) + markers):
        graph.erase_node(node)


def _added_batch_dim(graph: fx.Graph, node: fx.Node, info: dict):
    """_add_batch_dim(x, in_dim, level): x's dim in_dim (of its logical dims) moves in after x's own levels."""
    x, in_dim, level = node.args
    outer = info.get(x, Physical((), _rank_of(x)))
    at = len(outer.levels)
    return (graph.call_function(torch.movedim, (x, at + in_dim % outer.rank, at)),
            Physical(outer.levels + (level,), outer.rank - 1))


def _removed_batch_dim(graph: fx.Graph, node: fx.Node, info: dict):
    """_remove_batch_dim(y, level, size, out_dim): y's innermost level dim moves to logical dim out_dim."""
    y, _, _, out_dim = node.args
    inner = info[y]
    at = len(inner.levels) - 1
    moved = graph.call_function(torch.movedim, (y, at, at + out_dim % (inner.rank + 1)))
    return moved, (Physical(inner.levels[:-1], inner.rank + 1) if inner.levels[:-1] else None)


def _aligned(graph: fx.Graph, a, info: dict, levels: tuple, rank: int):
    """A batched operand with a dim for each of `levels` (size 1 where it is not batched there) and `rank`
    logical dims (size-1 dims in front of its own); anything else as it is (it broadcasts from the right)."""
    if not isinstance(a, fx.Node) or a not in info:
        return a
    p, mine = a, info[a]
    for k, level in enumerate(levels):
        if level not in mine.levels:
            p = _emit(graph, torch.unsqueeze, p, k)
    for _ in range(rank - mine.rank):
        p = _emit(graph, torch.unsqueeze, p, len(levels))
    return p


def _emit(graph: fx.Graph, fn, *args) -> fx.Node:
    made = graph.call_function(fn, args)
    _propagate(made)
    return made


def _physical_op(graph: fx.Graph, node: fx.Node, info: dict):
    """`node` on the physical tensors: batched operands aligned to one set of levels and one logical rank, dims
    shifted past the levels."""
    name, value = _op_name(node), node.meta.get("example_value")
    out_rank = (value if isinstance(value, torch.Tensor) else value[0]).dim()
    levels = tuple(sorted(set().union(*(info[a].levels for a in node.all_input_nodes if a in info))))
    made = Physical(levels, out_rank)
    if node.target is operator.getitem and _op_name(node.args[0]) in SEVERAL_RESULTS:  # one of an op's results
        return _call_like(graph, node, node.args, node.kwargs), made
    if node.target is operator.getitem or name in VIEWS:
        view = "getitem" if node.target is operator.getitem else name
        args = VIEWS[view](node, len(info[node.args[0]].levels))
        if view == "view":  # the physical tensor may not be contiguous (its batch dim moved to the front)
            return graph.call_method("reshape", args), made
        if view == "t":  # a matrix's transpose; a vector's or a scalar's is itself
            return (graph.call_method("transpose", (args[0], -2, -1)) if out_rank == 2 else args[0]), made
        return _call_like(graph, node, args, node.kwargs), made
    if name in SEVERAL_RESULTS:
        return _physical_several(graph, node, name, info), made
    if name == "linear" and set(node.all_input_nodes[1:]) & set(info):
        return _physical_linear(graph, node, info, levels), made
    if name in TRAILING:  # the physical input, the rest as it was
        return _call_like(graph, node, node.args, node.kwargs), made
    if name in ALONG_DIMS:
        source = node.args[0]
        dims = _physical_dims(node, info[source])
        if dims is None:  # a full reduction of a logical scalar is that scalar
            return source, made
        args, kwargs = (source, dims, *node.args[2:]), {k: v for k, v in node.kwargs.items() if k != "dim"}
        return _call_like(graph, node, args, kwargs), made
    top = max(info[a].rank if a in info else _rank_of(a) for a in node.all_input_nodes)
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda a: _aligned(graph, a, info, levels, top))
    return _call_like(graph, node, args, kwargs), made


def _physical_linear(graph: fx.Graph, node: fx.Node, info: dict, levels: tuple) -> fx.Node:
    """linear(x, w, b) with a batched weight or bias (an ensemble of models under vmap): x·wᵀ as a matrix
    product whose leading dims broadcast, then + b aligned to the output's levels and logical rank."""
    x, weight = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs["weight"]
    bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
    in_rank = info[x].rank if x in info else _rank_of(x)
    if weight in info:
        weight = _aligned(graph, weight, info, levels, in_rank)
    out = _emit(graph, torch.matmul, _aligned(graph, x, info, levels, in_rank),
                _emit(graph, torch.transpose, weight, -1, -2))
    if bias is None:
        return out
    return _emit(graph, operator.add, out, _aligned(graph, bias, info, levels, in_rank))


def _physical_several(graph: fx.Graph, node: fx.Node, name: str, info: dict) -> fx.Node:
    """An op with several results on the physical tensor: a non-negative dim moves past the levels."""
    source, dim = node.args[0], _several_results_dim(node, name)
    shift = len(info[source].levels)
    physical = dim if dim < 0 else dim + shift
    at = SEVERAL_RESULTS[name]
    if at is not None and len(node.args) > at:
        args, kwargs = (*node.args[:at], physical, *node.args[at + 1:]), dict(node.kwargs)
    else:
        args, kwargs = node.args, {**node.kwargs, "dim": physical}
    return _call_like(graph, node, args, kwargs)


def _dim_argument(node: fx.Node):
    """The dim argument; None where the op reduces over every dim (torch takes dim=[] so too)."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    return None if isinstance(dim, (list, tuple)) and not dim else dim


def _physical_dims(node: fx.Node, source: Physical):
    """The physical dims of a reduction or normalisation (its `dim` argument, else every logical dim)."""
    dim, shift = _dim_argument(node), len(source.levels)
    if dim is None:
        return tuple(range(shift, shift + source.rank)) or None
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    shifted = tuple(d % max(source.rank, 1) + shift for d in dims)
    return shifted[0] if isinstance(dim, int) else shifted


def _rank_of(node: fx.Node) -> int:
    value = node.meta.get("example_value")
    return value.dim() if isinstance(value, torch.Tensor) else 0


def _call_like(graph: fx.Graph, node: fx.Node, args, kwargs) -> fx.Node:
    if node.op == "call_method":
        return graph.call_method(node.target, args, kwargs)
    return graph.call_function(node.target, args, kwargs)


def _propagate(new: fx.Node, old: fx.Node | None = None) -> None:
    """`new`'s example value, computed under the graph's fake mode from its inputs' (later passes read it)."""
    if old is not None:
        new.meta.update({k: v for k, v in old.meta.items() if k != "example_value"})
    args = fx.map_arg(new.args, lambda n: n.meta.get("example_value"))
    kwargs = fx.map_arg(new.kwargs, lambda n: n.meta.get("example_value"))
    fakes = []
    fx.node.map_aggregate((args, kwargs), lambda v: fakes.append(v) if isinstance(v, FakeTensor) else None)
    if not fakes:
        return
    mode = fakes[0].fake_mode
    with mode:
        fn = getattr(torch.Tensor, new.target) if new.op == "call_method" else new.target
        new.meta["example_value"] = fn(*args, **kwargs)


# ---------------------------------------------------------------- views of a batched tensor

def _shifted(d: int, shift: int) -> int:
    """A logical dim on the physical tensor: one counted from the end stays, the levels come before the others."""
    return d if d < 0 else d + shift


def _sizes(args: tuple) -> tuple:
    """view(2, 3) and view((2, 3)) alike."""
    return tuple(args[0]) if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else tuple(args)


def _batch_sizes(node: fx.Node, shift: int) -> tuple:
    return tuple(node.args[0].meta["example_value"].shape[:shift])


def _basic_key(key) -> bool:
    keys = key if isinstance(key, tuple) else (key,)
    return all(k is None or k is Ellipsis or isinstance(k, (int, slice)) for k in keys)


# each takes the node and the number of level dims in front of its (batched) first argument, and gives the args of
# the same op on the physical tensor
VIEWS = {
    "getitem": lambda n, s: (n.args[0], (slice(None),) * s + (n.args[1] if isinstance(n.args[1], tuple)
                                                              else (n.args[1],))),
    "unsqueeze": lambda n, s: (n.args[0], _shifted(n.args[1], s)),
    "squeeze": lambda n, s: (n.args[0], tuple(_shifted(d, s) for d in (
        n.args[1] if isinstance(n.args[1], (tuple, list)) else (n.args[1],)))),
    "transpose": lambda n, s: (n.args[0], _shifted(n.args[1], s), _shifted(n.args[2], s)),
    "swapaxes": lambda n, s: (n.args[0], _shifted(n.args[1], s), _shifted(n.args[2], s)),
    "narrow": lambda n, s: (n.args[0], _shifted(n.args[1], s), *n.args[2:]),
    "select": lambda n, s: (n.args[0], _shifted(n.args[1], s), *n.args[2:]),
    "flatten": lambda n, s: (n.args[0], _shifted(n.args[1] if len(n.args) > 1 else 0, s),
                             _shifted(n.args[2] if len(n.args) > 2 else -1, s)),
    "permute": lambda n, s: (n.args[0], (*range(s), *(d % max(_rank_of(n.args[0]) - s, 1) + s
                                                      for d in _sizes(n.args[1:])))),
    "reshape": lambda n, s: (n.args[0], (*_batch_sizes(n, s), *_sizes(n.args[1:]))),
    "view": lambda n, s: (n.args[0], (*_batch_sizes(n, s), *_sizes(n.args[1:]))),
    "expand": lambda n, s: (n.args[0], (*(-1,) * s, *_sizes(n.args[1:]))),
    "t": lambda n, s: (n.args[0],),
}


def _view_refusal(node: fx.Node, name: str, levels: dict) -> str | None:
    """Views take a batched tensor first and nothing batched after; their dims are given (flatten's may default),
    their keys basic (ints, slices, None, an ellipsis)."""
    if node.args[0] not in levels or set(node.all_input_nodes[1:]) & set(levels) or node.kwargs:
        return f"{describe_target(node)} of other than a batched tensor by plain arguments in the body"
    if name == "getitem" and not _basic_key(node.args[1]):
        return f"{node.name} indexes a batched value by tensors in the body"
    if name == "squeeze" and len(node.args) < 2:
        return f"{describe_target(node)} with no dim in the body"
    if name in ("transpose", "swapaxes", "narrow", "select", "unsqueeze") and len(node.args) < 2:
        return f"{describe_target(node)} with no dim in the body"
    if name == "expand" and len(_sizes(node.args[1:])) != _rank_of(node.args[0]):  # (a batched value's logical rank)
        return f"{describe_target(node)} to more dims in the body"
    return None
