"""How the backend cuts Dynamo's (or AOTAutograd's) graph into partitions: which nodes have a lowering, grouped by
data dependence (torch.fx's CapabilityBasedPartitioner) or, where the graph writes in place or draws random
numbers, in program order; and which of a partition's results eager ops read."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.split_module import split_module

from .backend_layouts import restrided
from .backend_vmap import unbatch_vmap_bodies
from .frontend.registry import HOST_QUERIES, LOWERINGS, early_refusal, is_inplace, key_of

REFUSED = "stitchflow_refused"  # node.meta key: why capture refused the node (it runs eagerly, the rest is split again)


BATCHED_BY_VMAP = ("works on a value batched by torch.vmap: functorch's batched tensors have no storage of their "
                   "own to compile against")


def refuse_vmap_bodies(gm: fx.GraphModule) -> None:
    """Rewrite the torch.vmap bodies that Dynamo inlined as ops on whole tensors where they allow it
    (backend_vmap), and leave to eager the nodes of the others (their example values are functorch's batched
    tensors: a program captured on them fails on its first call)."""
    kept = unbatch_vmap_bodies(gm)
    for node in gm.graph.nodes:
        value = node.meta.get("example_value")
        values = value if isinstance(value, (tuple, list)) else (value,)
        if any(isinstance(v, torch.Tensor) and torch._C._functorch.is_batchedtensor(v) for v in values):
            why = f" (the body was not rewritten on whole tensors: {kept[node]})" if node in kept else ""
            node.meta.setdefault(REFUSED, BATCHED_BY_VMAP + why)


EMPTY_VALUE = "makes or reads a tensor with no elements (the IR has no zero-size tensors); cheap eagerly"


def _example_tensors(node: fx.Node) -> list:
    value = node.meta.get("example_value", node.meta.get("val"))  # Dynamo's graphs, AOTAutograd's
    values = value if isinstance(value, (tuple, list)) else (value,)
    return [v for v in values if isinstance(v, torch.Tensor)]


def fold_empty_values(gm: fx.GraphModule, saved_from: int | None = None) -> None:
    """Fold to constants the values with no elements: they hold no data, so their shape, strides and dtype are
    all of them (transformers' Mamba scan splits at the sequence length and works on the empty tail). Capture
    keeps a constant with no elements as a plain value, and torch.cat skips it. Left to eager, and refused up
    front with every node that reads them (a program cannot take an input with no elements): a node with several
    results some of which are empty and read, and a value the caller receives (a constant would be the same tensor
    every call; AOTAutograd's saved activations, the forward's outputs from `saved_from`, do fold). All at once:
    capture would refuse them one at a time, each refusal splitting the partition again."""
    for node in list(gm.graph.nodes):
        if node.op in ("call_function", "call_method") and _makes_empty(node):
            _fold_empty(gm, node, saved_from)
    empty = set()
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        made = _makes_empty(node) and not _only_unread_items_empty(node)
        if made:
            empty.add(node)
        if made or any(a in empty for a in node.all_input_nodes):
            node.meta.setdefault(REFUSED, EMPTY_VALUE)


def _returned_to_the_caller(node: fx.Node, saved_from: int | None) -> bool:
    output = next((u for u in node.users if u.op == "output"), None)
    if output is None:
        return False
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    return saved_from is None or any(r is node for r in results[:saved_from])


def _makes_empty(node: fx.Node) -> bool:
    return any(v.numel() == 0 for v in _example_tensors(node) if not _symbolic(v))


def _only_unread_items_empty(node: fx.Node) -> bool:
    """A split whose pieces with no elements nothing reads (they were folded): capture can take it."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, (tuple, list)):
        return False
    read = {u.args[1] for u in node.users if u.target is operator.getitem}
    if len(read) != len(node.users):
        return False
    return all(isinstance(v, torch.Tensor) and v.numel() for k, v in enumerate(value) if k in read)


def _fold_empty(gm: fx.GraphModule, node: fx.Node, saved_from: int | None) -> None:
    """Replace `node`, whose one result has no elements, by a constant of its shape, strides and dtype, unless
    the caller receives it."""
    value = node.meta.get("example_value", node.meta.get("val"))
    if not isinstance(value, torch.Tensor) or _returned_to_the_caller(node, saved_from):
        return
    name = f"_stitchflow_empty_{node.name}"
    with unset_fake_temporarily():  # (AOTAutograd calls the backend under its fake mode)
        constant = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
    gm.register_buffer(name, constant, persistent=False)
    with gm.graph.inserting_before(node):
        constant = gm.graph.get_attr(name)
    constant.meta = dict(node.meta)
    node.replace_all_uses_with(constant)
    if is_inplace(node):  # writes nothing, but runs as written (eagerly)
        node.meta.setdefault(REFUSED, EMPTY_VALUE)
    else:
        gm.graph.erase_node(node)


def _symbolic(value: torch.Tensor) -> bool:
    return any(not isinstance(d, int) for d in value.shape)


def supported(node: fx.Node) -> bool:
    """Has a lowering (creation ops such as torch.ones stay eager and enter as inputs). An item of
    an eager op's tuple of results stays with that op, so that partitions take tensors, not tuples."""
    if node.op not in ("call_function", "call_method") or REFUSED in node.meta:
        return False
    source = node.args[0] if node.target is operator.getitem and node.args else None
    if isinstance(source, fx.Node) and source.op in ("call_function", "call_method") and not supported(source):
        return False
    if node.target in HOST_QUERIES:  # capture folds the device's answer
        return True
    return key_of(node) in LOWERINGS and early_refusal(node) is None


def partition_ids(gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Maximal runs of consecutive supported nodes share a partition; every unsupported node
    is a partition of its own. Runs in program order can never depend on each other cyclically."""
    ids, current, supported_run = {}, 0, False
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        ok = supported(node) or node.op == "get_attr"
        if not (ok and supported_run):
            current += 1
        ids[node] = current
        supported_run = ok
    return ids


_RANDOM_WORDS = ("rand", "dropout", "bernoulli", "multinomial", "normal", "poisson", "exponential", "geometric")


def _order_matters(node: fx.Node) -> bool:
    """A node that writes a tensor in place or draws random numbers: moving another node across it
    could change a value (a read before a write) or which random numbers a call gets."""
    if node.op not in ("call_function", "call_method"):
        return False
    name = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", "")
    return is_inplace(node) or any(word in name.lower() for word in _RANDOM_WORDS) or node.is_impure()


class _Lowerable(OperatorSupportBase):
    def is_node_supported(self, submodules, node: fx.Node) -> bool:
        return supported(node)


def fuse_by_dependence(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]] | None:
    """The supported nodes grouped by data dependence rather than program order (torch.fx's
    CapabilityBasedPartitioner: a partition grows over any supported node it can take without a
    cycle through an eager one), so an eager op splits only what depends on it, e.g.
    `y = x.relu(); s = torch.i0(x); z = y.softmax(-1) + s` is one partition after the i0, not two
    around it. None where the graph writes in place or draws random numbers: there program order is
    kept (partition_ids). Returns a copy of the graph with each partition a submodule, and their names."""
    if any(_order_matters(n) or _indexed_by_an_eager_tensor(n) for n in gm.graph.nodes):
        return None
    copy = fx.GraphModule(gm, copied_graph(gm.graph))  # the user's graph stays whole for the fallback
    _tensor_indexing_as_methods(copy.graph)
    partitioner = CapabilityBasedPartitioner(copy, _Lowerable(), allows_single_node_partition=True)
    fused = partitioner.fuse_partitions(partitioner.propose_partitions(), prefix="stitchflow_")
    names = [n.target for n in fused.graph.nodes if n.op == "call_module" and n.target.startswith("stitchflow_")]
    return fused, names


def _tensor_indexing_as_methods(graph: fx.Graph) -> None:
    """x[idx] as x.__getitem__(idx) where x is a tensor. torch.fx's partitioner takes any node all of whose users
    are operator.getitem calls for a tuple and moves those calls into that node's partition: a graph input used
    only as an index (a GAT's edge list, h[src] and h[dst]) has none, so x[src] left its partition while x and
    the readers of x[src] stayed: a dependency cycle, and the whole graph ran eagerly. A tuple's items stay
    operator.getitem, with their producer."""
    for node in graph.nodes:
        value = node.args[0].meta.get("val", node.args[0].meta.get("example_value")) \
            if node.target is operator.getitem and isinstance(node.args[0], fx.Node) else None
        if isinstance(value, torch.Tensor):
            node.op, node.target = "call_method", "__getitem__"


def _indexed_by_an_eager_tensor(node: fx.Node) -> bool:
    """y[torch.tensor([0, 2])]: torch.fx's partitioner takes an operator.getitem for a tuple's item and
    moves it to its producer's partition, here both the indexed tensor's (ours) and the index's (eager,
    no lowering), back and forth without end. Such a graph keeps program order."""
    if node.target is not operator.getitem or not isinstance(node.args[0], fx.Node):
        return False
    index = []
    fx.node.map_arg(node.args[1:], index.append)
    return any(i.op in ("call_function", "call_method") and not supported(i) for i in index)


def copied_graph(graph: fx.Graph) -> fx.Graph:
    new = fx.Graph()
    out = new.graph_copy(graph, {})
    new.output(out)
    return new


def split_in_program_order(gm: fx.GraphModule) -> tuple[fx.GraphModule, list[str]]:
    ids = partition_ids(gm)
    supported_ids = {ids[n] for n in ids if supported(n)}
    split = split_module(gm, gm, lambda node: ids[node], keep_original_order=True)
    names = [n.target for n in split.graph.nodes
             if n.op == "call_module" and int(n.target.removeprefix("submod_")) in supported_ids]
    return split, names


def outputs_read_eagerly(node: fx.Node, partitions: set, outputs_too: bool) -> frozenset:
    """Which results of a partition's call an eager node reads: positions of a tuple (through its
    getitems), None for the call's single value."""
    def eager(user: fx.Node) -> bool:
        if user.op == "output":
            return outputs_too
        return not (user.op == "call_module" and user.target in partitions)

    positions = set()
    for user in node.users:
        if user.op == "call_function" and user.target is operator.getitem:
            if any(eager(u) for u in user.users):
                positions.add(user.args[1])
        elif eager(user):
            positions.add(None)
    return frozenset(positions)


def inline_empty_constants(split: fx.GraphModule, names) -> None:
    """Each partition in `names` reads a constant with no elements (a cache's `torch.tensor([])`, which AOTAutograd
    lifts to a get_attr of the outer graph and split_module hands to the partition as an input) from an attribute of
    its own: capture keeps such a constant as a plain value (torch.cat skips it), where an input with no elements
    could not be an argument of a program."""
    for call in [n for n in split.graph.nodes if n.op == "call_module" and n.target in names]:
        sub = split.get_submodule(call.target)
        placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
        if len(placeholders) != len(call.args) or call.kwargs:
            continue
        keep = []
        for arg, ph in zip(call.args, placeholders):
            value = _attribute(split, arg)
            if not isinstance(value, torch.Tensor) or value.numel():
                keep.append(arg)
                continue
            sub.register_buffer(f"_empty_{ph.name}", value, persistent=False)
            with sub.graph.inserting_before(ph):  # (a fused partition's placeholders come among its nodes)
                constant = sub.graph.get_attr(f"_empty_{ph.name}")
            constant.meta = dict(ph.meta)
            ph.replace_all_uses_with(constant)
            sub.graph.erase_node(ph)
        if len(keep) != len(call.args):
            call.args = tuple(keep)
            sub.recompile()
    split.recompile()


def _attribute(gm: fx.GraphModule, arg):
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return None
    value = gm
    for part in arg.target.split("."):
        value = getattr(value, part, None)
    return value


def run_flat(split: fx.GraphModule, args) -> Any:
    """Run `split` (a graph split around refused nodes) one node at a time. A partition whose capture refuses a
    node splits around it in turn (its `split_or_run`); that split's nodes take the partition's place in `split`
    (inline_call) and this loop goes on through them. Calls thus never nest: a chain of refusals found one at a
    time (one per capture) once nested one call level per refusal, deep enough for a RecursionError."""
    env: dict[fx.Node, Any] = {}
    ran: set[fx.Node] = set()
    inputs = iter(args)
    node = next(iter(split.graph.nodes))
    while node.op != "output":
        if node.op == "placeholder":
            env[node] = next(inputs)
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            part = split.get_submodule(node.target) if node.op == "call_module" else None
            if hasattr(part, "split_or_run") and not kwargs:
                inner, value = part.split_or_run(args)
                if inner is not None and (first := inline_call(split, node, inner, part.traced_layouts())) is not None:
                    node = first
                    continue
                env[node] = part._eager(args, inner) if inner is not None else value
            else:
                env[node] = part(*args, **kwargs) if part is not None else _run_node(split, node, args, kwargs)
        ran.add(node)
        for a in node.all_input_nodes:  # free what no later node reads
            if a in env and all(u in ran for u in a.users):
                del env[a]
        node = node.next
    return fx.node.map_arg(node.args[0], env.__getitem__)


def _run_node(split: fx.GraphModule, node: fx.Node, args, kwargs) -> Any:
    if node.op == "call_function":
        return node.target(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    assert node.op == "get_attr", node.op
    return _attribute(split, node)


def inline_call(split: fx.GraphModule, call: fx.Node, inner: fx.GraphModule, layouts=None) -> fx.Node | None:
    """Put the nodes of `inner` (the graph a partition split into) in place of `call` (that partition's call in
    `split`), its submodules and attributes moved over under new names; returns the first node put in. None
    (nothing changed) where `call`'s value is read other than item by item. `layouts` (per input: the strides the
    partition was traced with, or None) puts each argument in its traced strides first, as the partition's own
    eager run does: another partition may hand it over channels last, where an eager op of `inner` refuses that."""
    placeholders = [n for n in inner.graph.nodes if n.op == "placeholder"]
    output = next(n for n in inner.graph.nodes if n.op == "output")
    tuple_value = isinstance(output.args[0], (tuple, list))
    if call.kwargs or len(placeholders) != len(call.args) or (
            tuple_value and any(u.target is not operator.getitem for u in call.users)):
        return None
    first = None
    with split.graph.inserting_before(call):
        env = dict(zip(placeholders, call.args))
        for p, s in zip(placeholders, layouts or ()):
            if s is not None:
                env[p] = split.graph.call_function(restrided, (env[p], s))
                first = first or env[p]
        for node in inner.graph.nodes:
            if node.op in ("placeholder", "output"):
                continue
            env[node] = new = split.graph.node_copy(node, env.__getitem__)
            if node.op in ("call_module", "get_attr"):
                value = inner.get_submodule(node.target) if node.op == "call_module" else _attribute(inner, node)
                new.target = _moved_attribute(split, f"{call.target}_{node.target}", value)
            first = first or new
    result = fx.node.map_arg(output.args[0], env.__getitem__)
    if tuple_value:
        for item in list(call.users):
            item.replace_all_uses_with(result[item.args[1]])
            split.graph.erase_node(item)
    else:
        call.replace_all_uses_with(result)
    split.graph.erase_node(call)
    split.recompile()
    return first


def _moved_attribute(gm: fx.GraphModule, name: str, value) -> str:
    name = base = name.replace(".", "_")
    k = 0
    while hasattr(gm, name):
        k, name = k + 1, f"{base}_{k + 1}"
    if isinstance(value, torch.nn.Module):
        gm.add_module(name, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(name, value, persistent=False)
    else:
        setattr(gm, name, value)
    return name
