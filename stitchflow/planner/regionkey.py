"""Structural keys of fusion regions, so that regions equal up to renaming share one estimate.

The repeated layers of a model (GPT-3's 12 decoders) give the planner many regions that are
the same region with other node and tensor names; the static estimate (cost.estimate_region)
of such regions is the same up to those names, and computing it dominates planning. A region's
key holds everything the estimate reads, with names replaced by positions:

- per node, in the order given: its template (index, body, dims and reduction, every tensor
  it reads replaced by its input slot; built once per node), where each slot comes from (a
  producer's position in the region, or the k-th distinct tensor read from outside it), its
  result's type and densities (stream and stored), and whether it escapes the region (a graph
  output or read outside it: the region writes it to memory);
- per tensor read from outside: its type and its density as read from memory;
- the permutation that puts the nodes in graph order (prepare() sorts them so; unify() and
  legal_orders() walk them in the order given);
- the permutation that sorts the node names: unified variables are labelled `var@node`
  (loopnest.unify) and legal_orders breaks ties and RegionVars sorts its extents by those
  labels. Variable names are in the templates, so with the same order of node names every
  such comparison comes out the same in two regions with one key.

Only what the density model, the options and the cost model fix for a whole plan (Costs holds
one graph, model and options) is left out of the key. `renamed` maps a cached estimate to the
names of the region asked about.

The estimate adds a few terms in the iteration order of sets of names (a region's members in
_traffic, a node's consumers in prepare), which follows the names' hashes; where those terms
are not integers, a shared estimate may differ from a fresh one in the last bit, as two runs of
the planner (string hashes are seeded per process) may already.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from ..ir.expr import Call, Cast, Const, IndexValue, Read
from ..ir.graph import Graph, Node
from ..ir.index import Div, Gather, Lit, Mod, Sum, Var
from .cost import Estimate
from .loopnest import LoopNest, NodeNest

Density = Callable[[str, bool], float]  # (tensor, read inside the region) -> density, as cost._Context


def _index_shape(e, slot: dict[str, int]) -> tuple:
    if isinstance(e, Var):
        return ("v", e.name)
    if isinstance(e, Lit):
        return ("l", e.value)
    if isinstance(e, Sum):
        return ("s", tuple((c, _index_shape(a, slot)) for c, a in e.terms), e.const)
    if isinstance(e, Div):
        return ("d", _index_shape(e.arg, slot), e.divisor)
    if isinstance(e, Mod):
        return ("m", _index_shape(e.arg, slot), e.modulus)
    if isinstance(e, Gather):
        return ("g", slot[e.tensor], tuple(_index_shape(i, slot) for i in e.indices))
    raise TypeError(f"unknown index expression {e!r}")


def _body_shape(e, slot: dict[str, int]) -> tuple:
    if isinstance(e, Read):
        return ("r", slot[e.access.tensor], tuple(_index_shape(i, slot) for i in e.access.indices))
    if isinstance(e, Const):  # the type too: 1, 1.0 and True are equal as Python values
        return ("c", type(e.value).__name__, e.value)
    if isinstance(e, Call):
        return ("f", e.op, tuple(_body_shape(a, slot) for a in e.args))
    if isinstance(e, Cast):
        return ("t", e.dtype, _body_shape(e.arg, slot))
    if isinstance(e, IndexValue):
        return ("i", _index_shape(e.index, slot))
    raise TypeError(f"unknown expression {e!r}")


def node_template(node: Node) -> tuple:
    """The node without its names: tensors it reads become slots of `node.inputs`."""
    slot = {t: k for k, t in enumerate(node.inputs)}
    return (tuple(_index_shape(i, slot) for i in node.index), _body_shape(node.body, slot), node.dims, node.reduce)


# template or description -> small id, shared by every RegionKeys of the process, so that keys hash ints, not
# bodies, and regions of different graphs (a model's partitions between eager ops) compare too. Never cleared:
# an id must keep its meaning while any key holds it (one entry per distinct node template, type and density)
_IDS: dict[tuple, int] = {}


class RegionKeys:
    """Structural keys of regions of one graph under one density model (`density` as the
    estimate reads it: a node's stream inside a region, a tensor's storage from memory).
    Keys number templates and descriptions in one table for the process, so the keys of two
    graphs' regions are equal where the regions are equal up to names."""

    def __init__(self, graph: Graph, density: Density):
        self.graph = graph
        self.density = density
        self.position = {n.name: k for k, n in enumerate(graph.nodes)}
        self._nodes: dict[str, tuple] = {}
        self._outside: dict[str, int] = {}

    @staticmethod
    def _intern(value: tuple) -> int:
        return _IDS.setdefault(value, len(_IDS))

    def _node(self, name: str) -> tuple:
        """(template id, inputs, id of its result's description, is a graph output, consumers)
        of a node, computed once."""
        hit = self._nodes.get(name)
        if hit is None:
            node = self.graph.node_of[name]
            tid = self._intern(("node", node_template(node)))
            own = self._intern(("own", self.graph.type_of[name], self.density(name, True), self.density(name, False)))
            escapes = name in self.graph.outputs
            hit = self._nodes[name] = (tid, node.inputs, own, escapes, self.graph.consumers.get(name, ()))
        return hit

    def _read(self, tensor: str) -> int:
        """A tensor read from outside the region: what stored_bytes, the gating densities and
        the order constraints read of it (its type and its density in memory)."""
        hit = self._outside.get(tensor)
        if hit is None:
            hit = self._outside[tensor] = self._intern(("read", self.graph.type_of.get(tensor),
                                                        self.density(tensor, False)))
        return hit

    def key(self, nodes: Sequence[str]) -> tuple:
        at = {name: k for k, name in enumerate(nodes)}
        outside: dict[str, int] = {}
        rows = []
        for name in nodes:
            tid, inputs, own, escapes, users = self._node(name)
            # a producer in the region by its position, an outside tensor as ~(its first-read rank)
            refs = tuple(at[t] if t in at else ~outside.setdefault(t, len(outside)) for t in inputs)
            escapes = escapes or any(c not in at for c in users)
            rows.append((tid, refs, own, escapes))
        reads = tuple(self._read(t) for t in outside)
        in_graph_order = tuple(sorted(range(len(nodes)), key=lambda k: self.position[nodes[k]]))
        by_name = tuple(sorted(range(len(nodes)), key=nodes.__getitem__))
        return tuple(rows), reads, in_graph_order, by_name

    def renamed(self, est: Estimate, nodes: Sequence[str]) -> Estimate:
        """`est` (of a region with the same key) for the region `nodes`, given in the same order."""
        if est.nodes == tuple(nodes):
            return est
        node = dict(zip(est.nodes, nodes))
        var = {f"{v}@{old}": f"{v}@{new}" for old, new in node.items() for v, _ in self.graph.node_of[new].dims}
        return replace(est, nodes=tuple(nodes), loop=_renamed_loop(est.loop, node, var))


def _renamed_loop(loop: LoopNest | None, node: dict, var: dict) -> LoopNest | None:
    if loop is None:
        return None
    nests = tuple(NodeNest(node[n.node], frozenset(var[u] for u in n.vars), tuple(var[u] for u in n.recompute_vars),
                           n.factor) for n in loop.nests)
    # unify() sorts the extents by label: sort again under the new labels
    extents = tuple(sorted((var[u], e) for u, e in loop.extents))
    return LoopNest(tuple(var[u] for u in loop.order), nests, loop.concordant, extents)
