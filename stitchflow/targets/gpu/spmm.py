"""Sparse × dense products driven by the CSR metadata: out[i, j] = sum_m S[i, m] · D[m, j].

Two ways to lay the product over programs. By rows: one Triton program per row (or per few consecutive
rows) walks the row's non-zeros in chunks, gathers the matching rows of D (every feature at once: after
`reassociate.py` a GNN's products gather 7-16 features) and sums them with the values as weights, in fp32;
a row never waits for another, but a power-law graph's longest row (10^4 non-zeros) holds one program for
the whole kernel. Balanced: each program takes the same number of consecutive non-zeros whatever rows they
fall in, sums them per row by a segmented scan and adds each row's sum atomically. On the device the step
times every layout against torch's product (cuSPARSE) at the first call of each shape and keeps the
fastest; on the CPU without the interpreter it is torch's product."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...ir.graph import Graph, Node
from ...ir.index import Var
from ...ir.interpret import eval_node
from .reassociate import plain_product
from .runtime import interpreting

log = logging.getLogger("stitchflow.gpu.spmm")
MAX_FEATURES = 256
MAX_PRODUCTS = 8192  # a balanced program's products held at once (non-zeros x features): registers


def sparse_product(graph: Graph, node: Node) -> tuple[str, str] | None:
    """(S, D) when `node` is out[i, j] = sum_m S[i, m] · D[m, j] with S stored CSR and D dense."""
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1 or len(node.out_vars) != 2:
        return None
    reads = plain_product(node)
    if reads is None:
        return None
    (i, j), (m,) = node.out_vars, node.reduce_vars
    for s, d in (reads, reads[::-1]):
        s_format, d_type = graph.type_of[s.tensor].format, graph.type_of[d.tensor]
        if (s.indices == (Var(i), Var(m)) and d.indices == (Var(m), Var(j)) and not s_format.is_dense
                and d_type.format.is_dense and d_type.dtype.is_floating_point
                and node.extents[j] <= MAX_FEATURES):
            return s.tensor, d.tensor
    return None


@triton.jit
def _spmm_rows_kernel(crow_ptr, col_ptr, val_ptr, d_ptr, out_ptr, N, F, sd_m, sd_f, so_i, so_f,
                      BR: tl.constexpr, BNZ: tl.constexpr, BF: tl.constexpr):
    """BR consecutive rows per program, one after another, each walking its non-zeros BNZ at a time."""
    f = tl.arange(0, BF)
    f_ok = f < F
    for row in range(tl.program_id(0) * BR, tl.minimum(tl.program_id(0) * BR + BR, N)):
        start = tl.load(crow_ptr + row)
        end = tl.load(crow_ptr + row + 1)
        acc = tl.zeros([BF], tl.float32)
        for p in range(start, end, BNZ):
            at = p + tl.arange(0, BNZ)
            ok = at < end
            cols = tl.load(col_ptr + at, mask=ok, other=0)
            vals = tl.load(val_ptr + at, mask=ok, other=0.0).to(tl.float32)
            x = tl.load(d_ptr + cols[:, None] * sd_m + f[None, :] * sd_f, mask=ok[:, None] & f_ok[None, :],
                        other=0.0).to(tl.float32)
            acc += tl.sum(vals[:, None] * x, 0)
        tl.store(out_ptr + row * so_i + f * so_f, acc.to(out_ptr.dtype.element_ty), mask=f_ok)


def spmm(s: torch.Tensor, d: torch.Tensor, out_dtype: torch.dtype, bnz: int = 32, num_warps: int = 1,
         rows: int = 1) -> torch.Tensor:
    """S (sparse CSR, [N, M]) · D (dense, [M, F], any strides) as a new [N, F] tensor of `out_dtype`;
    `rows` > 1 takes that many consecutive rows per program."""
    n, f = s.shape[0], d.shape[1]
    out = torch.empty(n, f, dtype=out_dtype, device=d.device)
    if n == 0:
        return out
    args = (s.crow_indices(), s.col_indices(), s.values(), d, out)
    strides = (d.stride(0), d.stride(1), out.stride(0), out.stride(1))
    _spmm_rows_kernel[(triton.cdiv(n, rows),)](*args, n, f, *strides, BR=rows, BNZ=bnz,
                                               BF=max(16, triton.next_power_of_2(f)), num_warps=num_warps)
    return out


@triton.jit
def _same_row_add(v1, r1, v2, r2):
    # a segmented sum's operator: associative because a CSR's rows never decrease along the non-zeros
    return tl.where(r1 == r2, v1 + v2, v2), r2


@triton.jit
def _spmm_nnz_kernel(crow_ptr, col_ptr, val_ptr, d_ptr, acc_ptr, span_ptr, NNZ, F, sd_m, sd_f,
                     W: tl.constexpr, BF: tl.constexpr):
    """W consecutive non-zeros per program, whatever rows they fall in: a row of 10^4 non-zeros is spread
    over many programs instead of holding one. `span_ptr` holds, per program, one past the rows of its
    first and last non-zero; each non-zero's row is found by a binary search between the two (no steps
    when the chunk lies in one row). The products are summed per row by a segmented scan, and each row's
    sum is added atomically into the fp32 accumulator (several programs may share a row)."""
    p = tl.program_id(0)
    at = p * W + tl.arange(0, W)
    ok = at < NNZ
    first = (tl.load(span_ptr + 2 * p) - 1).to(tl.int32)
    last = (tl.load(span_ptr + 2 * p + 1) - 1).to(tl.int32)
    cols = tl.load(col_ptr + at, mask=ok, other=0)
    vals = tl.load(val_ptr + at, mask=ok, other=0.0).to(tl.float32)
    f = tl.arange(0, BF)
    f_ok = f < F
    x = tl.load(d_ptr + cols[:, None] * sd_m + f[None, :] * sd_f, mask=ok[:, None] & f_ok[None, :],
                other=0.0).to(tl.float32)
    products = vals[:, None] * x
    if first == last:  # a long row's chunk: a plain sum
        tl.atomic_add(acc_ptr + first * F + f, tl.sum(products, 0), mask=f_ok, sem="relaxed")
    else:
        low = tl.zeros([W], tl.int32) + first  # the last row in [first, last] starting at or before `at`
        high = tl.zeros([W], tl.int32) + last
        steps = last - first
        while steps > 0:
            mid = (low + high + 1) // 2
            after = tl.load(crow_ptr + mid) <= at
            low = tl.where(after, mid, low)
            high = tl.where(after, high, mid - 1)
            steps = steps // 2
        rows = tl.broadcast_to(low[:, None], [W, BF])
        sums, _ = tl.associative_scan((products, rows), 0, _same_row_add)
        run_end = ok & ((at + 1 == tl.load(crow_ptr + low + 1, mask=ok, other=0)) | (tl.arange(0, W) == W - 1))
        tl.atomic_add(acc_ptr + rows * F + f[None, :], sums, mask=run_end[:, None] & f_ok[None, :],
                      sem="relaxed")


_CHUNK_ENDS: dict = {}


def _chunk_ends(nnz: int, chunk: int, crow: torch.Tensor) -> torch.Tensor:
    """Each program's first and last non-zero, interleaved: depends on the counts alone, so kept."""
    key = (nnz, chunk, crow.dtype, crow.device)
    if key not in _CHUNK_ENDS:
        firsts = torch.arange(0, nnz, chunk, device=crow.device, dtype=crow.dtype)
        _CHUNK_ENDS[key] = torch.stack([firsts, (firsts + chunk).clamp_(max=nnz) - 1], 1).flatten()
    return _CHUNK_ENDS[key]


