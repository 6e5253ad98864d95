"""Sparse × dense products driven by the CSR metadata: out[i, j] = sum_m S[i, m] · D[m, j].

One Triton program per row of S (or per few consecutive rows) walks a row's non-zeros in chunks, gathers the matching rows of D
(every feature at once: after `reassociate.py` a GNN's products gather 7-16 features) and sums them with
the values as weights, in fp32. A row never waits for another, so a power-law graph's long rows cost only
their own programs. On the device the step times itself against torch's product (cuSPARSE) at the first
call of each shape and keeps the faster; on the CPU without the interpreter it is torch's product.
"""

from __future__ import annotations

import logging

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


# (non-zeros per chunk, warps, rows per program)
CONFIGS = ((32, 1, 1), (64, 2, 1), (32, 1, 8), (64, 2, 8), (32, 1, 32), (64, 2, 32))
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
        from .timing import timed_median

        runners = {"torch": lambda: self._torch(env)}
        for config in CONFIGS:
            runners[config] = lambda config=config: spmm(s, d, self.out_type.dtype, *config)
        seconds = {}
        for name, run in runners.items():
            try:
                run()
                torch.cuda.synchronize()
                seconds[name] = timed_median(run, budget_s=0.02)
            except Exception as err:  # a config the device cannot run: skip it
                log.info("%s %s failed: %s", self.node.name, name, err)
        log.info("%s: %s", self.node.name, ", ".join(f"{_label(k)} {v * 1e6:.1f} us" for k, v in seconds.items()))
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
        env[self.node.name] = spmm(s, d, self.out_type.dtype, *config)

    def __str__(self) -> str:
        chosen = ", ".join(sorted({_label(c) for c in self.choice.values()})) or "chosen at the first call"
        return f"spmm({self.node.name}: {self.sparse} CSR · {self.dense}; {chosen})"


def _label(config) -> str:
    return config if config == "torch" else "triton bnz{} w{} rows{}".format(*config)
