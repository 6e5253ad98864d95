"""Scatters stored by the kernel that makes their values: out[dst[e], f] += msg[e, f] as atomic adds.

A graph network's message passing gathers features along edges, computes a message per edge and sums
(or takes the maximum of) the messages into each edge's target. The gathers and the message are
elementwise work that a generated kernel does in one pass; the scatter used to run after it through
torch, which read the stored messages back (index_add_). Here the kernel that computes a message
stores it where the scatter would put it, with an atomic add (maximum, minimum) into the scatter's
output, which starts at the reduction's identity: the messages never reach memory.

Legality: the scatter reads one value of the kernel over all of its loop variables, in that value's
own iteration space (a plain read; a value that others read too is stored as well), and the positions
it scatters to were stored before the kernel runs (an index computed in the same kernel is not in
memory yet). The value may be per element or per row (a sum over features, GAT's edge scores): every
config stores each of them once (a row's once its split pieces met), so each lands once. Atomic float
adds land in any order, as torch's index_add_ on CUDA; in deterministic mode
(torch.use_deterministic_algorithms) the scatter stays with torch, whose interpreter path sorts the
indices.
"""

from __future__ import annotations

import dataclasses

import torch

from ...ir.expr import Access, Read
from ...ir.graph import Graph, Node, Region
from ...ir.index import IndexExpr, Var, gathered_tensors, rename
from .emit import TL_DTYPE, Scope, Val, is_literal, spread_address, to_dtype

# the reductions Triton has an atomic for, and the dtypes whose atomics both Triton and its interpreter take
ATOMICS = {"sum": "tl.atomic_add", "max": "tl.atomic_max", "min": "tl.atomic_min"}
ATOMIC_DTYPES = (torch.float32, torch.int32, torch.int64)


def scatter_refusal(graph: Graph, scatter: Node) -> str | None:
    """Why `scatter` cannot be stored atomically by the kernel of its value (None: it can), apart from
    where that value is computed."""
    if scatter.reduce not in ATOMICS:
        return f"no atomic {scatter.reduce} in Triton"
    if graph.type_of[scatter.name].dtype not in ATOMIC_DTYPES:
        return f"atomics on {graph.type_of[scatter.name].dtype} are not generated"
    if torch.are_deterministic_algorithms_enabled():
        return "deterministic algorithms asked for: atomics land in any order"
    if not reads_a_message(graph, scatter):
        return "its body is not a plain read of one node's value over all its variables"
    return None


def reads_a_message(graph: Graph, scatter: Node) -> bool:
    """Is the scatter's body a plain read, over all its variables, of another node's value (its message)?"""
    body = scatter.body
    return (isinstance(body, Read) and body.access.is_plain and body.access.vars == set(scatter.extents)
            and body.access.tensor in graph.node_of)


def split_scatter_bodies(graph: Graph, region: Region) -> tuple[Graph, Region]:
    """Each scatter of the region whose body is more than a plain read of a node's value gets its body as a
    node of its own (the message, just before it), which joins a generated kernel; the scatter then reads
    it plainly and may be stored by that kernel."""
    nodes, types, order = [], dict(graph.types), []
    inside = set(region.nodes)
    for node in graph.nodes:
        # (a read of an input, or of a value broadcast over some variables, gets a message node too)
        if node.name not in inside or not node.is_scatter or node.reduce not in ATOMICS or reads_a_message(graph, node):
            nodes.append(node)
            continue
        variables = tuple(Var(v) for v, _ in node.dims)
        message = f"{node.name}_message"
        types[message] = dataclasses.replace(graph.type_of[node.name], shape=tuple(n for _, n in node.dims))
        nodes.append(Node(message, variables, node.body, node.dims, origin=node.origin, group=node.group))
        nodes.append(dataclasses.replace(node, body=Read(Access(message, variables))))
        order.append(node.name)
    if not order:
        return graph, region
    names = [m for name in region.nodes for m in ((f"{name}_message", name) if name in order else (name,))]
    graph = dataclasses.replace(graph, nodes=tuple(nodes), types=tuple(types.items()))
    return graph, dataclasses.replace(region, nodes=tuple(names))


def index_in(scatter: Node, value: Node) -> tuple[IndexExpr, ...]:
    """The scatter's output index in the variables of the node whose value it reads."""
    names = {read.name: own.name for read, own in zip(scatter.body.access.indices, value.index)}
    return tuple(rename(i, names) for i in scatter.index)