def spmm_balanced(s: torch.Tensor, d: torch.Tensor, out_dtype: torch.dtype, chunk: int = 64,
                  num_warps: int = 1) -> torch.Tensor:
    """S (sparse CSR, [N, M]) · D (dense, [M, F]) with `chunk` non-zeros per program (see the kernel).
    Rows split between programs are summed in whatever order their atomic adds land."""
    n, f = s.shape[0], d.shape[1]
    crow, nnz = s.crow_indices(), s.col_indices().numel()
    acc = torch.zeros(n, f, dtype=torch.float32, device=d.device)
    if nnz == 0 or f == 0:
        return acc.to(out_dtype)
    features = max(16, triton.next_power_of_2(f))
    chunk = min(chunk, max(16, MAX_PRODUCTS // features))
    span = torch.searchsorted(crow, _chunk_ends(nnz, chunk, crow), right=True)
    _spmm_nnz_kernel[(triton.cdiv(nnz, chunk),)](crow, s.col_indices(), s.values(), d, acc, span, nnz, f,
                                                 d.stride(0), d.stride(1), W=chunk, BF=features,
                                                 num_warps=num_warps)
    return acc if out_dtype == torch.float32 else acc.to(out_dtype)


@dataclass(frozen=True)
class SpmmConfig:
    """How a product is laid over programs: `rows` consecutive rows per program, each walking its
    non-zeros `chunk` at a time (a row never waits for another), or, `balanced`, `chunk` consecutive
    non-zeros per program whatever rows they fall in (a power-law graph's longest row spread evenly)."""
    chunk: int
    warps: int
    rows: int = 1
    balanced: bool = False

    def __call__(self, s: torch.Tensor, d: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        if self.balanced:
            return spmm_balanced(s, d, out_dtype, self.chunk, self.warps)
        return spmm(s, d, out_dtype, self.chunk, self.warps, self.rows)

    def __str__(self) -> str:
        if self.balanced:
            return f"triton balanced nnz{self.chunk} w{self.warps}"
        return f"triton bnz{self.chunk} w{self.warps} rows{self.rows}"


# Several rows per program never won on the device (session 13), nor did balanced chunks of 256
# (the scan's cost grows with the chunk; scripts/spmm_probe.py)
CONFIGS = (SpmmConfig(32, 1), SpmmConfig(64, 2),
           SpmmConfig(32, 1, balanced=True), SpmmConfig(64, 1, balanced=True), SpmmConfig(64, 2, balanced=True),
           SpmmConfig(128, 4, balanced=True))
MARGIN = 0.95  # our kernel replaces torch's only when this much faster: the choice holds across processes


class SpmmStep:
    """A CSR × dense product: our kernel, or torch's where that times faster (decided per shape)."""

    def __init__(self, graph: Graph, node: Node, operands: tuple[str, str]):
        self.graph, self.node = graph, node
        self.sparse, self.dense = operands
        self.out_type = graph.type_of[node.name]
        self.choice: dict = {}

    def _torch(self, env) -> torch.Tensor:
        return eval_node(self.node, env, self.out_type)

    def _choose(self, s, d, env):
        # CUDA-graph replays: plain calls would time the host's launches (on the lent machine 15-20 µs
        # a torch op), which a program replaying its graph does not pay
        from .timing import graph_bench

        runners = {"torch": lambda: self._torch(env)}
        for config in CONFIGS:
            runners[config] = lambda config=config: config(s, d, self.out_type.dtype)
        seconds = {}
        for name, run in runners.items():
            try:
                seconds[name] = graph_bench(run)[0]
            except Exception as err:  # a config the device cannot run: skip it
                log.info("%s %s failed: %s", self.node.name, name, err)
        log.info("%s: %s", self.node.name, ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in seconds.items()))
        best = min(seconds, key=seconds.get)
        return best if best == "torch" or seconds[best] < MARGIN * seconds.get("torch", float("inf")) else "torch"

    def __call__(self, env) -> None:
        s, d = env[self.sparse], env[self.dense]
        if s.layout != torch.sparse_csr or (d.device.type == "cpu" and not interpreting()):
            env[self.node.name] = self._torch(env)
            return
        key = (tuple(s.shape), s.values().numel() > 0, tuple(d.shape), d.dtype, d.device.type)
        if key not in self.choice:
            self.choice[key] = CONFIGS[0] if d.device.type != "cuda" else self._choose(s, d, env)
        config = self.choice[key]
        if config == "torch":
            env[self.node.name] = self._torch(env)
            return
        env[self.node.name] = config(s, d, self.out_type.dtype)

    def __str__(self) -> str:
        chosen = ", ".join(sorted({str(c) for c in self.choice.values()})) or "chosen at the first call"
        return f"spmm({self.node.name}: {self.sparse} CSR · {self.dense}; {chosen})"
