"""Grouped GEMMs: the contractions frontend/ops_grouped.py makes of a mixture of experts' products, run as one
grouped GEMM per call. As a plain contraction they would run as an einsum over a gathered copy of the weights, one
expert's weight per row (rows x K x N elements).

Two shapes, each recognised by a group tensor that a node tagged `grouped_mm` made (the tag promises that the
groups are sorted along the jagged variable, as torch's offsets are):
- gathered: out[j, n] = sum_k x[j, k] * w[group[j], k, n], the variables in any order and either operand's other
  indices anything a dense operand can be read through (the rows and columns forms; x is often a gather of tokens);
- jagged reduction: out[e, m, n] = sum_s a[m, s] * b[s, n] * member[e, s] (weight gradients), member one-hot.
On CUDA in bfloat16 the product is torch._grouped_mm (CUTLASS's grouped kernels), elsewhere one torch.mm per
group over the offsets (a host sync, as transformers' fallback does).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ...ir.expr import Access
from ...ir.graph import Graph, Node
from ...ir.index import Gather, Var
from .analysis import factor_access, product_factors
from .contraction import dense_operand

log = logging.getLogger("stitchflow.gpu.grouped")
GROUP_TAG = "grouped_mm"  # frontend/ops_grouped.py's tag on the nodes that make groups
GROUP_VAR = "_group"


@dataclasses.dataclass(frozen=True)
class GroupedGemm:
    node: Node
    kind: str  # "gathered" | "jagged"
    jagged: str  # the variable the groups run along
    reduced: str  # the contraction's reduction variable (the jagged one for "jagged")
    left: int  # factor positions in the node's product: x (or a) ...
    right: int  # ... w (or b)
    groups: str  # the group tensor ("gathered") or the member mask ("jagged")
    count: int  # number of groups
    member_axis: int = 1  # the member mask's axis along the jagged variable

    def describe(self) -> str:
        if self.kind == "jagged":
            return f"{self.count} groups along the reduction {self.jagged} (a weight gradient), members {self.groups}"
        return f"{self.count} groups of {self.jagged}, each its weight's product, groups {self.groups}"

    def __call__(self, env, out_dtype: torch.dtype, cache: dict) -> torch.Tensor:
        factors = product_factors(self.node.body)
        device = env[self.groups].device
        if self.kind == "gathered":
            x = self._operand(factors[self.left], self.node, env, device, cache, (self.jagged, self.reduced))
            out_var = next(v for v in self.node.out_vars if v != self.jagged)
            node, access = self._ungathered(factors[self.right])
            w = self._operand(access, node, env, device, cache, (GROUP_VAR, self.reduced, out_var))
            ends = torch.searchsorted(env[self.groups].contiguous(), torch.arange(self.count, device=device),
                                      right=True)
            out = grouped_rows(x, w, ends, out_dtype)  # [jagged, out_var]
            order = [(self.jagged, out_var).index(v) for v in self.node.out_vars]
            return out.permute(order).contiguous()
        a = self._operand(factors[self.left], self.node, env, device, cache, (None, self.reduced))
        b = self._operand(factors[self.right], self.node, env, device, cache, (self.reduced, None))
        ends = torch.cumsum(env[self.groups].sum(dim=self.member_axis, dtype=torch.int64), 0)
        out = grouped_reduction(a, b, ends, out_dtype)  # [group, m, n]
        m_var = self._vars(factors[self.left]) - {self.reduced}
        n_var = self._vars(factors[self.right]) - {self.reduced}
        group_var = set(self.node.out_vars) - m_var - n_var
        names = [*group_var, *m_var, *n_var]
        return out.permute([names.index(v) for v in self.node.out_vars]).contiguous()

    def _vars(self, factor) -> set:
        return set(factor_access(factor).vars)

    def _ungathered(self, factor) -> tuple[Node, Access]:
        """The weight's read with its gathered group index replaced by a variable of its own."""
        access = factor_access(factor)
        indices = tuple(Var(GROUP_VAR) if isinstance(i, Gather) else i for i in access.indices)
        node = dataclasses.replace(self.node, dims=self.node.dims + ((GROUP_VAR, self.count),))
        return node, Access(access.tensor, indices)

    @staticmethod
    def _operand(factor_or_access, node: Node, env, device, cache: dict, want: tuple) -> torch.Tensor:
        """The operand as a dense tensor with its variables in the order `want` names (None: the one not named)."""
        access = factor_or_access if isinstance(factor_or_access, Access) else factor_access(factor_or_access)
        t, names = dense_operand(access, node, env, device, cache)
        want = [v if v is not None else next(n for n in names if n not in want) for v in want]
        return t.permute([names.index(v) for v in want])