def attach_scatters(graph: Graph, steps: list) -> list:
    """Steps with each scatter that a kernel step can store taken into that step's plan of its value:
    ("torch", [scatter], why) steps go, their plans gain (value, scatter) in `scatters`; a scatter that stays
    says why in its step's reason."""
    made_by = {}  # value -> (step index, plan index)
    step_of = {}  # node -> the step that computes it
    for k, (kind, nodes, extra) in enumerate(steps):
        step_of.update({n.name: k for n in nodes})
        if kind == "kernel":
            for p, plan in enumerate(extra):
                for name in plan.outputs:
                    made_by[name] = (k, p)
    taken, steps = set(), [list(s) for s in steps]
    for k, (kind, nodes, reason) in enumerate(steps):
        scatter = nodes[0]
        if kind != "torch" or not scatter.is_scatter:
            continue
        why = scatter_refusal(graph, scatter) or _unattachable(graph, scatter, made_by, step_of, steps)
        if why:
            steps[k][2] = f"{reason}: {why}"
            continue
        value = scatter.body.access.tensor
        at, p = made_by[value]
        plans = list(steps[at][2])
        plans[p] = dataclasses.replace(plans[p], scatters=(*plans[p].scatters, (value, scatter)))
        steps[at][2] = plans
        taken.add(k)
    for step in steps:  # a value that only its scatters read is not stored itself
        if step[0] == "kernel":
            step[2] = [dataclasses.replace(plan, scatter_only=_scatter_only(graph, plan)) for plan in step[2]]
    return [tuple(s) for k, s in enumerate(steps) if k not in taken]


def _scatter_only(graph: Graph, plan) -> frozenset:
    mine = {scatter.name for _, scatter in plan.scatters}
    return frozenset(v for v, _ in plan.scatters if v not in graph.outputs and set(graph.consumers[v]) <= mine)


def _unattachable(graph: Graph, scatter: Node, made_by: dict, step_of: dict, steps: list) -> str | None:
    """Why no kernel step can store `scatter` (None: the one that makes its message can)."""
    value = scatter.body.access.tensor
    if value not in made_by:
        return f"its message {value} is not made by a generated kernel"
    at, p = made_by[value]
    # the kernel loads the positions from memory: an earlier step must have stored them
    if any(step_of.get(t, -1) >= at for i in scatter.index for t in gathered_tensors(i)):
        return "its positions are computed in the kernel of its message"
    if not all(isinstance(i, Var) for i in graph.node_of[value].index):
        return f"its message {value} is stored through index arithmetic"
    return None


def part_nodes(plan) -> tuple:
    """The part's nodes and the scatters it stores (whose indices read tensors of their own)."""
    return (*plan.nodes, *(scatter for _, scatter in plan.scatters))


def stored(plan) -> tuple[str, ...]:
    """What a part writes: its outputs but those only scatters read, then the scatters' outputs."""
    return (*(o for o in plan.outputs if o not in plan.scatter_only), *(scatter.name for _, scatter in plan.scatters))


class ScatterStitching:
    """The part kernel's store of a message a scatter takes (mixed into codegen.PartKernel)."""

    def store_scattered(self, scatter, value: Val, scope: Scope) -> None:
        """The value combined atomically into the scatter's output where the scatter puts it (scatter_stores);
        a position out of the output's range is dropped, as a masked lane."""
        value_node = self.nodes[scatter.body.access.tensor]
        checks: list = []
        off = self.body.offset(scatter.name, index_in(scatter, value_node), value_node, scope, checks)
        off = spread_address(off, value)  # every lane adds its own value
        dtype = self.graph.type_of[scatter.name].dtype
        # the value and the mask made as wide as the addresses by arithmetic: Triton's interpreter lands a
        # broadcast [1, 1] value or mask (tl.broadcast_to's too) on the first address of a [1, n] block only
        shape = f"[{self.cfg.BP if 'p' in off.deps else 1}, {self.cfg.BL if 'l' in off.deps else 1}]"
        code = value.code if is_literal(value) else to_dtype(value.code, dtype, self.interpret)
        code = f"({code} + tl.zeros({shape}, {TL_DTYPE[dtype]}))"
        mask = " & ".join(filter(None, [self.mask(off.deps, scope), *checks]))
        mask = f"({mask}) & tl.full({shape}, 1, tl.int1)" if mask else ""
        address = off.code if off.deps else f"({off.code} + tl.zeros({shape}, tl.int32))"  # a block, as the value:
        # compiled Triton refuses a scalar pointer with a [1, 1] value (one element of one edge, say)
        self.src.emit(f"{ATOMICS[scatter.reduce]}({self.arg[scatter.name]} + {address}, {code}"
                      f"{', mask=' + mask if mask else ''}, sem='relaxed')")
