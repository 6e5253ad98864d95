"""GEMMs that read the same activations, in one launch (horizontal fusion).

A transformer's query, key and value projections, like any linear layers fed the same input, are
separate GEMMs of one A against weights the program takes as inputs. At BERT's size each is a
512x768 by 768x768 product of about 4.5 µs on an H200, most of it fixed cost: its tiles fill
under one wave of the SMs, and a CUDA graph leaves a gap between launches. Here the GEMMs of
one A run as one grouped kernel: the programs of all of them in one grid, each reading its weight
and bias where they lie. Nothing is concatenated or copied, so a weight written in place
between calls is read fresh, and memory holds no second copy of the weights.

Siblings must share A (the same tensor, read whole), the reduction length and the dtype, take
their weights and biases from the program's inputs or parameters (ready wherever the group
runs), and end at the GEMM or its bias add; a GEMM with an activation or a residual stays a
GEMM epilogue (chains.py). On a GPU the first call times the grouped kernel, in a few tilings,
against the GEMMs one by one, each as it would run alone, and keeps the fastest. Large GEMMs
stay on cuBLAS that way.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ir.graph import Graph
from .chain_kernels import GemmTiles, _finish_tile, _grouped_tile, _mma, dot_precision, interpreting
from .chain_match import Contraction, dense_contraction, spec_for
from .chains import compile_chain
from .grouping import TorchStep
from .timing import graph_bench

log = logging.getLogger("stitchflow.gpu.siblings")

MOST = 8  # GEMMs a grouped launch takes (a static branch each)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# tilings the first call times on a GPU (bm, bn, bk, warps, stages)
TILINGS = (GemmTiles(64, 128, 64, 1, 8, 4, 3), GemmTiles(128, 128, 64, 1, 8, 8, 3),
           GemmTiles(64, 64, 64, 1, 8, 4, 4), GemmTiles(128, 64, 64, 1, 8, 4, 3))
INTERPRETER_TILES = GemmTiles(32, 32, 32, 1, 8, 4, 1)


@triton.jit
def grouped_gemm_kernel(a_ptr, b_ptrs, c_ptrs, bias_ptrs, starts, widths, sbks, sbns, M, K, sam, sak,
                        G: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
                        UPCAST: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                        GROUP_M: tl.constexpr):
    """C_g = A·B_g (+ bias_g) for every g: programs starts[g] .. starts[g + 1] - 1 make C_g's tiles."""
    pid = tl.program_id(0)
    for g in tl.static_range(G):
        if (pid >= starts[g]) & (pid < starts[g + 1]):
            N = widths[g]
            pid_m, pid_n = _grouped_tile(pid - starts[g], M, N, BM, BN, GROUP_M)
            offs_m = pid_m * BM + tl.arange(0, BM)
            offs_n = pid_n * BN + tl.arange(0, BN)
            offs_k = tl.arange(0, BK)
            m_ok = offs_m < M
            n_ok = offs_n < N
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + offs_k
                if EVEN_K:  # no mask along K, A's contiguous dim
                    a_mask = m_ok[:, None]
                    b_mask = n_ok[None, :]
                else:
                    a_mask = m_ok[:, None] & (ks < K)[None, :]
                    b_mask = (ks < K)[:, None] & n_ok[None, :]
                a = tl.load(a_ptr + offs_m[:, None] * sam + ks[None, :] * sak, mask=a_mask, other=0.0)
                b = tl.load(b_ptrs[g] + ks[:, None] * sbks[g] + offs_n[None, :] * sbns[g], mask=b_mask, other=0.0)
                acc = _mma(a, b, acc, PREC, UPCAST)
            _finish_tile(acc, offs_m, offs_n, M, N, c_ptrs[g], N, 1, bias_ptrs[g], a_ptr, 0, 0, a_ptr, 1.0,
                         0, HAS_BIAS, False, 0)


