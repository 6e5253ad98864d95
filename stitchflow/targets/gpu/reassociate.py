"""Sparse products reassociated: (S·X)·W becomes S·(X·W) where W narrows X's features.

A GCN layer written as (A·X)·W (FuseFlow's association, and the app zoo's default) gathers a row of X,
F_x wide, for every non-zero of A, then multiplies by W down to F_w. Computed as A·(X·W), the dense GEMM
runs first and the sparse product gathers rows F_w wide: on Cora F_x = 1433 and F_w = 16, a ninetieth of
the gathered bytes, and the narrow X·W (169K x 16 floats on an arxiv-sized graph: 11 MB) stays in L2 for
the gathers. The FLOPs of the GEMM are the same either way; the sparse product's fall by F_x / F_w.

The rewrite keeps the inner node's name for X·W (its type changes to [rows of X, F_w]), so the region
that holds both nodes runs them in the same places. It applies only when that node is read by nothing
else (no output, no other consumer), S is stored sparse and X dense (W may be either); the sums are then taken
in another order, as any GEMM's blocking does, so results differ from eager by rounding only.
"""

from __future__ import annotations

import dataclasses

from ...ir.expr import Access, Call, Read, call
from ...ir.graph import Graph, Node
from ...ir.index import Var
from ...ir.types import dense_type


@dataclasses.dataclass(frozen=True)
class Reassociation:
    inner: str     # S·X, becomes X·W under the same name
    outer: str     # (S·X)·W, becomes S·(X·W)
    sparse: str
    features: tuple[int, int]  # (F_x, F_w)

    def __str__(self) -> str:
        return (f"({self.sparse}·X)·W -> {self.sparse}·(X·W) at {self.inner}, {self.outer}: "
                f"gathers {self.features[1]} features instead of {self.features[0]}")


def plain_product(node: Node) -> tuple[Access, Access] | None:
    """The two reads of out[a, b] = sum_r x * y, both plain 2-D accesses."""
    body = node.body
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1 or len(node.out_vars) != 2:
        return None
    if not (isinstance(body, Call) and body.op == "mul" and all(isinstance(x, Read) for x in body.args)):
        return None
    reads = tuple(x.access for x in body.args)
    if not all(a.is_plain and len(a.indices) == 2 for a in reads):
        return None
    return reads


def find_reassociations(graph: Graph, names: set) -> list[Reassociation]:
    """Every (S·X)·W among `names` whose reassociation gathers fewer features."""
    found = []
    type_of, consumers = graph.type_of, graph.consumers
    for outer in graph.nodes:
        if outer.name not in names:
            continue
        reads = plain_product(outer)
        if reads is None:
            continue
        for p, w in (reads, reads[::-1]):
            inner = graph.node_of.get(p.tensor)
            if inner is None or inner.name not in names or consumers.get(inner.name) != (outer.name,):
                continue
            if inner.name in graph.outputs:
                continue
            inner_reads = plain_product(inner)
            # the product's reduce variable runs over the inner node's features (its second index)
            if inner_reads is None or p.indices != (Var(outer.out_vars[0]), Var(outer.reduce_vars[0])):
                continue
            if tuple(i.name for i in inner.index) != inner.out_vars:
                continue
            sparse = [a for a in inner_reads if not type_of[a.tensor].format.is_dense]
            dense = [a for a in inner_reads if type_of[a.tensor].format.is_dense]
            if len(sparse) != 1 or len(dense) != 1:
                continue
            s_read = sparse[0]
            if s_read.indices != (Var(inner.out_vars[0]), Var(inner.reduce_vars[0])):
                continue  # S read as S[i, m]: its rows are the output's rows
            f_x, f_w = inner.extents[inner.out_vars[1]], outer.extents[outer.out_vars[1]]
            if f_w < f_x:
                found.append(Reassociation(inner.name, outer.name, s_read.tensor, (f_x, f_w)))
    return found


def reassociate(graph: Graph, found: list[Reassociation]) -> Graph:
    """The graph with each reassociation applied (node names kept, the inner node's type changed)."""
    if not found:
        return graph
    nodes, types = dict(graph.node_of), dict(graph.type_of)
    for r in found:
        inner, outer = graph.node_of[r.inner], graph.node_of[r.outer]
        (s_read,) = [a for a in plain_product(inner) if a.tensor == r.sparse]
        (x_read,) = [a for a in plain_product(inner) if a.tensor != r.sparse]
        (w_read,) = [a for a in plain_product(outer) if a.tensor != r.inner]
        # fresh variables: i rows of S, m its columns (rows of X), k X's features, j W's outputs
        on_inner = {inner.out_vars[0]: "i", inner.reduce_vars[0]: "m", inner.out_vars[1]: "k"}
        on_outer = {outer.reduce_vars[0]: "k", outer.out_vars[1]: "j"}
        n_rows = inner.extents[inner.reduce_vars[0]]
        x_new, w_new = _renamed(x_read, on_inner), _renamed(w_read, on_outer)
        xw = Node(r.inner, (Var("m"), Var("j")), call("mul", Read(x_new), Read(w_new)),
                  (("m", n_rows), ("k", r.features[0]), ("j", r.features[1])), reduce="sum", tag=inner.tag,
                  origin=inner.origin, group=inner.group)
        s_xw = Node(r.outer, (Var("i"), Var("j")),
                    call("mul", Read(_renamed(s_read, on_inner)), Read(Access(r.inner, (Var("m"), Var("j"))))),
                    (("i", inner.extents[inner.out_vars[0]]), ("m", n_rows), ("j", r.features[1])), reduce="sum",
                    tag=outer.tag, origin=outer.origin, group=outer.group)
        nodes[r.inner], nodes[r.outer] = xw, s_xw
        types[r.inner] = dense_type((n_rows, r.features[1]), types[r.inner].dtype)
    return dataclasses.replace(graph, nodes=tuple(nodes[n.name] for n in graph.nodes),
                               types=tuple(types.items())).validate()


def _renamed(access: Access, names: dict) -> Access:
    return Access(access.tensor, tuple(Var(names[i.name]) for i in access.indices))
