"""Split a fusion region into steps: generated kernels and nodes that run through torch.

Nodes are taken in graph order; a run of consecutive generatable nodes grows while the group
still maps onto one kernel (analysis.plan_group), so every group is a contiguous slice of a
topological order and therefore convex. GEMMs, scatters and sparse nodes run through torch,
one node at a time, until the issues that fuse them land.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import networkx as nx
import torch

from ...ir.expr import Call, Cast, IndexValue, Read
from ...ir.graph import Graph, Node, Region
from ...ir.fold import reads_coordinates_only
from ...ir.interpret import eval_node
from ...ir.index import Var
from .analysis import NotStitchable, PartPlan, components, inlinable, is_contraction, node_refusal, plan_part, unify
from .contraction import contract
from .conv import match_conv
from .emit import inline_body
from .grouped_gemm import match_grouped_gemm
from .mapping import programs, unsplit_config
from .scatter_stores import attach_scatters

log = logging.getLogger("stitchflow.gpu")


def outside_users(graph: Graph, names: set) -> set:
    """Nodes of `names` whose values someone outside the set (or the program) reads."""
    out = set(graph.outputs) & names
    for n in names:
        if any(c not in names for c in graph.consumers.get(n, ())):
            out.add(n)
    return out


def plan_group(graph: Graph, nodes: list[Node], region_outputs: set, memo: dict | None = None) -> list[PartPlan]:
    names = {n.name for n in nodes}
    users = outside_users(graph, names) | (region_outputs & names)
    uf = unify(graph, nodes)
    parts = components(graph, nodes, uf, memo)
    _check_independent(graph, parts, names)
    return [plan_part(graph, comp, uf, users) for comp in parts]


def _check_independent(graph: Graph, parts: list[list[Node]], names: set) -> None:
    """The parts of one kernel run side by side: a part may recompute another's elementwise
    node at its own indices (inlining), but a reduction another part computes (x[::2] +
    x[:, 1::2].sum(): a sum over axes the consumer's loop nest does not share) exists only
    when that part has run, so the kernel ends before the reader."""
    owner = {n.name: k for k, part in enumerate(parts) for n in part}
    known: dict = {}
    for k, part in enumerate(parts):
        for n in part:
            for t in n.inputs:
                if owner.get(t, k) != k and not inlinable(graph, graph.node_of[t], names, known):
                    raise NotStitchable(f"{n.name} reads {t}, a reduction computed by another loop nest of "
                                        "the kernel")


def iota_params(params: dict) -> set:
    """Constant 1-D integer tensors equal to arange(n) (torch.arange folded at capture)."""
    found = set()
    for name, t in params.items():
        if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point() and t.dtype != torch.bool:
            if t.layout == torch.strided and torch.equal(t.cpu(), torch.arange(t.numel(), dtype=t.dtype)):
                found.add(name)
    return found


def fold_iotas(graph: Graph, params: dict) -> Graph:
    """Reads of an arange constant become the index itself, and nodes computed from coordinates alone
    (an arange, an identity) are written into their readers: no loads for a one-hot compare, and the
    compare is one the one-hot rewrites recognise."""
    iotas = iota_params(params)
    made = {n.name: n for n in graph.nodes if reads_coordinates_only(n) and n.reduce is None and not n.is_scatter
            and all(isinstance(i, Var) for i in n.index)}
    if not iotas and not made:
        return graph

    def rewrite(e, extents):
        if isinstance(e, Read) and e.access.tensor in iotas and not (e.access.tensors - {e.access.tensor}):
            dtype = params[e.access.tensor].dtype
            return Cast(dtype, IndexValue(e.access.indices[0]))
        if isinstance(e, Read) and e.access.tensor in made:
            producer = made[e.access.tensor]
            return Cast(graph.type_of[producer.name].dtype, inline_body(producer, e.access.indices, extents))
        if isinstance(e, Call):
            return Call(e.op, tuple(rewrite(a, extents) for a in e.args))
        if isinstance(e, Cast):
            return Cast(e.dtype, rewrite(e.arg, extents))
        return e

    nodes = [dataclasses.replace(n, body=rewrite(n.body, n.extents)) for n in graph.nodes]
    read = {t for n in nodes for t in n.inputs} | set(graph.outputs)
    return dataclasses.replace(graph, nodes=tuple(n for n in nodes if n.name not in made or n.name in read))


def torch_reason(graph: Graph, node: Node) -> str | None:
    """Why `node` runs through torch, not in a generated kernel (None when a kernel can hold it)."""
    if match_grouped_gemm(graph, node) is not None:
        return "grouped GEMM (runs as torch's grouped GEMM)"
    return node_refusal(graph, node)


def in_phases(graph: Graph, nodes: list[Node]) -> list[Node]:
    """The nodes reordered in phases: each node that runs through torch (a GEMM, a convolution)
    as soon as its inputs are there, each node a generated kernel can hold as late as its
    readers allow. So a torch node no longer splits the generated run around it when nothing in
    that run reads it (a ResNet's downsampling convolution between the main branch's batch norm
    and the residual add that reads both), and elementwise work joins the kernel of its reader
    (the downsampling branch's batch norm joins the residual add) instead of storing its result."""
    names = {n.name for n in nodes}
    through_torch = {n.name: torch_reason(graph, n) is not None for n in nodes}
    early: dict[str, int] = {}  # torch node: its phase (1, 2, ...); other: the first gap it may run in
    for n in nodes:
        after = max((early[t] for t in n.inputs if t in names), default=0)
        early[n.name] = after + 1 if through_torch[n.name] else after
    last_gap = max((early[n.name] for n in nodes if through_torch[n.name]), default=0)
    late: dict[str, int] = {}  # the last gap a kernel node may run in
    for n in reversed(nodes):
        if not through_torch[n.name]:
            readers = [r for r in graph.consumers.get(n.name, ()) if r in names]
            late[n.name] = min((early[r] - 1 if through_torch[r] else late[r] for r in readers), default=last_gap)
    order = []
    for gap in range(last_gap + 1):
        order += [n for n in nodes if not through_torch[n.name] and late[n.name] == gap]
        order += [n for n in nodes if through_torch[n.name] and early[n.name] == gap + 1]
    return order


def split_region(graph: Graph, region: Region, scatter_stores: bool = True
                 ) -> list[tuple[str, list[Node], list[PartPlan] | str]]:
    """Steps of a region: ("kernel", nodes, plans) or ("torch", [node], reason). `scatter_stores`: the
    kernel that makes a scatter's values stores them into its output atomically (scatter_stores.py)."""
    nodes = in_phases(graph, [graph.node_of[n] for n in region.nodes if n in graph.node_of])  # rewrites drop dead nodes
    steps: list = []
    current: list[Node] = []
    plans: list[PartPlan] = []
    memo: dict = {}  # the loop nests' spreads (analysis._spread), asked again as the group grows

    def flush():
        nonlocal current, plans
        if current:
            steps.append(("kernel", current, plans))
        current, plans = [], []

    for n in nodes:
        why = torch_reason(graph, n)
        if why:
            flush()
            steps.append(("torch", [n], why))
            continue
        try:
            grown = plan_group(graph, current + [n], set(), memo)
            taps = recomputed_stencils(graph, grown)
            if taps:
                raise NotStitchable(f"{', '.join(taps)} would be gathered again in each pass of the kernel "
                                    f"(window taps cost more than storing the value once)")
            plans, current = grown, current + [n]
            continue
        except NotStitchable as err:
            if not current:
                steps.append(("torch", [n], str(err)))
                continue
            log.info("region %s: new kernel at %s (%s)", region.name, n.name, err)
            flush()
        try:
            plans = plan_group(graph, [n], set(), memo)
            current = [n]
        except NotStitchable as err:
            steps.append(("torch", [n], str(err)))
    flush()
    steps = unpack_starved(graph, defer_elementwise(graph, steps))
    # again: an unpacked part leaves behind the elementwise work it read (a group norm gradient's product)
    steps = [_final(graph, s) for s in defer_elementwise(graph, steps)]
    return attach_scatters(graph, steps) if scatter_stores else steps


def defer_elementwise(graph: Graph, steps: list) -> list:
    """Elementwise work that a kernel computes only for one later kernel moves into that kernel, when
    the later kernel can take it and reads no more bytes for it than the values it would have read.
    Greedy grouping in graph order can leave such nodes in an earlier kernel, which then stores what
    they make (ResNet's stem backward: a batch norm's x - mean, in float32, stored before the max
    pool's gradient kernel for the batch norm backward after it, where recomputing it reads x in
    bfloat16, half the bytes, and the store goes)."""
    steps = list(steps)
    for i in range(len(steps)):
        for j in range(i + 1, len(steps)):
            if steps[i][0] != "kernel" or steps[j][0] != "kernel":
                continue
            moved = _deferrable(graph, steps[i][1], steps[j][1])
            if not moved:
                continue
            kept = [n for n in steps[i][1] if n.name not in moved]
            taken = [n for n in steps[i][1] if n.name in moved] + steps[j][1]
            try:
                planned = [plan_group(graph, nodes, set()) for nodes in (kept, taken) if nodes]
            except NotStitchable as err:
                log.debug("%s stay before the kernel at %s: %s", sorted(moved), taken[-1].name, err)
                continue
            taps = recomputed_stencils(graph, planned[-1])
            if taps:
                log.debug("%s stay before the kernel at %s: it would gather %s in two passes", sorted(moved),
                          taken[-1].name, taps)
                continue
            log.info("%s moved into the kernel at %s (elementwise, read only there)", sorted(moved), taken[-1].name)
            steps[j] = ("kernel", taken, planned[-1])
            steps[i] = ("kernel", kept, planned[0]) if kept else ("empty", [], None)
    return [s for s in steps if s[0] != "empty"]


def _deferrable(graph: Graph, earlier: list[Node], later: list[Node]) -> set[str]:
    """The nodes of `earlier` that may move into `later`: elementwise, not program outputs, each read
    only by those nodes or by `later`, each made from tensors outside `earlier`, from values `earlier`
    stores anyway (a group norm gradient's bfloat16 product, read by the later sums too), or from those
    nodes.
    Each connected piece of them moves only if its outside inputs are no more bytes than what `later`
    reads of it (ResNet's stem: a batch norm's x - mean moves, the pool gradient's taps beside it stay)."""
    mine, theirs = {n.name for n in earlier}, {n.name for n in later}
    moved = {n.name for n in earlier if n.reduce is None and not n.is_scatter and n.name not in graph.outputs}
    stored = {t for t in mine if t in graph.outputs or any(c not in mine for c in graph.consumers.get(t, ()))}
    changed = True
    while changed:
        changed = False
        for name in sorted(moved):
            node = graph.node_of[name]
            if any(c not in moved and c not in theirs for c in graph.consumers.get(name, ())) or \
                    any(t in mine and t not in moved and t not in stored for t in node.inputs):
                moved.discard(name)
                changed = True
    links = nx.Graph()
    links.add_nodes_from(moved)
    links.add_edges_from((t, m) for m in moved for t in graph.node_of[m].inputs if t in moved)
    taken = set()
    for piece in nx.connected_components(links):
        outside = {t for m in piece for t in graph.node_of[m].inputs if t not in piece}
        read_later = {m for m in piece if any(c in theirs for c in graph.consumers.get(m, ()))}
        if _bytes(graph, outside) <= _bytes(graph, read_later):
            taken |= piece
        else:
            log.debug("%s stay before the kernel at %s: their inputs are more bytes than their values",
                      sorted(piece), later[-1].name)
    return taken


PACKED_MIN_PROGRAMS = 128  # fewer programs than this (of an H100's 132 SMs) starve a long reduction packed unsplit
PACKED_LONG = 1024  # reduced elements per row from which a reduction wants its rows split over programs


def unpack_starved(graph: Graph, steps: list) -> list:
    """Each kernel whose packing starves a long reduction (`starved_by_packing`) split into kernels: one
    per starved part, one for the other parts together, in an order that runs a part before the parts
    that read it. Checked on the finished kernels, not while they grow: a part that is alone for a
    moment (a batch norm's running-statistics update, before the node that joins it to the statistics)
    is no reason to cut the kernel. A kernel whose pieces read each other both ways stays packed."""
    out = []
    for step in steps:
        starved = set(starved_by_packing(step[2])) if step[0] == "kernel" else set()
        if not starved:
            out.append(step)
            continue
        pieces = [[n.name for n in p.nodes] for p in step[2] if {r.name for r in p.reductions} & starved]
        alone = {name for piece in pieces for name in piece}
        rest = [n.name for n in step[1] if n.name not in alone]
        pieces += [rest] if rest else []
        order = _piece_order(graph, pieces)
        try:
            kernels = [[n for n in step[1] if n.name in set(pieces[k])] for k in order or ()]
            unpacked = [("kernel", nodes, plan_group(graph, nodes, set())) for nodes in kernels]
        except NotStitchable:
            unpacked = []
        if not unpacked:
            out.append(step)
            continue
        log.info("kernel at %s unpacked into %d: %s would run unsplit beside other parts", step[1][-1].name,
                 len(pieces), sorted(starved))
        out += unpacked
    return out


def _piece_order(graph: Graph, pieces: list[list[str]]) -> list[int] | None:
    owner = {name: k for k, piece in enumerate(pieces) for name in piece}
    deps = nx.DiGraph()
    deps.add_nodes_from(range(len(pieces)))
    deps.add_edges_from((owner[t], owner[name]) for name in owner for t in graph.node_of[name].inputs
                        if t in owner and owner[t] != owner[name])
    try:
        return list(nx.topological_sort(deps))
    except nx.NetworkXUnfeasible:
        return None


def starved_by_packing(plans: list[PartPlan]) -> list[str]:
    """Reductions that packing would starve. Parts packed into one launch share no barrier, so none of
    them splits its rows over programs (GroupKernel._space); a long reduction over few rows then runs on
    a handful of programs: a U-Net's group-norm gradient sums, [8 x 128] rows of 1024, packed in pairs,
    took 60-88 µs a launch on an H100, where split alone they take a few."""
    working = [p for p in plans if p.outputs]
    if len(working) < 2:
        return []
    return [p.reductions[0].name for p in working if p.reductions and p.L_total >= PACKED_LONG
            and _packed_programs(p) < PACKED_MIN_PROGRAMS]


def _packed_programs(plan: PartPlan) -> int:
    """Programs of a reduction packed unsplit: a row each (the autotuner may take one), or the
    column blocks of `unsplit_config`."""
    return programs(plan, unsplit_config(plan)) if plan.p_contiguous else plan.P_total


STENCIL_TAPS = 3  # reads of one tensor at that many places make a node a stencil (an unrolled window)


def recomputed_stencils(graph: Graph, plans: list[PartPlan]) -> list[str]:
    """Stencils (nodes reading one tensor at STENCIL_TAPS or more places: an unrolled pool
    gradient's window) that a part needs in more than one of its passes: a reduction's pass and
    the final one, which writes the outputs. Inlined, such a node is gathered again in each pass
    (a split's phases are separate launches), where storing it once costs a write and a read."""
    found = []
    for plan in plans:
        if plan.final_stage == 0:
            continue
        names = {n.name for n in plan.nodes}
        passes: dict[str, set] = {}
        for node in reversed(plan.nodes):  # readers first
            need = {plan.final_stage} if node.name in plan.outputs and node.name not in plan.row_level else set()
            for c in graph.consumers.get(node.name, ()):
                if c in names and graph.node_of[c].reduce:
                    need.add(plan.stage[c])
                elif c in names and c not in plan.row_level:
                    need |= passes[c]
            passes[node.name] = need
        found += [n.name for n in plan.nodes if len(passes[n.name]) > 1 and _taps(n) >= STENCIL_TAPS]
    return found


def _taps(node: Node) -> int:
    places: dict[str, set] = {}
    for access in node.accesses:
        places.setdefault(access.tensor, set()).add(access.indices)
    return max((len(p) for p in places.values()), default=0)


def _bytes(graph: Graph, names) -> int:
    return sum(math.prod(graph.type_of[t].shape) * graph.type_of[t].dtype.itemsize for t in names if t in graph.type_of)


def _final(graph: Graph, step):
    kind, nodes, extra = step
    if kind == "kernel":  # re-plan with the final membership so that outputs are exact
        return kind, nodes, plan_group(graph, nodes, set())
    return step


class TorchStep:
    """One node evaluated with torch (the reference semantics), on the tensors' device."""

    def __init__(self, graph: Graph, node: Node, reason: str):
        self.graph, self.node, self.reason = graph, node, reason
        self.dense_gemm = is_contraction(node) and all(
            graph.type_of[t].format.is_dense for t in node.inputs)
        self.index_cache: dict = {}
        self.conv = match_conv(graph, node) if self.dense_gemm else None
        self.grouped = match_grouped_gemm(graph, node)
        self.weights: dict = {}  # a convolution's weight in its input's memory format

    def __call__(self, env) -> None:
        node, out_type = self.node, self.graph.type_of[self.node.name]
        if self.grouped is not None:
            env[node.name] = self.grouped(env, out_type.dtype, self.index_cache)
            return
        if self.conv is not None:
            env[node.name] = self.conv(env, out_type.dtype, self.weights)
            return
        if self.dense_gemm:
            env[node.name] = contract(node, env, out_type.dtype, self.index_cache)
            return
        try:
            env[node.name] = eval_node(node, env, out_type)
        except RuntimeError as err:  # the interpreter builds some index tensors on the CPU
            if "device" not in str(err):
                raise
            device = next((env[t].device for t in node.inputs if isinstance(env[t], torch.Tensor)), None)
            if device is None:  # it reads no tensor: the error is not the CPU index tensors'
                raise
            cpu = {t: env[t].cpu() for t in node.inputs}
            env[node.name] = eval_node(node, cpu, out_type).to(device)

    def on_meta(self, env) -> None:
        """The call on meta tensors (prefetch.py), for its output's strides: the same paths as a call, with
        caches of its own, so that nothing made for meta tensors stays for real ones."""
        node, out_type = self.node, self.graph.type_of[self.node.name]
        if self.grouped is not None:  # its offsets are data: the output's shape and (contiguous) strides
            env[node.name] = torch.empty(out_type.shape, dtype=out_type.dtype, device="meta")
        elif self.conv is not None:
            env[node.name] = self.conv(env, out_type.dtype, {})
        elif self.dense_gemm:
            env[node.name] = contract(node, env, out_type.dtype, {})
        else:
            env[node.name] = eval_node(node, env, out_type)

    def __str__(self) -> str:
        if self.conv is not None:
            return f"torch({self.node.name}: {self.conv})"
        if self.grouped is not None:
            return f"torch({self.node.name}: grouped GEMM, {self.grouped.describe()})"
        return f"torch({self.node.name}: {self.reason})"