def _library(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor | None:
    """torch._grouped_mm's product, or None where it does not take these operands (its layout rules are the
    kernels'; the loop of GEMMs then runs, and the refusal is logged once per reason)."""
    if not _library_grouped(a, b, out_dtype):
        return None
    try:
        return torch._grouped_mm(_column_or_row_major(a), _column_or_row_major(b), offs=ends.to(torch.int32))
    except RuntimeError as err:
        reason = str(err).splitlines()[0]
        if reason not in _REFUSED:
            _REFUSED.add(reason)
            log.info("torch._grouped_mm refused %s x %s (%s); a loop of GEMMs runs instead", tuple(a.shape),
                     tuple(b.shape), reason)
        return None


_REFUSED: set = set()


def grouped_rows(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out[rows of group e] = x[those rows] @ w[e]; `ends` the groups' cumulative ends (the last takes every row)."""
    found = _library(x.contiguous(), w, ends, out_dtype)
    if found is not None:
        return found
    out = x.new_empty((x.shape[0], w.shape[2]), dtype=out_dtype)
    compute = _compute_dtype(x, w, out_dtype)
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = (x[start:end].to(compute) @ w[group].to(compute)).to(out_dtype)
        start = end
    out[start:] = 0
    return out


def grouped_reduction(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """out[e] = a[:, group e's columns] @ b[group e's rows]; an empty group's product is zero."""
    found = _library(a, b, ends, out_dtype)
    if found is not None:
        return found
    out = a.new_zeros((ends.numel(), a.shape[0], b.shape[1]), dtype=out_dtype)
    compute = _compute_dtype(a, b, out_dtype)
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[group] = (a[:, start:end].to(compute) @ b[start:end].to(compute)).to(out_dtype)
        start = end
    return out


def _compute_dtype(a, b, out_dtype) -> torch.dtype:
    """The operands' dtype where they share the output's (torch's GEMMs accumulate half types in float32)."""
    return out_dtype if a.dtype == b.dtype == out_dtype else torch.promote_types(out_dtype, torch.float32)


def _library_grouped(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """torch._grouped_mm takes it: CUDA, bfloat16 throughout, rows of 16-byte multiples."""
    return (a.is_cuda and a.dtype == b.dtype == out_dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")
            and a.shape[-1] % 8 == 0 and b.shape[-1] % 8 == 0)


def _column_or_row_major(w: torch.Tensor) -> torch.Tensor:
    """w itself when its (each group's) matrix is row- or column-major: transformers hands over weight.transpose,
    AOTAutograd's weight gradient the activations transposed."""
    if w.stride(-1) == 1 or w.stride(-2) == 1:
        return w
    return w.contiguous()


def match_grouped_gemm(graph: Graph, node: Node) -> GroupedGemm | None:
    """The node as a grouped GEMM over groups a `grouped_mm` node made, or None."""
    if node.reduce != "sum" or node.is_scatter or len(node.reduce_vars) != 1:
        return None
    factors = product_factors(node.body)
    accesses = [factor_access(f) for f in factors or ()]
    if not accesses or any(a is None for a in accesses):
        return None
    if not all(graph.type_of[t].format.is_dense for t in node.inputs):
        return None
    reduced = node.reduce_vars[0]
    if len(factors) == 2 and len(node.out_vars) == 2:
        return _match_gathered(graph, node, accesses, reduced)
    if len(factors) == 3 and len(node.out_vars) == 3:
        return _match_jagged(graph, node, accesses, reduced)
    return None


def _made_groups(graph: Graph, tensor: str) -> bool:
    producer = graph.node_of.get(tensor)
    return producer is not None and producer.tag is not None and producer.tag.kind == GROUP_TAG


def _match_gathered(graph: Graph, node: Node, accesses, reduced: str) -> GroupedGemm | None:
    for right, w in enumerate(accesses):
        gathers = [i for i in w.indices if isinstance(i, Gather)]
        if len(gathers) != 1 or not _made_groups(graph, gathers[0].tensor):
            continue
        (group,) = gathers
        if len(group.indices) != 1 or not isinstance(group.indices[0], Var):
            continue
        jagged = group.indices[0].name
        rest = [i for i in w.indices if i is not group]
        out_var = next((v for v in node.out_vars if v != jagged), None)
        if jagged not in node.out_vars or sorted(i.name for i in rest if isinstance(i, Var)) != sorted(
                (reduced, out_var)) or len(rest) != 2:
            continue
        x = accesses[1 - right]
        if x.vars != {jagged, reduced}:
            continue
        return GroupedGemm(node, "gathered", jagged, reduced, 1 - right, right, group.tensor,
                           graph.type_of[w.tensor].shape[w.indices.index(group)])
    return None


def _match_jagged(graph: Graph, node: Node, accesses, reduced: str) -> GroupedGemm | None:
    members = [k for k, a in enumerate(accesses) if _made_groups(graph, a.tensor) and a.is_plain]
    if len(members) != 1:
        return None
    member = accesses[members[0]]
    group_vars = member.vars - {reduced}
    if reduced not in member.vars or len(group_vars) != 1:
        return None
    left, right = (k for k in range(3) if k != members[0])
    a, b = accesses[left], accesses[right]
    if len(a.vars) != 2 or len(b.vars) != 2 or reduced not in a.vars & b.vars or (a.vars | b.vars) & group_vars:
        return None
    names = [i.name for i in member.indices]
    return GroupedGemm(node, "jagged", reduced, reduced, left, right, member.tensor,
                       graph.type_of[member.tensor].shape[names.index(*group_vars)], names.index(reduced))