def grouped_gemm(a: torch.Tensor, weights: list, biases: list | None, out_dtypes: list,
                 tiles: GemmTiles = GemmTiles(64, 128, 64), exact_fp32: bool = False) -> list[torch.Tensor]:
    """[A·B_g + bias_g] for A: M×K and each B_g: K×N_g (any strides), in one launch; outputs row-major."""
    if not 1 <= len(weights) <= MOST:
        raise ValueError(f"a grouped GEMM takes 1 to {MOST} weights, not {len(weights)}")
    M, K = a.shape
    if any(w.shape[0] != K for w in weights):
        raise ValueError(f"every weight must have {K} rows (A is {M}x{K}): {[tuple(w.shape) for w in weights]}")
    outs = [torch.empty((M, w.shape[1]), dtype=dt, device=a.device) for w, dt in zip(weights, out_dtypes)]
    tiles_of = [triton.cdiv(M, tiles.bm) * triton.cdiv(w.shape[1], tiles.bn) for w in weights]
    starts = [sum(tiles_of[:g]) for g in range(len(weights) + 1)]
    grouped_gemm_kernel[(starts[-1],)](
        a, tuple(weights), tuple(outs), tuple(biases) if biases else tuple(weights), tuple(starts),
        tuple(w.shape[1] for w in weights), tuple(w.stride(0) for w in weights), tuple(w.stride(1) for w in weights),
        M, K, a.stride(0), a.stride(1), G=len(weights), HAS_BIAS=bool(biases), EVEN_K=K % tiles.bk == 0,
        PREC=dot_precision(a.dtype, exact_fp32), UPCAST=interpreting(), BM=tiles.bm, BN=tiles.bn, BK=tiles.bk,
        GROUP_M=tiles.group_m, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return outs


# ---------------------------------------------------------------- matching

@dataclass(frozen=True)
class Sibling:
    """One GEMM of a group: `nodes` its GEMM (and bias add), `output` the value the program keeps."""

    gemm: Contraction
    bias: str | None
    nodes: tuple[str, ...]

    @property
    def output(self) -> str:
        return self.nodes[-1]


@dataclass(frozen=True)
class SiblingGroup:
    a: str
    members: tuple[Sibling, ...]

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(n for m in self.members for n in m.nodes)

    def __str__(self) -> str:
        return f"siblings of {self.a}: {', '.join(m.output for m in self.members)}"


def _sibling(graph: Graph, names: tuple[str, ...]) -> Sibling | None:
    """A GEMM alone, or with a bias add, whose weight and bias are inputs or parameters of the program."""
    ready = set(graph.inputs) | set(graph.params)
    if len(names) == 1:
        gemm, bias = dense_contraction(graph, graph.node_of[names[0]]), None
    else:
        spec = spec_for(graph, names)
        if spec.second is not None or spec.act != "none" or spec.residual is not None or spec.bias1 is None:
            return None
        gemm, bias = spec.first, spec.bias1
    if gemm is None or gemm.w not in ready or (bias is not None and bias not in ready):
        return None
    return Sibling(gemm, bias, names)


def _group_key(graph: Graph, s: Sibling) -> tuple | None:
    """(A, reduction length, dtype, has a bias): what siblings share; None for what cannot be grouped."""
    a, w = graph.type_of[s.gemm.a], graph.type_of[s.gemm.w]
    if a.dtype != w.dtype or a.dtype not in FLOAT_DTYPES:
        return None
    return s.gemm.a, a.shape[-1], a.dtype, s.bias is not None


def match_siblings(graph: Graph, region_nodes, chains, taken=frozenset()) -> list[SiblingGroup]:
    """Groups of two or more GEMMs reading the same A, in the order of `region_nodes`: among `chains`
    (the region's chains and GEMM epilogues) those that are a GEMM and its bias add, and the region's
    other dense GEMMs, outside the chains and `taken` (other fused steps' nodes)."""
    fused = {n for c in chains for n in c} | set(taken)
    candidates = list(chains) + [(n,) for n in region_nodes if n not in fused and n in graph.node_of]
    groups: dict = defaultdict(list)
    for names in candidates:
        s = _sibling(graph, tuple(names))
        key = _group_key(graph, s) if s is not None else None
        if key is not None:
            groups[key].append(s)
    order = {n: i for i, n in enumerate(region_nodes)}
    found = []
    for members in groups.values():
        members.sort(key=lambda s: order[s.output])
        found += [SiblingGroup(members[i].gemm.a, tuple(members[i:i + MOST]))
                  for i in range(0, len(members), MOST) if len(members[i:i + MOST]) > 1]
    return sorted(found, key=lambda g: order[g.members[0].output])


# ---------------------------------------------------------------- the step

class SiblingGemms:
    """A region step: the group's GEMMs as one grouped launch, or one by one where that times faster."""

    def __init__(self, graph: Graph, group: SiblingGroup, options: dict):
        self.graph, self.group = graph, group
        self.nodes = group.nodes
        self.types = [graph.type_of[m.output] for m in group.members]
        self.alone = [compile_chain(graph, m.nodes, options) if m.bias is not None
                      else TorchStep(graph, graph.node_of[m.output], "a GEMM beside its siblings")
                      for m in group.members]
        self.tune = options.get("autotune", torch.cuda.is_available() and not interpreting())
        self.exact = options.get("exact_fp32", interpreting() or torch.get_float32_matmul_precision() == "highest")
        self.choice: dict = {}  # A's shape -> "alone" or the GemmTiles of the grouped launch

    def _grouped(self, env, tiles: GemmTiles) -> None:
        a = env[self.group.a]
        a = a.reshape(-1, a.shape[-1])
        members = self.group.members
        weights = [env[m.gemm.w].t() if m.gemm.w_transposed else env[m.gemm.w] for m in members]
        biases = [env[m.bias] for m in members] if members[0].bias is not None else None
        outs = grouped_gemm(a, weights, biases, [t.dtype for t in self.types], tiles, self.exact)
        for m, t, out in zip(members, self.types, outs):
            env[m.output] = out.reshape(t.shape)

    def _one_by_one(self, env) -> None:
        for step in self.alone:
            step(env)

    def _pick(self, env) -> object:
        """The fastest of the grouped launch's tilings and the GEMMs one by one (CUDA-graph replays)."""
        runners = {"alone": lambda: self._one_by_one(env)}
        runners.update({tiles: (lambda tiles=tiles: self._grouped(env, tiles)) for tiles in TILINGS})
        seconds = {}
        for key, fn in runners.items():
            try:
                seconds[key] = graph_bench(fn)[0]
            except Exception as err:  # noqa: BLE001 (a tiling that does not compile here is not a choice)
                log.debug("%s: %s: %s", self.group, key, err)
        best = min(seconds, key=seconds.get)
        log.info("%s: %s", self.group, ", ".join(f"{'one by one' if k == 'alone' else _tiles_text(k)} "
                                                  f"{s * 1e6:.1f} us" for k, s in seconds.items()))
        return best

    def __call__(self, env) -> None:
        shape = tuple(env[self.group.a].shape)
        if shape not in self.choice:
            self.choice[shape] = self._pick(env) if self.tune else (
                INTERPRETER_TILES if interpreting() else TILINGS[0])
        choice = self.choice[shape]
        if choice == "alone":
            self._one_by_one(env)
        else:
            self._grouped(env, choice)

    def __str__(self) -> str:
        return f"grouped GEMMs ({self.group})"


def _tiles_text(t: GemmTiles) -> str:
    return f"grouped {t.bm}x{t.bn}x{t.bk} w{t.num_warps} s{t.num_stages}"
