"""The gpu target: memory-intensive regions become stitched Triton kernels generated from the IR.

    prog = stitchflow.compile(model, inputs, target="gpu", fusion="auto",
                              options={"autotune": True})

Each region is split into steps: compute chains inside it (GEMM -> act -> GEMM, gated FFN,
GEMM + epilogue; chains.py) become fused chain kernels, autotuned against cuBLAS; GEMMs that read the
same activations (attention's Q, K, V projections) run as one grouped launch (siblings.py); attention
(softmax of masked, scaled Q·Kᵀ, times V; attention.py) becomes one block-sparse kernel that
skips the tiles its constant mask drops; runs of
elementwise, broadcast and reduction nodes become one generated kernel each (grouping.py,
codegen.py); a scatter (a graph network's sum of messages) is stored atomically by the kernel that makes
its values (scatter_stores.py; options["scatter_stores"] = False leaves scatters to torch); other GEMMs,
products and other sparse nodes run through torch. With TRITON_INTERPRET=1
the same kernels run on CPU tensors. options["chains"] = False leaves GEMMs to torch;
options["sibling_gemms"] = False runs GEMMs that share A one by one. A sparse
product followed by a narrowing GEMM, (S·X)·W, is computed as S·(X·W) (reassociate.py;
options["reassociate"] = False keeps the program's order); a CSR × dense product runs as our
Triton kernel or torch's, whichever times faster (spmm.py).

Options (all optional): autotune (default True: time a few configs per kernel on the device, of
kernels that move 256 KB or more, and cache the choice on disk; "all": every config of every kernel,
however long it compiles, as the benchmarks ask; False: the first config of each); compile_deadline
(seconds the autotuner waits for a kernel's configs to compile, default $STITCHFLOW_COMPILE_DEADLINE
or 15; None waits for all); prefetch (default True: every kernel's compiles queued before a program's
first call, prefetch.py);
block_p, block_l, split, num_warps, persistent (pin the mapping, for tests and experiments).
Environment: STITCHFLOW_CACHE (default ~/.cache/stitchflow) holds generated sources and chosen configs.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ...ir.graph import SCATTER_OPS, Graph, Region
from ...ir.activations import recognise_activations
from ...ir.reshapes import unflatten_rows
from . import chain_cost, chain_plans, cluster_planes
from .attention import DEFAULT_TILES, AttentionStep, NotAttention, score_coefficients
from .attention_match import match_attention
from .attention_plan import tile_plan
from .layout import output_store, read_walked
from .mapping import MAX_ROW_IN_REGISTERS
from .operand_layouts import permute_values, query_orders
from .emit import contiguous_strides
from .chain_match import chain_shape, match_chains, match_gemm_epilogues
from .chains import compile_chain
from .channels_last import channels_last, channels_last_layouts
from .conv import match_conv, region_convolutions
from .grouped_gemm import match_grouped_gemm
from .grouping import TorchStep, fold_iotas, split_region
from .prefetch import prefetch as prefetch_compiles
from .reassociate import find_reassociations, reassociate
from .rewrites import gather_one_hots, sink_widening_casts, unroll_small_sums, window_scatters
from .siblings import SiblingGemms, match_siblings
from .scatter_stores import split_scatter_bodies
from .spmm import SpmmStep, sparse_product
from .runtime import LAUNCHES, GroupKernel, interpreting

__all__ = ["TARGET", "GpuTarget", "LAUNCHES", "interpreting"]
log = logging.getLogger("stitchflow.gpu")


class GpuTarget:
    name = "gpu"

    def check_region(self, graph: Graph, region: Region) -> str | None:
        """Every region can run: what is not generated runs through torch, node by node."""
        return None

    def prepare(self, captured, regions, options=None):
        """GEMMs over flattened rows computed in their input's shape (ir/reshapes.py), and activations
        around convolutions channels last (channels_last.py), once for every region.
        options["unflatten_rows"]: False keeps the views; options["recognise_activations"]: False keeps
        activations written out by hand as they are (ir/activations.py); options["channels_last"]: False keeps layouts;
        options["free_outputs"]: outputs that may leave permuted; options["input_orders"]: inputs
        that arrive permuted ({name: the permutation that makes them contiguous});
        options["last_outputs"]: free outputs that convolutions outside read, stored channels last."""
        options = options or {}
        graph = unflatten_rows(captured.graph) if options.get("unflatten_rows", True) else captured.graph
        graph = recognise_activations(graph) if options.get("recognise_activations", True) else graph
        if graph is not captured.graph:  # a recognised activation drops the nodes it was written with
            notes = _rewrite_notes(captured.graph, graph)
            for note in notes:
                log.info("%s", note)
            captured = dataclasses.replace(captured, graph=graph, notes=[*captured.notes, *notes])
            regions = [dataclasses.replace(r, nodes=kept) for r in regions
                       if (kept := tuple(n for n in r.nodes if n in graph.node_of))]
        if not options.get("channels_last", True):
            return captured, regions
        graph, layouts = channels_last_layouts(captured.graph, options.get("free_outputs", ()),
                                               options.get("input_orders"), options.get("last_outputs", ()))
        if graph is captured.graph:
            return captured, regions
        return dataclasses.replace(captured, graph=graph, layouts={**captured.layouts, **layouts}), regions

    def compile_region(self, graph: Graph, region: Region, params: dict, options: dict, examples=None):
        options = dict(options or {})
        graph = window_scatters(fold_iotas(graph, params), params)
        if options.get("scatter_stores", True):
            graph, region = split_scatter_bodies(graph, region)
        graph = sink_widening_casts(unroll_small_sums(gather_one_hots(graph)))
        if options.get("reassociate", True):
            found = find_reassociations(graph, set(region.nodes))
            for r in found:
                log.info("%s: %s", region.name, r)
            graph = reassociate(graph, found)
        attention = region_attention(graph, region, params, options) if options.get("attention", True) else []
        if attention and options.get("query_layouts", True):
            orders = query_orders(graph, [(a.match, a.store) for a in attention], set(region.nodes))
            if orders:
                graph = permute_values(graph, orders)
                attention = region_attention(graph, region, params, options)
        if options.get("walked_reads", True):
            graph = read_walked(graph, {a.match.result: a.store for a in attention if a.store})
        taken = {n for a in attention for n in a.nodes}
        chains = region_chains(graph, region, taken) if options.get("chains", True) else []
        fused_at = {c[-1]: (lambda c=c: compile_chain(graph, c, options)) for c in chains}
        fused_at.update({a.match.result: (lambda a=a: a) for a in attention})
        taken |= {n for c in chains for n in c}
        convs = region_convolutions(graph, region, taken) if options.get("conv_padding", True) else []
        fused_at.update({c.call.node: (lambda c=c: c) for c in convs})
        taken |= {n for c in convs for n in c.nodes}
        siblings = match_siblings(graph, region.nodes, chains, taken) \
            if options.get("chains", True) and options.get("sibling_gemms", True) else []
        for group in siblings:  # the group runs where its first GEMM's output stands; A is ready there
            log.info("%s: %s", region.name, group)
            for member in group.members:
                fused_at.pop(member.output, None)
            fused_at[group.members[0].output] = lambda group=group: SiblingGemms(graph, group, options)
            taken |= set(group.nodes)
        steps, pending = [], []
        # A chain or an attention runs where its last node stands: its inputs are ready there, and
        # the matchers guarantee no other node reads its intermediates.
        for name in region.nodes:
            if name not in taken:
                pending.append(name)
            elif name in fused_at:
                steps += self._stitched(graph, Region(region.name, tuple(pending)), options)
                pending = []
                steps.append(fused_at[name]())
        steps += self._stitched(graph, Region(region.name, tuple(pending)), options)
        run = _steps_run(steps)
        run.kernels = [s for s in steps if isinstance(s, GroupKernel)]
        run.chains = chains
        run.siblings = siblings
        run.attention = attention
        return run

    def graph_tail(self, graph: Graph, runs) -> tuple[list, tuple | None]:
        """(the runs a CUDA graph replays, (names, fn) of the tail it leaves out, or None). The tail: GEMMs
        through torch that make large outputs of the program (a language model's logits) and whose outputs no
        later step reads. Run after the replay, they allocate their outputs; inside the graph, the replay would
        clone them out of its buffers."""
        if not runs or not all(hasattr(run, "steps") for run in runs):
            return list(runs), None
        deferred, read_later = set(), set()
        for step in reversed([s for run in runs for s in run.steps]):
            if read_later is not None and _detachable(graph, step) and step.node.name not in read_later:
                deferred.add(id(step))
            reads = _step_reads(graph, step)
            read_later = None if reads is None or read_later is None else read_later | reads
        if not deferred:
            return list(runs), None
        head = [_steps_run([s for s in run.steps if id(s) not in deferred]) if any(
            id(s) in deferred for s in run.steps) else run for run in runs]
        tail = [s for run in runs for s in run.steps if id(s) in deferred]
        return head, (tuple(s.node.name for s in tail), _steps_run(tail))

    def prefetch(self, graph: Graph, runs, env: dict) -> int:
        """Before a program's first call on `env`: every generated kernel's compiles queued at once
        (prefetch.py), so that the call finds them compiled or compiling."""
        return prefetch_compiles(graph, runs, env)

    def explain(self, graph: Graph, regions, options: dict | None = None, params: dict | None = None) -> list[str]:
        """Each GEMM → act → GEMM chain inside a region: its shape and the cost model's ranking of
        the plans on a GPU profile (options["gpu_profile"], else this machine's GPU, else an H100);
        each attention, its output's store and (given the parameters' values) its folded mask's tiles;
        each part with plane statistics: the thread-block cluster plans it may take, or why none."""
        options = options or {}
        name = options.get("gpu_profile") or (torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        profile = chain_cost.profile_for(name or "NVIDIA H100 80GB HBM3")
        lines = []
        for region in regions:
            for names in region_chains(graph, region):
                shape = chain_shape(graph, names)
                if shape is None:
                    continue
                lines.append(f"  {region.name}: {names[0]} .. {names[-1]}: M={shape.M} K={shape.K} N={shape.N} "
                             f"L={shape.L} {shape.act}{' gated' if shape.gated else ''}, {8 * shape.elt}-bit")
                lines += ["    " + line for line in chain_plans.explain_shape(shape, profile)]
        out = []
        if lines:
            note = "" if name else " (no GPU here: --gpu-profile names another)"
            out += ["", f"chain plans on {profile.name}{note}, cheapest first (the autotuner times the shortlist):",
                    *lines]
        siblings = [f"  {region.name}: {group}" for region in regions
                    for group in match_siblings(graph, region.nodes, region_chains(graph, region))]
        if siblings:
            out += ["", "GEMMs of one input (one grouped launch, or one by one where that times faster):", *siblings]
        reassociated = [f"  {region.name}: {r}" for region in regions
                        for r in find_reassociations(graph, set(region.nodes))]
        if reassociated:
            out += ["", "sparse products reassociated (the narrowing GEMM first):", *reassociated]
        found, refused = match_attention(graph, graph.params)
        def place(m):  # (its region, the match as that region runs it), or None
            return next(((r, m.within(set(r.nodes))) for r in regions if m.within(set(r.nodes))), None)

        placed = {m: place(m) for m in found}
        inside = [placed[m] for m in found if placed[m] is not None]

        def merged(region, m) -> str:
            store = output_store(graph, m.result, set(region.nodes))
            if not store:
                return ""
            orders = query_orders(graph, [(m, store)], set(region.nodes))
            layout = f"; Q {m.q.tensor} stored with its axes in the order {orders[m.q.tensor]} (torch's attention" \
                     " writes its output in Q's order)" if m.q.tensor in orders else ""
            return f"; its output {store}{layout}"

        if found or refused:
            out += ["", "attention (one block-sparse kernel each; the mask is folded into tiles when compiled):",
                    *(line for r, m in inside for line in (f"  {m}{merged(r, m)}", *_explain_tiles(graph, m, params))),
                    *(f"  {m}: not inside one region" for m in found if placed[m] is None),
                    *(f"  not attention: {why}" for why in refused)]
        convs = _explain_convolutions(graph, regions, options)
        if convs:
            out += ["", "convolutions (torch's, i.e. cuDNN's, with the activations around them channels last):", *convs]
        scatters = _explain_scatters(graph, regions)
        if scatters:
            out += ["", "scatters (stored atomically by the kernel that makes their messages, or through torch):",
                    *scatters]
        found = [(region.name, name, match_grouped_gemm(graph, graph.node_of[name])) for region in regions
                 for name in region.nodes if name in graph.node_of]
        grouped = [f"  {region}: {name}: {call.describe()}" for region, name, call in found if call is not None]
        if grouped:
            out += ["", "grouped GEMMs (a mixture of experts' products: torch._grouped_mm on CUDA in bfloat16, a loop "
                    "of GEMMs over the groups elsewhere):", *grouped]
        clusters = _explain_cluster_planes(graph, regions)
        if clusters:
            out += ["", "plane and row statistics on thread-block clusters (Hopper; timed against the generated "
                    "kernels):", *clusters]
        return out

    @staticmethod
    def _stitched(graph: Graph, region: Region, options: dict) -> list:
        steps = []
        if not region.nodes:
            return steps
        for kind, nodes, extra in split_region(graph, region, options.get("scatter_stores", True)):
            if kind == "kernel":
                names = {n.name for n in nodes}
                for plans in pack(extra):
                    first, last = plans[0].nodes[0].name, plans[-1].nodes[-1].name
                    steps.append(GroupKernel(graph, plans, options, f"{region.name}:{first}..{last}", names))
            elif sparse_product(graph, nodes[0]) is not None:
                steps.append(SpmmStep(graph, nodes[0], sparse_product(graph, nodes[0])))
            else:
                steps.append(TorchStep(graph, nodes[0], extra))
        return steps


def _rewrite_notes(before: Graph, after: Graph) -> list[str]:
    """What unflatten_rows and recognise_activations changed, for the `stitchflow.gpu` logger and `explain`."""
    notes = []
    split = [n.name for n in after.nodes
             if n.name in before.node_of and len(n.index) != len(before.node_of[n.name].index)]
    if split:
        notes.append(f"rows unflattened (computed in their input's shape): {', '.join(split)}")
    recognised = [f"{n.name} ({n.tag.kind})" for n in after.nodes if n.tag is not None
                  and (before.node_of[n.name].tag is None or before.node_of[n.name].tag.kind != n.tag.kind)]
    if recognised:
        notes.append(f"activations written out by hand recognised: {', '.join(recognised)} "
                     f"({len(before.nodes) - len(after.nodes)} nodes fewer)")
    return notes


def _explain_convolutions(graph: Graph, regions, options: dict) -> list[str]:
    """Each convolution as it will run: its layout, and whether its zero padding is folded into it."""
    last = channels_last(graph) if options.get("channels_last", True) else graph
    lines = []
    for region in regions:
        folded = {c.call.node: c.call for c in region_convolutions(last, region, set())}
        for name in region.nodes:
            call = folded.get(name) or (match_conv(last, last.node_of[name]) if name in last.node_of else None)
            if call is not None:
                lines.append(f"  {region.name}: {name} = {call}")
    return lines


def _explain_tiles(graph: Graph, match, params: dict | None) -> list[str]:
    """The folded mask at the default tile shape: the positions kept, the tiles visited, the longest query
    tile (what a split into runs would cut); or why the transform does not fold."""
    if params is None:
        return []
    try:
        a, folded, _ = score_coefficients(graph, match, params)
    except NotAttention as why:
        return [f"    not folded: {why}"]
    plan = tile_plan(a, folded, DEFAULT_TILES)
    n_q, n_k = plan.start.shape[0], -(-folded.s_k // DEFAULT_TILES.bn)
    kept = folded.kept / (folded.s_q * folded.s_k)
    return [f"    mask folded: {kept:.1%} of {folded.s_q}x{folded.s_k} positions kept; at {DEFAULT_TILES.bm}x"
            f"{DEFAULT_TILES.bn} tiles {plan.visited} of {n_q * n_k} visited ({plan.partial} partial), the longest "
            f"query tile visits {plan.longest}"]


def _explain_scatters(graph: Graph, regions) -> list[str]:
    """Each scatter of a region: the kernel that stores it, or why torch runs it (scatter_stores.py)."""
    lines = []
    for region in regions:
        if not any(graph.node_of[n].is_scatter for n in region.nodes if n in graph.node_of):
            continue
        split_graph, split = split_scatter_bodies(graph, region)
        try:
            steps = split_region(split_graph, split)
        except Exception:  # explain never fails on a region the kernels split differently
            continue
        for kind, nodes, extra in steps:
            if kind == "kernel":
                lines += [f"  {region.name}: {scatter.name} ({SCATTER_OPS[scatter.reduce]}) stored by the kernel of "
                          f"{value}" for plan in extra for value, scatter in plan.scatters]
            elif nodes[0].is_scatter:
                lines.append(f"  {region.name}: {nodes[0].name}: {extra}")
    return lines


def _explain_cluster_planes(graph: Graph, regions) -> list[str]:
    """Per stitched part with plane-shaped statistics (reduced axes around a channel, as batch
    norm's) or rows too long for one program: the cluster sizes cluster_planes takes, or why it takes none
    (contiguous inputs assumed)."""
    strides = {t: contiguous_strides(ty.shape) for t, ty in graph.type_of.items()}
    lines = []
    for region in regions:
        if not region.nodes:
            continue
        try:
            parts = [p for kind, _, plans in split_region(graph, region) if kind == "kernel" for p in plans]
        except Exception:  # explain never fails on a region the kernels split differently
            continue
        for plan in parts:
            short_row = len(plan.L) == 1 and plan.L_total <= MAX_ROW_IN_REGISTERS  # one program holds it
            if not plan.reductions or plan.p_contiguous or short_row:
                continue
            found, why = cluster_planes.cluster_plans(graph, plan, strides)
            head = f"  {region.name}: {plan.nodes[0].name} .. {plan.nodes[-1].name}: "
            lines.append(head + ("; ".join(map(str, found[:2])) if found else "none: " + "; ".join(why)))
    return lines


def region_chains(graph: Graph, region: Region, taken: set = frozenset()) -> list[tuple[str, ...]]:
    """Chains and GEMM epilogues that lie wholly inside the region, their outputs only used
    by the chain's last node (so fusing them writes nothing the rest of the program needs),
    and touching no node of `taken` (another fused step's)."""
    inside = set(region.nodes) - set(taken)
    chains = [c for c in match_chains(graph) if set(c) <= inside]
    chains += [c for c in match_gemm_epilogues(graph, chains) if set(c) <= inside]
    return chains


DETACHED_BYTES = 32 << 20  # an output this large costs a replay more to clone (tens of µs) than its launch


def _detachable(graph: Graph, step) -> bool:
    """A GEMM through torch that makes an output of the program of DETACHED_BYTES or more from values the program
    makes or holds (a replay keeps those in its buffers; the call's inputs it copies into buffers of its own)."""
    if not (isinstance(step, TorchStep) and step.dense_gemm and step.conv is None) or \
            step.node.name not in graph.outputs or set(step.node.inputs) & set(graph.inputs):
        return False
    out = graph.type_of[step.node.name]
    return math.prod(out.shape) * out.dtype.itemsize >= DETACHED_BYTES


def _steps_run(steps: list):
    """A region's runner: its steps in order on the call's environment (`run.steps` lists them)."""
    def run(env):
        for step in steps:
            step(env)

    run.steps = steps
    return run


def _step_reads(graph: Graph, step) -> set[str] | None:
    """What a step reads (its nodes' inputs), or None where the step is of a kind not known here."""
    if isinstance(step, GroupKernel):
        names = [n.name for plan in step.plans for n in plan.nodes]
    elif isinstance(step, (TorchStep, SpmmStep)):
        names = [step.node.name]
    elif isinstance(step, AttentionStep):
        names = list(step.nodes)
    elif hasattr(step, "spec"):  # a chain's run (chains.compile_chain)
        names = list(step.spec.nodes)
    elif isinstance(step, SiblingGemms):
        names = list(step.nodes)
    else:
        return None
    return {t for n in names if n in graph.node_of for t in graph.node_of[n].inputs}


def region_attention(graph: Graph, region: Region, params: dict, options: dict) -> list[AttentionStep]:
    """Attention patterns wholly inside the region whose score transform folds into constant tiles;
    the others are logged with their reason and run as stitched kernels and torch contractions."""
    matches, refusals = match_attention(graph, params)
    steps, inside, stores = [], set(region.nodes), options.get("attention_store", True)
    for match in matches:
        match = match.within(inside)
        if match is None:
            continue
        try:
            store = output_store(graph, match.result, inside) if stores else None
            steps.append(AttentionStep(graph, match, params, options, store))
        except NotAttention as why:
            refusals.append(f"{match.output}: {why}")
    for why in refusals:
        log.info("not fused as attention: %s", why)
    return steps


PACK_ELEMENTS = 1 << 21  # parts at most this large share a launch; larger ones get their own
PACK_MIN_ROW_BLOCKS = 128  # a reducing part with fewer row blocks than this, unsplit, runs alone
PACK_SHORT_ROWS = 1024  # reductions over at most this many elements are done by one program as well as by several


def runs_alone(part) -> bool:
    """Whether a part wants a launch of its own: a large one, or one whose reductions want their rows split
    across programs, which a packed launch cannot do (no cooperative barrier, no phases). Unsplit, a part has
    a program per row block, and rows contiguous along the parallel axis (a column reduction: batch norm's
    channels last) take 32 to a block for coalesced reads. ResNet-18's training step packed its batch norms
    (256 channels x 6272 points, the running statistics' updates beside them) into 2-16 programs: 270-740 µs
    each on an H100, and a 36 s compile of their [128, 8192] tiles, where a cooperative split takes tens of µs."""
    if part.P_total * part.L_total > PACK_ELEMENTS:
        return True
    if not part.reductions or part.L_total <= PACK_SHORT_ROWS:
        return False
    return (part.P_total // 32 if part.p_contiguous else part.P_total) < PACK_MIN_ROW_BLOCKS


def pack(plans) -> list[list]:
    """Independent parts of a group: small ones are packed into one launch (a launch costs
    microseconds, as much as moving a few megabytes), where the first of them stands; large
    ones, and ones whose rows want splitting (`runs_alone`), run as kernels of their own, each
    with its own tile shape and warps. Parts that only feed others by inlining have no work of
    their own (their consumers recompute them)."""
    working = [p for p in plans if p.outputs]
    if len(working) <= 1 or not any(runs_alone(p) for p in working):
        return [plans]
    out, small = [], []
    for p in working:
        if runs_alone(p):
            out.append([p])
        else:
            if not small:
                out.append(small)
            small.append(p)
    return out


TARGET = GpuTarget()
